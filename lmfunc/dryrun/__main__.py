"""``python -m lmfunc.dryrun``: trace the train step of a target world on this CPU and report each
rank role's memory, collectives, FLOPs and projected step time, beside ``lmfunc.plan``'s numbers.

Takes the same ``--config``, ``--preset`` and flags as ``python -m lmfunc.train``, plus the target:
``--world-size N``, ``--gpus-per-node``, ``--gpu h100|h200`` and overrides of its numbers,
``--expert-load`` for an expert-parallel rank busier than an even share, and ``--json PATH`` for
the report as JSON.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from lmfunc.compiler.torch_compat import too_old_message
from lmfunc.compiler.torch_compat.tracing import TRACES_AUTOGRAD_GRAD
from lmfunc.config.model import ConfigError

DESCRIPTION = """Dry run: trace the step `python -m lmfunc.train` would run, for a target world of GPUs, on this
CPU (fake tensors on a fake process group: nothing is allocated or sent), and report each rank role's
peak memory, collectives (kind, mesh dims, count, bytes), FLOPs and a projected step time and MFU,
beside lmfunc.plan's numbers. A layout that does not fit in the GPU's memory is refused (exit 2),
as is every configuration the run would refuse at start-up. With pipeline parallelism each role is
traced: the first, a middle (the second) and the last pipeline rank. The target, besides the
training flags below: --world-size N (default: the product of the parallel sizes),
--gpus-per-node (8), --gpu h100|h200 (h100; SXM), --peak-tflops, --gpu-memory-gib, --nvlink-gbps,
--network-gbps (override the GPU's numbers), --expert-load X (with expert parallelism: each rank
receives X times an even share of the routed rows, default 1; the trainer's moe_imbalance metric,
the busiest expert's load over the mean, bounds a rank's X from above), --json PATH (the report as
JSON)."""

TARGET_OPTIONS = [
    ("--world-size", dict(type=int, default=None)),
    ("--gpus-per-node", dict(type=int, default=8)),
    ("--gpu", dict(default="h100")),
    ("--peak-tflops", dict(type=float, default=None)),
    ("--gpu-memory-gib", dict(type=float, default=None)),
    ("--nvlink-gbps", dict(type=float, default=None)),
    ("--network-gbps", dict(type=float, default=None)),
    ("--expert-load", dict(type=float, default=1.0)),
    ("--json", dict(default=None)),
]


def role_name(sizes: dict[str, int], expert_load: float = 1.0) -> str:
    """The name of the one role a layout without a pipeline has: every rank traces the same step
    (the experts' tokens spread evenly over the expert-parallel ranks, or each receiving
    ``expert_load`` times that share)."""
    if sizes.get("ep", 1) == 1:
        return "every rank"
    if expert_load == 1:
        return "every rank (experts' load evenly shared)"
    return f"every rank (each receiving {expert_load:g}x an even share of the experts' rows)"


def dry_run(argv: Optional[Sequence[str]] = None) -> dict:
    """Parse ``argv``, trace, print the report and return it as JSON values."""
    from lmfunc.config.command_line import parse_config
    from lmfunc.dryrun.capture import batch_plan
    from lmfunc.dryrun.extrapolate import dry_run_facts
    from lmfunc.dryrun.pipeline import pipeline_roles, trace_pipeline_rank
    from lmfunc.plan.pipeline_memory import predict_pipeline_rank
    from lmfunc.dryrun.report import check_fits, format_report, hardware, report_json, role_report
    from lmfunc.plan.report import format_plan, make_plan, world_size_for

    cfg, known = parse_config(argv, "python -m lmfunc.dryrun", DESCRIPTION, extra=TARGET_OPTIONS)
    world = world_size_for(cfg, known.world_size)
    cfg = cfg.validate(world)
    if not TRACES_AUTOGRAD_GRAD:
        raise ConfigError(too_old_message(2, 13, "the dry run (the compiled step traced on a fake DTensor mesh)")
                          + "; python -m lmfunc.plan gives the plan alone")
    for flag in ("gpus_per_node", "peak_tflops", "gpu_memory_gib", "nvlink_gbps", "network_gbps", "expert_load"):
        value = getattr(known, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    sizes = cfg.parallel.sizes(world)
    if known.expert_load != 1 and (sizes.get("ep", 1) == 1 or not cfg.model.num_experts):
        raise ConfigError(f"--expert-load {known.expert_load:g}: no rank exchanges the experts' rows without expert "
                          f"parallelism (parallel.ep is {sizes.get('ep', 1)}, model.num_experts {cfg.model.num_experts}); "
                          "leave it at 1 or set --parallel.ep")
    hw = hardware(known.gpu, cfg.precision.compute_dtype, cfg.precision.tf32, known.gpus_per_node,
                  None if known.peak_tflops is None else known.peak_tflops * 1e12,
                  None if known.gpu_memory_gib is None else known.gpu_memory_gib * 2**30,
                  None if known.nvlink_gbps is None else known.nvlink_gbps * 1e9,
                  None if known.network_gbps is None else known.network_gbps * 1e9)
    plan = make_plan(cfg, world)
    print(format_plan(plan))
    even_share = plan.megatron.flops_per_iteration / world
    reports = []
    if sizes["pp"] == 1:
        reports.append(role_report(role_name(sizes, known.expert_load),
                                   dry_run_facts(cfg, world, rank=0, expert_load=known.expert_load), hw,
                                   plan.lmfunc, even_share))
    else:
        microbatches = batch_plan(cfg, world).num_microbatches_at(0)
        stages_per_rank = cfg.parallel.pipeline_split(cfg.model.num_layers, sizes["pp"]).stages_per_rank
        bubble = (sizes["pp"] - 1) / (stages_per_rank * microbatches)
        for name, pipeline_index, rank in pipeline_roles(sizes, world):
            rank_plan = predict_pipeline_rank(cfg, sizes, pipeline_index)
            reports.append(role_report(name, trace_pipeline_rank(cfg, world, rank, known.expert_load), hw,
                                       rank_plan, even_share, bubble))
    for report in reports:
        print(format_report(report, hw))
    result = {"world_size": world, "sizes": sizes, "expert_load": known.expert_load, "roles": [report_json(report, hw) for report in reports]}
    if known.json:
        with open(known.json, "w") as f:
            json.dump(result, f, indent=1)
    for report in reports:
        check_fits(report, hw)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        dry_run(argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
