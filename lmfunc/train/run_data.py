"""A run's data: its train and validation datasets with Megatron's sample counts, and this rank's
part of each global batch (Megatron's sequential sampler)."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.data.batch import lm_batch
from lmfunc.data.pipeline import build_datasets
from lmfunc.parallel.mesh import Layout, data_parallel_rank
from lmfunc.parallel.sharding import local_batch_to_dtensor


def run_datasets(cfg: TrainConfig, tokenizer, train_iters: int) -> tuple[object, Optional[object]]:
    """Train and validation datasets with Megatron's sample counts: train = train_samples (or
    train_iters x global batch); valid = (train_iters // eval_interval + 1) x eval_iters x global batch."""
    data, run = cfg.data, cfg.run
    train_samples = run.train_samples if run.train_samples is not None else train_iters * run.global_batch_size
    valid_samples = (train_iters // run.eval_interval + 1) * run.eval_iters * run.global_batch_size
    seed = run.seed if data.seed is None else data.seed
    cache_dir = data.cache_dir or os.path.join(run.out_dir, "cache")
    datasets = build_datasets(data, tokenizer, {"train": train_samples, "valid": valid_samples}, seed, cache_dir)
    if datasets["train"] is None:
        raise ConfigError(f"data.split {data.split!r} leaves no training data; give the first split a weight")
    if run.eval_iters > 0 and datasets["valid"] is None:
        raise ConfigError(
            f"data.split {data.split!r} leaves no validation data but run.eval_iters is {run.eval_iters}; "
            "give the validation split a weight or set run.eval_iters to 0"
        )
    return datasets["train"], datasets["valid"]


def global_batch_part(dataset, start: int, microbatches: int, cfg: TrainConfig, tokenizer, layout: Layout) -> dict:
    """This rank's part of the global batch that starts at sample ``start``, Megatron's sequential
    sampler: microbatch j covers samples ``start + j * micro * dp ...``, of which data-parallel rank
    r loads ``micro`` from offset ``r * micro``. A ``[microbatches, micro_batch_size, S]`` batch, as
    DTensors of the global batch on a mesh (plain tensors on a pipeline rank)."""
    micro, dp, rank = cfg.run.micro_batch_size, layout.data_parallel_size, data_parallel_rank(layout)
    indices = [start + j * micro * dp + rank * micro + i for j in range(microbatches) for i in range(micro)]
    samples = np.stack([dataset[i] for i in indices]).reshape(microbatches, micro, -1)
    d = cfg.data
    batch = lm_batch(samples, tokenizer.eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss,
                     getattr(tokenizer, "pad", None))
    batch = {k: v.to(layout.device) for k, v in batch.items()}
    # a pipeline rank's stages take plain tensors: its schedule splits the batch into microbatches
    on_mesh = layout.mesh is not None and layout.sizes["pp"] == 1
    return local_batch_to_dtensor(batch, layout.mesh) if on_mesh else batch


def eval_batches(dataset, cfg: TrainConfig, tokenizer, layout: Layout) -> list[dict]:
    """The first ``eval_iters`` global batches of the validation split (the same at every evaluation)."""
    microbatches = cfg.run.global_batch_size // (cfg.run.micro_batch_size * layout.data_parallel_size)
    return [global_batch_part(dataset, i * cfg.run.global_batch_size, microbatches, cfg, tokenizer, layout)
            for i in range(cfg.run.eval_iters)]
