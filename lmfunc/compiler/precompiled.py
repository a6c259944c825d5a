"""A compiled step saved whole, so that a restarted job skips Dynamo's trace (torch's precompile).

Inductor's and AOTAutograd's caches spare a restarted job the code generation (``compiling``), but
every process still traces the step with Dynamo, the larger part of a warm restart. torch 2.13's
``aot_compile`` keeps what that trace produced (the step's rewritten bytecode, the guards on its
arguments and the compiled graph) and ``torch.compiler.load_compiled_function`` restores it in
another process.

A loaded step is the step as it was traced: the values its code closed over (the model config,
the optimizer's hyperparameters, the lr schedule) and the code of every function it called are
baked into it, and its guards check only the arguments and torch's global state. So the file is
found by a key (``step_key``) that hashes all of these: the step function with its closure,
serialised the way torch serialises it (nested functions by their code and closure, down to the
last value) together with the code of the functions it names; every lmfunc source file; the
sources of the loaded modules outside installed packages (the user's own); the arguments' tree
structure, shapes, strides, dtypes and devices; the torch and Python versions, torch's compiler
settings and thread count (``_code_digest``, ``_settings_signature``). A changed value, source or
setting is another key, so another file. A function replaced at run time inside a module that
the step reaches only through that module's globals (a monkeypatch) is not seen: code that does
this compiles with ``compile_step``.

Whatever goes wrong (a file that does not load, arguments its guards refuse, a trace that
``aot_compile`` cannot save, a save that fails) falls back to ``compile_step``'s ordinary compile
with a warning that says why; the step runs either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import site
import sys
import sysconfig
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lmfunc.compiler.torch_compat.inductor import cache_dir, inductor_config
from lmfunc.compiler.torch_compat.tensors import pytree
from lmfunc.compiler.torch_compat.tracing import AOTCompilePickler, FakeTensorMode, TracingContext, functorch_config, tracing
from lmfunc.compiler.compiling import (
    compile_settings, _older_objects_frozen, compile_step, inductor_options, release_compile_garbage,
    tracing_settings,
)
from lmfunc.compiler.isa_probe import start_vec_isa_probe

_LMFUNC_ROOT = Path(__file__).resolve().parents[1]


def default_directory() -> Path:
    """``<Inductor's cache dir>/lmfunc_steps``: beside the caches whose entries a saved step uses."""
    return Path(cache_dir()) / "lmfunc_steps"


class _RecordingPickler(AOTCompilePickler):
    """torch's precompile pickler that also records what it pickles by reference (by module and
    name, not by value): the modules of those functions and classes (``modules``) and the
    functions' code objects (``code``), which a function replaced at run time changes although
    its module's file does not."""

    def __init__(self, buffer: io.BytesIO) -> None:
        super().__init__({}, buffer)
        self.modules: set[str] = set()
        self.code: dict[str, types.CodeType] = {}

    def reducer_override(self, obj: Any) -> Any:
        by_name = isinstance(obj, type) or callable(obj)
        qualname = getattr(obj, "__qualname__", "<locals>")
        if by_name and "<locals>" not in qualname:
            module = getattr(obj, "__module__", None)
            if module:
                self.modules.add(module)
            if isinstance(obj, types.FunctionType):
                self.code[f"{module}.{qualname}"] = obj.__code__
        return super().reducer_override(obj)


def _closure_digest(fn: Callable) -> tuple[str, set[str]]:
    """sha256 of ``fn`` serialised as torch's precompile serialises it (functions defined inside
    others by their code and closure, down to the values; the rest by module and name) and of the
    code of the functions it refers to by name; and the modules of what it refers to by name."""
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    pickler.dump(fn)
    pickler.dump(sorted(pickler.code.items()))
    if pickler.errors:
        raise TypeError(f"the step refers to objects that cannot be serialised: {list(pickler.errors.values())}")
    return hashlib.sha256(buffer.getvalue()).hexdigest(), pickler.modules


def _installed_directories() -> tuple[str, ...]:
    """The standard library's and the installed packages' directories."""
    paths = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)


def _generated_directories() -> tuple[str, ...]:
    """Where torch writes the code it generates and imports (Inductor's kernels and wrappers):
    compiled steps, not the user's code, and loaded only once something has been compiled."""
    return (os.path.join(os.path.realpath(cache_dir()), ""),)


def _source_file(module_name: str) -> Optional[str]:
    path = getattr(sys.modules.get(module_name), "__file__", None)
    return os.path.realpath(path) if path and os.path.isfile(path) else None


def _code_digest(referenced: set[str]) -> str:
    """sha256 over the code a traced step may have run: every source file of lmfunc; the source
    of every loaded module outside installed packages and the standard library (the user's own
    modules, the running script); and, for the installed modules (torch aside: its version is in
    the key) that the step refers to by name, the file's size and modification time, which a
    reinstalled package changes. Code that torch generated and imported is not the step's source
    and is left out. A module loaded in one process and not in the other costs a miss, no more."""
    installed, generated = _installed_directories(), _generated_directories()
    digest = hashlib.sha256()
    for path in sorted(_LMFUNC_ROOT.rglob("*.py")):
        digest.update(f"{path.relative_to(_LMFUNC_ROOT)}\0".encode() + path.read_bytes())
    for name in sorted(sys.modules):
        path = _source_file(name)
        if name.split(".")[0] in ("lmfunc", "torch") or path is None or path.startswith(generated):
            continue
        if not path.startswith(installed):
            digest.update(f"{name}\0".encode() + Path(path).read_bytes())
        elif name in referenced:
            status = os.stat(path)
            digest.update(f"{name}\0{path}\0{status.st_size}:{status.st_mtime_ns}".encode())
    return digest.hexdigest()


def _arguments_signature(args: tuple) -> str:
    leaves, spec = pytree.tree_flatten(args)
    described = [
        (type(leaf).__name__, tuple(leaf.shape), leaf.stride(), str(leaf.dtype), str(leaf.device), leaf.requires_grad)
        if isinstance(leaf, torch.Tensor) else repr(leaf)
        for leaf in leaves
    ]
    return repr((str(spec), described))


def _settings_signature() -> str:
    return repr((
        torch.__version__, sys.version, sorted(inductor_config.save_config_portable().items()),
        sorted(functorch_config.save_config_portable().items()),
        torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled(),
    ))


def step_key(fn: Callable, args: tuple, choose_saved: bool) -> str:
    """The hex key of the saved step for ``fn`` called with ``args`` (see the module docstring)."""
    closure, referenced = _closure_digest(fn)
    parts = (closure, _code_digest(referenced), _arguments_signature(args), _settings_signature(), repr(choose_saved))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def _warn(message: str) -> None:
    warnings.warn(f"precompiled step: {message}", stacklevel=4)


@contextlib.contextmanager
def _discarded_tracing_context():
    """A tracing context that is thrown away: loading a saved step rebuilds its guards' sources,
    and some of them (``ImportSource``, for the modules a graph imports, as ``scan``'s does) install
    a guard in the current tracing context as they are created, which fails outside a trace. The
    loaded step has these guards already."""
    with tracing(TracingContext(FakeTensorMode())):
        yield


def _load(path: Path, fn: Callable, args: tuple) -> Optional[Any]:
    """The step saved at ``path`` if it loads and its guards accept ``args``, else None (warned)."""
    try:
        with open(path, "rb") as file, _discarded_tracing_context(), compile_settings():
            loaded = torch.compiler.load_compiled_function(file, f_globals=fn.__globals__)
    except Exception as error:  # a damaged or incompatible file: compile again, and replace it
        _warn(f"{path} could not be loaded ({type(error).__name__}: {error}); compiling the step again")
        return None
    loaded.disable_guard_check()
    if not loaded.guard_check(*args):
        _warn(f"the guards of {path} refuse this call's arguments or torch settings; compiling the step again")
        return None
    return loaded


def _compile_and_save(fn: Callable, args: tuple, choose_saved: bool, path: Path) -> Optional[Any]:
    """``fn`` compiled for ``args`` by ``aot_compile`` and saved at ``path``; None (warned) when
    torch cannot compile it that way."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="inductor",
                             options=inductor_options(choose_saved))
    try:
        with tracing_settings(), _older_objects_frozen():
            try:
                with compile_settings():
                    saved = compiled.aot_compile((args, {}))
            finally:
                release_compile_garbage()  # while the older objects are frozen: it scans what the compile made
    except Exception as error:  # the trace cannot be kept whole: the ordinary compile can still run it
        _warn(f"torch could not precompile the step ({type(error).__name__}: {error}); compiling it the "
              "ordinary way")
        return None
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another job may load `path` meanwhile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        saved.save_compiled_function(str(partial))
        os.replace(partial, path)
    except Exception as error:  # the step is compiled; only the next restart pays for this
        partial.unlink(missing_ok=True)
        _warn(f"could not save {path} ({type(error).__name__}: {error}); a restart will compile the step again")
    saved.disable_guard_check()
    return saved


def _saved_or_compiled(fn: Callable, args: tuple, choose_saved: bool, directory: Path) -> Optional[Any]:
    """The first call's step: loaded from ``directory`` when saved before, else compiled and saved."""
    try:
        path = directory / f"{step_key(fn, args, choose_saved)}.bin"
    except Exception as error:  # a closure torch cannot serialise: no key, so no saved step
        _warn(f"no key for the step ({type(error).__name__}: {error}); compiling it the ordinary way")
        return None
    loaded = _load(path, fn, args) if path.exists() else None
    return loaded if loaded is not None else _compile_and_save(fn, args, choose_saved, path)


def precompiled_step(fn: Callable, choose_saved: bool = True, directory: Optional[Path] = None) -> Callable:
    """``fn`` compiled like ``compile_step(fn)``, saved whole under ``directory`` (default
    ``default_directory()``) on its first call, or loaded from there when a step with the same key
    was saved before. Every call checks the step's guards on its arguments; once they refuse a
    call (other shapes, say), an ordinary ``compile_step`` of ``fn`` runs that call and the rest."""
    saved: Optional[Any] = None
    ordinary: Optional[Callable] = None
    first = True

    def call(*args):
        nonlocal saved, ordinary, first
        if first:
            first = False
            start_vec_isa_probe(args)
            saved = _saved_or_compiled(fn, args, choose_saved, Path(directory or default_directory()))
        elif saved is not None and not saved.guard_check(*args):
            _warn("the step's guards refuse this call's arguments; compiling it the ordinary way")
            saved = None
        if saved is not None:
            return saved(*args)
        if ordinary is None:
            ordinary = compile_step(fn, "inductor", choose_saved)
        return ordinary(*args)

    return call
