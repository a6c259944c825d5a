"""``ParallelConfig``: the mesh sizes of a run, and the pure checks of a layout (the world size is
an argument; nothing here touches torch.distributed)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.config.pipeline import PipelineSplit, pipeline_split

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
"""Mesh dim names, outermost first (Megatron's order read backwards: tp is the fastest). ``ep`` is
carved out of the data-parallel ranks: on the mesh, ``parallel.dp_shard`` is factored into
``dp_shard / ep`` (outer, still called ``dp_shard``) times ``ep`` (``ParallelConfig.sizes``)."""


def check_sizes(sizes: dict[str, Optional[int]]) -> None:
    """Refuse a size that is neither a positive integer, -1 ("the rest") nor unset, naming it."""
    for name, size in sizes.items():
        if size in (None, -1):
            continue
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"parallel.{name} must be a positive integer or -1 (the rest of the world), got {size!r}")


def resolve_sizes(sizes: dict[str, Optional[int]], world_size: int) -> dict[str, int]:
    """Replace one ``-1`` size (or, when no size is -1, an unset ``None`` one) by
    ``world_size / product(other sizes)``; check the product.

    ``sizes`` maps the names of ``MESH_DIMS`` to sizes; ``None`` (the default ``parallel.dp_shard``)
    is "the rest of the world" unless another size is -1, then 1. Errors name the sizes and the
    world size.
    """
    wild = [name for name, size in sizes.items() if size == -1]
    if len(wild) > 1:
        raise ConfigError(f"only one parallel size may be -1 ('the rest'), got -1 for {', '.join('parallel.' + n for n in wild)}")
    rest = wild or [name for name, size in sizes.items() if size is None][:1]
    resolved = {name: (1 if size is None and name not in rest else size) for name, size in sizes.items()}
    check_sizes({name: size for name, size in resolved.items() if name not in rest})
    if rest:
        name = rest[0]
        known = math.prod(size for other, size in resolved.items() if other != name)
        how = "= -1" if wild else "(unset: the rest of the world)"
        if world_size % known:
            raise ConfigError(f"world size {world_size} is not divisible by the product of the other parallel sizes "
                              f"({known}), so parallel.{name} {how} cannot fill it; launch a multiple of {known} "
                              f"processes (torchrun --nproc-per-node {known}) or change the sizes")
        resolved[name] = world_size // known
    product = math.prod(resolved.values())
    if product != world_size:
        layout = " x ".join(f"{name} {size}" for name, size in resolved.items() if size > 1) or "all sizes 1"
        raise ConfigError(f"the parallel sizes ({layout} = {product}) do not multiply to the world size {world_size}; "
                          f"launch {product} processes (torchrun --nproc-per-node {product}) or change the sizes")
    return resolved


def check_divisibility(sizes: dict[str, int], model: ModelConfig, seq_length: Optional[int] = None) -> None:
    """Reject layouts the model cannot be split by, naming the numbers."""
    tp, cp, ep = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("ep", 1)
    if ep > 1 and model.num_experts is None:
        raise ConfigError(f"parallel.ep = {ep} splits the experts of an MoE model, but model.num_experts is unset; "
                          "set --model.num-experts or use parallel.ep = 1")
    checks = [
        ("model.num_attention_heads", model.num_attention_heads, "parallel.tp", tp),
        ("model.num_query_groups", model.query_groups, "parallel.tp", tp),
        ("model.vocab_size", model.vocab_size, "parallel.tp", tp),
        ("model.ffn_hidden_size", model.ffn_size, "parallel.tp", tp),
        ("model.num_experts", model.num_experts or 0, "parallel.ep", ep),
    ]
    if seq_length is not None:
        checks.append(("data.seq_length", seq_length, "parallel.tp x parallel.cp", tp * cp))
        if cp > 1:
            sp = model.sequence_parallel and tp > 1
            checks.append(("data.seq_length", seq_length,
                           "2 x parallel.cp" + (" x parallel.tp (sequence parallel)" if sp else "")
                           + ", the load-balanced chunks", 2 * cp * (tp if sp else 1)))
    for name, value, by_name, by in checks:
        if by > 1 and value % by:
            raise ConfigError(f"{name} ({value}) is not divisible by {by_name} ({by}); choose sizes that divide it")


@dataclass(frozen=True)
class ParallelConfig:
    """Mesh sizes (launch with ``torchrun --nproc-per-node N``); one size may be -1, "the rest", and
    an unset ``dp_shard`` is the rest of the world (Megatron's data-parallel size, torchtitan's
    ``dp_shard = -1``)."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP-style: parameters replicated, gradients all-reduced)."""
    dp_shard: Optional[int] = None
    """Data-parallel shards (FSDP / distributed optimizer: parameters, gradients and optimizer state
    sharded). Unset: the world size over the other sizes (1 when another size is -1)."""
    tp: int = 1
    """Tensor-parallel size (attention heads, MLP width and vocabulary split; see model.sequence_parallel)."""
    pp: int = 1
    """Pipeline-parallel size: stages of consecutive layers on successive ranks, run by torch's
    pipeline schedules (``lmfunc.train.pipeline_step``), beside dp_replicate, dp_shard and tp (each
    pipeline rank's leaves sharded over those dims as without a pipeline)."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks in Megatron's load-balanced order
    (2 x cp chunks, rank r holding chunks r and 2cp-1-r), attention over keys and values gathered
    over cp (``lmfunc.parallel.context``)."""
    ep: int = 1
    """Expert-parallel size: the routed experts of every MoE layer split over ep ranks, tokens sent
    to their experts' ranks by all-to-all (``lmfunc.parallel.expert_parallel``). Megatron's layout:
    the ep ranks are data-parallel ranks (ep divides dp_shard), everything but the experts is
    sharded over the whole dp_shard, the experts over dp_shard / ep (the expert-data-parallel size)."""
    virtual_stages: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved-1f1b and zero-bubble; unset: 1, or the V
    schedules' 2)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (pp > 1): gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv or dualpipev
    (``lmfunc.config.pipeline``: each one's stage placement and microbatch rule)."""
    pp_first_stage_layers: Optional[int] = None
    """Layers on the pipeline's first stage (it also holds the embedding); the others split the rest
    evenly (Megatron's --decoder-first-pipeline-num-layers). Unset: an even split."""
    pp_last_stage_layers: Optional[int] = None
    """Layers on the pipeline's last stage (it also holds the output layer, the loss and MTP); the
    others split the rest evenly (Megatron's --decoder-last-pipeline-num-layers). Unset: an even split."""
    bucket_collectives: bool = True
    """Compiled steps: gather FSDP parameters and reduce-scatter their gradients once per model
    region (embedding, each block, head), prefetching the next region's parameters, and all-reduce
    DDP gradients in buckets, overlapped with the backward (lmfunc.compiler.collective_buckets).
    Off: one collective per parameter use, each waited for at once (for comparison)."""
    bucket_size_mb: float = 40.0
    """Largest bucket, in MiB, of the data-parallel gradient all-reduces (dp_replicate) in the
    compiled step (Megatron's --ddp-bucket-size, counted in MiB here)."""

    def sizes(self, world_size: int) -> dict[str, int]:
        """Mesh sizes by name (``MESH_DIMS`` order) with a -1 resolved against ``world_size``; the
        mesh's ``dp_shard`` is ``parallel.dp_shard / ep`` and its ``ep`` is ``parallel.ep``."""
        sizes = resolve_sizes({"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard,
                               "cp": self.cp, "tp": self.tp}, world_size)
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"parallel.ep must be a positive integer, got {self.ep!r}")
        if sizes["dp_shard"] % self.ep:
            rest = self.dp_shard == -1 or (self.dp_shard is None and -1 not in (self.pp, self.dp_replicate, self.cp, self.tp))
            given = f", the rest of the world size {world_size}" if rest else ""
            fix = ("launch more processes or lower the other sizes" if rest else "set --parallel.dp-shard to a multiple of it")
            raise ConfigError(f"parallel.ep ({self.ep}) must divide parallel.dp_shard ({sizes['dp_shard']}{given}): "
                              "expert-parallel ranks are data-parallel ranks (Megatron's layout), so dp_shard must be "
                              f"a multiple of ep; {fix}")
        mesh = {name: sizes[name] for name in ("pp", "dp_replicate")}
        mesh.update(dp_shard=sizes["dp_shard"] // self.ep, ep=self.ep, cp=sizes["cp"], tp=sizes["tp"])
        return mesh

    def resolved(self, world_size: int) -> "ParallelConfig":
        """This config with every size given as a number for ``world_size`` processes (no -1, no
        unset ``dp_shard``), so the rest of the program reads the sizes it runs with."""
        sizes = self.sizes(world_size)
        return dataclasses.replace(self, pp=sizes["pp"], dp_replicate=sizes["dp_replicate"],
                                   dp_shard=sizes["dp_shard"] * sizes["ep"], cp=sizes["cp"], tp=sizes["tp"])

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel ranks: ``dp_replicate x dp_shard`` (the ep ranks among them)."""
        return data_parallel_size(self.sizes(world_size))

    def pipeline_split(self, num_layers: int, pp: Optional[int] = None) -> PipelineSplit:
        """The ``PipelineSplit`` of ``num_layers`` layers over ``pp`` pipeline ranks (``self.pp``
        when None: give the resolved size where ``pp`` may be -1) by this config's schedule,
        virtual stages and first/last stage layers."""
        return pipeline_split(num_layers, self.pp if pp is None else pp, self.pp_schedule, self.virtual_stages,
                              self.pp_first_stage_layers, self.pp_last_stage_layers)


def data_parallel_size(sizes: dict[str, int]) -> int:
    """The data-parallel ranks of mesh ``sizes``: the batch is split over ``dp_replicate``,
    ``dp_shard`` and ``ep``."""
    return sizes.get("dp_replicate", 1) * sizes.get("dp_shard", 1) * sizes.get("ep", 1)
