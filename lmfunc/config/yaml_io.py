"""Read and write ``TrainConfig`` as YAML.

A config file has one mapping per section (``model:``, ``data:``, ``optim:`` ...) and optionally
a top-level ``preset: NAME`` that picks the model preset the ``model:`` keys then override.
String values may use ``${ENV_VAR}`` or ``${ENV_VAR:-default}``. Values are checked against the
field types; unknown keys are errors with a did-you-mean. ``save_config`` writes every field, so
``load_config`` of a saved snapshot gives back an identical config.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from typing import Any, Literal, Optional, Union, get_args, get_origin

import yaml

from lmfunc.config.model import ConfigError, ModelConfig, model_preset
from lmfunc.config.train import TrainConfig

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(value: Any, where: str, source: str) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, f"{where}.{k}" if where else str(k), source) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError(
            f"{source}: {where} uses ${{{name}}} but the environment variable {name} is not set; "
            f"export {name}=... or give a default with ${{{name}:-value}}"
        )

    return _ENV.sub(substitute, value)


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path`` with ``${ENV}`` references substituted."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; pass a YAML file (e.g. configs/<name>.yaml)") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, run: ...), got {type(data).__name__}")
    return _interpolate(data, "", path)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _kind(hint: Any) -> str:
    """How a YAML value of type ``hint`` is written, for messages: "an integer", "a list" ..."""
    kinds = {int: "an integer", float: "a number", str: "a string", bool: "true or false", tuple: "a list",
             list: "a list"}
    return kinds.get(get_origin(hint) or hint, _type_name(hint))


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` (from YAML) as the type ``hint``, or a ``ConfigError`` naming ``where``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], where)
        for candidate in inner:  # the first type the value converts to (an int before a list of ints)
            try:
                return _convert(value, candidate, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {' or '.join(_kind(a) for a in inner)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint_text = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: {value!r} is not one of {list(args)}{hint_text}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of {hint.__name__} fields, got {value!r}")
        return dataclass_from_dict(hint, value, where)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} values, got {len(value)}: {value!r}")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            number = float(value) if isinstance(value, (str, float)) else None
        except ValueError:
            number = None
        if number is not None and number.is_integer():
            return int(number)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r}")


def _unknown_key(cls: type, key: str, where: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        hint = f"; did you mean {where + '.' if where else ''}{close[0]}?"
    else:
        sections = [f.name for f in dataclasses.fields(TrainConfig)]
        owners = [s for s in sections if key in {f.name for f in dataclasses.fields(_section_type(s))}]
        hint = f"; did you mean {owners[0]}.{key}?" if owners else f". Known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {where + '.' if where else ''}{key} (in {cls.__name__}){hint}")


def _section_type(name: str) -> type:
    return typing.get_type_hints(TrainConfig)[name]


def dataclass_from_dict(cls: type, data: dict, where: str = "", base: Optional[Any] = None) -> Any:
    """An instance of dataclass ``cls`` from ``data``; missing fields come from ``base`` (or defaults)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in names:
            raise _unknown_key(cls, key, where, names)
        path = f"{where}.{key}" if where else key
        sub_base = getattr(base, key) if base is not None else None
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            values[key] = dataclass_from_dict(hints[key], value, path, sub_base)
        else:
            values[key] = _convert(value, hints[key], path)
    return dataclasses.replace(base, **values) if base is not None else cls(**values)


def train_config_from_dict(data: dict, preset: Optional[str] = None, source: str = "config") -> TrainConfig:
    """A ``TrainConfig`` from a nested mapping; ``preset`` (or the mapping's ``preset:`` key) picks the
    model preset its ``model:`` keys override."""
    data = dict(data)
    yaml_preset = data.pop("preset", None)
    name = preset if preset is not None else yaml_preset
    base = TrainConfig(model=model_preset(name) if name is not None else ModelConfig())
    try:
        return dataclass_from_dict(TrainConfig, data, "", base)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def load_config(path: Optional[str] = None, preset: Optional[str] = None) -> TrainConfig:
    """The defaults, overridden by ``preset`` and then by the YAML file at ``path`` (if given)."""
    data = read_yaml(path) if path is not None else {}
    return train_config_from_dict(data, preset, source=path or "config")


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_to_dict(cfg: TrainConfig) -> dict:
    """Every field of ``cfg`` as nested plain dicts/lists (YAML- and JSON-ready)."""
    return _plain(dataclasses.asdict(cfg))


def config_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as YAML text, fields in declaration order."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg: TrainConfig, path: str) -> None:
    """Write ``cfg`` to ``path`` as YAML; ``load_config(path)`` gives back an equal config."""
    with open(path, "w") as f:
        f.write(config_yaml(cfg))


__all__ = ["config_to_dict", "config_yaml", "dataclass_from_dict", "load_config", "read_yaml", "save_config",
           "train_config_from_dict"]
