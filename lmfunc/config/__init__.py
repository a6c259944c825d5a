"""Configuration: frozen dataclasses passed explicitly, model presets, YAML files.

``ModelConfig`` (``lmfunc.config.model``) describes the network; ``TrainConfig``
(``lmfunc.config.train``) is the whole run, one section per concern; ``lmfunc.config.yaml_io``
reads and writes it as YAML.
"""

from lmfunc.config.model import MODEL_PRESETS, ConfigError, ModelConfig, model_preset, validate_model

__all__ = ["MODEL_PRESETS", "ConfigError", "ModelConfig", "model_preset", "validate_model"]
