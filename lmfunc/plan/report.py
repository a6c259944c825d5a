"""The plan of a run: Megatron's theoretical numbers and lmfunc's prediction, and their printout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from lmfunc.config.model import ConfigError, unbuildable_features
from lmfunc.config.parallel import check_sizes
from lmfunc.config.train import TrainConfig
from lmfunc.plan.megatron import MB, MegatronArgs, MegatronReport, megatron_report
from lmfunc.plan.memory import MemoryPlan, predict_memory
from lmfunc.plan.pipeline_memory import predict_pipeline_memory

MiB = 2**20


@dataclass(frozen=True)
class Plan:
    """What ``python -m lmfunc.plan`` prints and the trainer logs at start-up."""

    world_size: int
    sizes: dict[str, int]
    megatron: MegatronReport
    lmfunc: Optional[MemoryPlan]
    """None when the run is not trainable yet (``untrainable``) or lmfunc's prediction does not model
    its layout (``unpredicted``)."""
    untrainable: list[str]
    unpredicted: list[str] = field(default_factory=list)

    @property
    def flops_per_token(self) -> float:
        """Megatron's FLOPs per trained token (forward and backward), the MFU numerator."""
        a = self.megatron.args
        return self.megatron.flops_per_iteration / (a.global_batch_size * a.seq_length)


def make_plan(cfg: TrainConfig, world_size: int) -> Plan:
    """The plan of ``cfg`` (validated, ``run.global_batch_size`` resolved) on ``world_size`` processes."""
    sizes = cfg.parallel.sizes(world_size)
    untrainable = unbuildable_features(cfg.model)
    prediction, unpredicted = None, []
    m = cfg.model
    moe_unmeasured = m.num_experts is not None and m.recompute_granularity == "full"
    mla_unmeasured = m.multi_latent_attention and m.recompute_granularity != "none"
    if not untrainable and (moe_unmeasured or mla_unmeasured):
        unpredicted = ([f"model.num_experts = {m.num_experts} with full recompute"] if moe_unmeasured else []) + (
            [f"model.multi_latent_attention with {m.recompute_granularity} recompute"] if mla_unmeasured else [])
    elif not untrainable and sizes["pp"] > 1 and sizes["cp"] > 1:
        unpredicted = [f"parallel.pp = {sizes['pp']} with parallel.cp = {sizes['cp']}"]
    elif not untrainable:
        prediction = predict_pipeline_memory(cfg, sizes) if sizes["pp"] > 1 else predict_memory(cfg, sizes)
        if prediction is None:
            unpredicted = [f"parallel.pp = {sizes['pp']} with parallel.pp_schedule {cfg.parallel.pp_schedule}"]
    return Plan(world_size=world_size, sizes=sizes, megatron=megatron_report(MegatronArgs.from_config(cfg, world_size)),
                lmfunc=prediction, untrainable=untrainable, unpredicted=unpredicted)


def world_size_for(cfg: TrainConfig, given: Optional[int]) -> int:
    """``--world-size``, or torchrun's world size when a parallel size is -1, or the product of the
    parallel sizes given (an unset ``dp_shard`` counts 1)."""
    from lmfunc.parallel.mesh import launched_world_size

    if given is not None:
        if given < 1:
            raise ConfigError(f"--world-size must be positive, got {given}")
        return given
    p = cfg.parallel
    sizes = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "cp": p.cp, "tp": p.tp}
    check_sizes(sizes)
    if -1 in sizes.values():
        return launched_world_size()
    return math.prod(size for size in sizes.values() if size is not None)


def _bytes(value: float) -> str:
    return f"{value:,.0f} B ({value / MB:.4f} MB)"


def _count(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def format_plan(plan: Plan) -> str:
    """The printout: Megatron's section (its MB are MiB, printed as Megatron prints them), then lmfunc's."""
    meg, a = plan.megatron, plan.megatron.args
    c = meg.counts
    layout = " x ".join(f"{name} {size}" for name, size in plan.sizes.items() if size > 1) or "1 process"
    if plan.sizes.get("ep", 1) > 1:
        layout += f" (parallel.dp_shard {plan.sizes.get('dp_shard', 1) * plan.sizes['ep']} factored into dp_shard x ep)"
    formula = "SP with selective recompute" if meg.sp_formula else "without SP (the one that applies unless SP + selective)"
    lines = [
        f"plan for {plan.world_size} process(es), layout {layout}; micro batch {a.micro_batch_size} x seq "
        f"{a.seq_length}, global batch {a.global_batch_size} ({a.num_microbatches} microbatches per data-parallel rank)",
        "Megatron-LM's theoretical numbers (theoretical_memory_usage.py, num_floating_point_operations):",
        f"  parameters: total {_count(c.total)} (transformer block {_count(c.transformer_block)}, MTP block "
        f"{_count(c.mtp_block)}, embeddings {_count(c.embedding)}); active {_count(c.active)}; most-loaded shard "
        f"{_count(c.most_loaded_shard)}" + (f"; other pipeline shards {_count(c.other_shards)}"
                                          if c.other_shards is not None else ""),
        f"  weight and optimizer: {_bytes(meg.weight_and_optimizer)} (18 B/param); with the distributed optimizer "
        f"over dp {a.data_parallel_size}: {_bytes(meg.weight_and_optimizer_distributed)}",
        f"  activations, {formula}: {_bytes(meg.activations)}",
        f"    (without-SP formula {_bytes(meg.activations_without_sp)}; SP formula {_bytes(meg.activations_sp)})",
        f"  {meg.footprint_line()}",
        f"  FLOPs per iteration: {meg.flops_per_iteration:,.0f} ({plan.flops_per_token:,.0f} per token)",
    ]
    if plan.lmfunc is None and plan.unpredicted:
        lines.append(f"lmfunc: trainable; its own memory prediction does not model this layout yet "
                     f"({'; '.join(plan.unpredicted)}): see Megatron's numbers above")
        return "\n".join(lines)
    if plan.lmfunc is None:
        lines.append(f"lmfunc: not trainable yet ({'; '.join(plan.untrainable)}); planned with Megatron's formulas above")
        return "\n".join(lines)
    mem = plan.lmfunc
    lines.append(f"lmfunc's prediction for the most-loaded rank ({_count(mem.params)} parameter elements in its shards):")
    lines += [f"  {name:<48s} {value / MiB:10.2f} MiB" for name, value in mem.rows()]
    lines += [f"  note: {note}" for note in mem.notes]
    return "\n".join(lines)
