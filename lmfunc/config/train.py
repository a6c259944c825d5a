"""``TrainConfig``: one frozen dataclass tree describing a whole training run.

Sections: ``model`` (the network, ``lmfunc.config.model``), ``parallel`` (the mesh,
``lmfunc.config.parallel``), and ``data``, ``optim``, ``precision``, ``checkpoint``, ``log`` and
``run`` (``lmfunc.config.sections``). Field names follow Megatron-LM's arguments; the field
docstrings are the ``--help`` text of ``python -m lmfunc.train``. ``TrainConfig.validate`` runs
every section's checks (``lmfunc.config.train_checks``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lmfunc.config.model import ModelConfig
from lmfunc.config.parallel import ParallelConfig
from lmfunc.config.sections import (CheckpointConfig, DataConfig, LogConfig, OptimConfig, PrecisionConfig, RunConfig,
                                    ScheduleLengths, schedule_lengths)
from lmfunc.config.train_checks import (resolve_global_batch_size, validate_batch, validate_checkpoint, validate_data,
                                        validate_layout, validate_length, validate_log, validate_mesh, validate_optim,
                                        validate_pipeline, validate_precision, validate_run)


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self, world_size: int = 1, planning: bool = False) -> "TrainConfig":
        """Raise ``ConfigError`` naming the fields and the fix when settings contradict (the parallel
        sizes checked against ``world_size`` processes); return the config with its parallel sizes
        resolved for ``world_size`` (``ParallelConfig.resolved``) and an unset
        ``run.global_batch_size`` resolved (``resolve_global_batch_size``). ``planning`` also accepts
        layouts and models only ``lmfunc.plan`` handles (pp, cp, ep, MoE, MLA)."""
        parallel = self.parallel.resolved(world_size)
        dp = parallel.data_parallel_size(world_size)
        cfg = self.replace(parallel=parallel,
                           run=dataclasses.replace(self.run, global_batch_size=resolve_global_batch_size(self.run, dp)))
        validate_train(cfg, world_size, planning)
        return cfg

    def replace(self, **sections: object) -> "TrainConfig":
        return dataclasses.replace(self, **sections)


def validate_train(cfg: TrainConfig, world_size: int = 1, planning: bool = False) -> None:
    """Cross-field checks of a ``TrainConfig`` run on ``world_size`` processes, its parallel sizes
    resolved (each section's own fields are checked too). ``planning`` accepts the model settings
    only ``lmfunc.plan`` handles (``lmfunc.config.model.unbuildable_features``)."""
    validate_layout(cfg.model, cfg.parallel, world_size, planning)
    validate_batch(cfg.run, cfg.parallel.data_parallel_size(world_size))
    validate_pipeline(cfg.model, cfg.parallel, cfg.run, world_size)
    validate_length(cfg.run, cfg.optim)
    validate_data(cfg.data, cfg.model)
    validate_optim(cfg.optim)
    validate_log(cfg.log, world_size)
    validate_run(cfg.run)
    validate_checkpoint(cfg.checkpoint)
    validate_precision(cfg.precision)
    validate_mesh(cfg.model, cfg.parallel, cfg.data.seq_length, world_size)


__all__ = [
    "CheckpointConfig", "DataConfig", "LogConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig",
    "ScheduleLengths", "TrainConfig", "resolve_global_batch_size", "schedule_lengths", "validate_train",
]
