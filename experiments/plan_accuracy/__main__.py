"""Study 5: lmfunc.plan's predicted step memory against the measured one, on the CPU.

For each case of config.yaml, a fresh process builds the run's state and compiled train step
exactly as ``python -m lmfunc.train`` does (same optimizer, loss scaling, donation), trains two
steps, then measures the next ones: the bytes its state and batch hold, plus the peak the allocator
reaches during a step (``lmfunc.metrics.allocator_peak_bytes``: the profiler's memory events,
the CPU's equivalent of ``torch.cuda.max_memory_allocated``), the lowest of ``MEASURED_STEPS``
steps (``MEASURED_STEPS``: why). The prediction is
``lmfunc.plan.memory.predict_memory``; the invariant is |predicted / measured - 1| <= 15%.
Beside it, the dry run's peak (``python -m lmfunc.dryrun``: the step traced on fake tensors, its
inputs plus the buffers Inductor's scheduler holds; its reduce-scatters lowered as the measured
runs' gloo groups run them), held to the measured peak within 10% (15% in the quick mode,
``DRY_RUN_TOLERANCE``) where it counts every buffer: not with ``scan_layers`` (the loop body's
working set is compiled where the dry run stops). Under expert parallelism the rows each rank
exchanges are known only at run time: the dry run counts them at an even share, as
``lmfunc.plan`` does, while the measured step's router sends its busiest rank more
(``expert_rows_vs_even``: the measured step's router run again); there the measured peak must lie
between the dry run at an even share and the dry run with every exchange at the busiest rank's
share (``dry_run_bytes_at_measured_load``), each give or take that tolerance.

A case whose ``parallel`` section asks for more than one process (``cp: 2``) runs under ``torchrun``
with gloo, each rank measuring its own step over its DTensor shards; the table shows the
most-loaded rank, which is what the plan predicts. There rank 0 also counts the collectives of one
more step (``experiments.bench.comm.step_collectives``), and the dry run's must equal them: every
kind's count and the elements handed over (``lmfunc.dryrun.graph_report.differences_from_measured``).
``python -m experiments.plan_accuracy [--quick] [--cases NAME,NAME]`` (``--cases``: only those cases
of the config, e.g. the one-process ones apart from those under torchrun).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from experiments.harness import (
    REPO, Options, conclude, markdown_table, parse_options, pyplot, save_figure, write_json,
)

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.15
DRY_RUN_TOLERANCE = {"full": 0.10, "quick": 0.15}
"""|dry run / measured - 1| allowed. The quick cases' peaks are 12-19 MiB, where the dry run reads
about 1.2 MiB high without recompute and with full recompute (+9% and +10%): a constant that the
full cases' 120-700 MiB make +5 to +6%."""
MiB = 2**20
MEASURED_STEPS = 5
"""Steps whose peaks are measured; the lowest is the step's. On a gloo group the same rank's peak
varies from step to step, the more the busier the machine (README: Method): the profiler counts
the allocations of every thread of the process, gloo's included, so the peak depends on when its
threads run against the step's."""


def world_size(spec: dict) -> int:
    """The processes a case's ``parallel`` section asks for (the product of its sizes but ``ep``, whose
    ranks are some of ``dp_shard``'s; 1 without)."""
    return math.prod(int(size) for name, size in (spec.get("parallel") or {}).items()
                     if name != "ep" and isinstance(size, int) and size > 1)


def case_configs(config: Path) -> dict:
    """Case name -> (validated ``TrainConfig``, world size) of the study's YAML."""
    from lmfunc.config.yaml_io import read_yaml, train_config_from_dict

    cases = read_yaml(str(config))["cases"]
    return {name: (train_config_from_dict(spec or {}, source=f"{config.name}: cases.{name}").validate(world_size(spec or {})),
                   world_size(spec or {}))
            for name, spec in cases.items()}


def measure(cfg, world: int) -> dict:
    """Build and run ``cfg``'s compiled train step (two steps, then ``MEASURED_STEPS`` measured) in
    this process (one rank of ``world`` under torchrun); the memory on the most-loaded rank: the
    bytes held before a step (state and batch) and the allocator's peak above them, the lowest of
    the measured steps (the highest beside it)."""
    import torch
    import torch.distributed as dist

    from experiments.bench.comm import step_collectives
    from lmfunc.data.batch import lm_batch
    from lmfunc.metrics import allocator_peak_bytes
    from lmfunc.parallel.mesh import build_mesh, data_parallel_rank
    from lmfunc.parallel.sharding import local_batch_to_dtensor
    from lmfunc.precision import compute_dtype
    from lmfunc.train.batch_plan import BatchPlan
    from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
    from lmfunc.train.params import init_params
    from lmfunc.train.run_step import even_expert_share
    from lmfunc.train.state import TrainState
    from lmfunc.train.step import make_train_step
    from lmfunc.tree import local_tree_bytes

    layout = build_mesh(cfg.parallel.sizes(world))
    plan = BatchPlan.from_config(cfg.run, layout.data_parallel_size)
    schedule = build_lr_schedule(cfg, plan, cfg.run.train_iters)
    params = init_params(cfg.model, layout.mesh, seed=cfg.run.seed)
    tx = build_optimizer(cfg, schedule, params)
    state = TrainState.create(params, tx, seed=cfg.run.seed, loss_scale=cfg.precision.loss_scaling())
    step = make_train_step(cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule,
                           compute_dtype=compute_dtype(cfg.precision.compute_dtype),
                           loss_scale=cfg.precision.loss_scaling(), compile=True, donate_state=True)
    microbatches = plan.num_microbatches_at(0)
    g = torch.Generator().manual_seed(data_parallel_rank(layout))
    # the trainer's batch fields (a loss mask always), of random tokens; token 0 ends a document
    samples = torch.randint(1, 256, (microbatches, cfg.run.micro_batch_size, cfg.data.seq_length + 1), generator=g)
    if cfg.data.reset_attention_mask:  # documents of about 200 tokens, masked from each other
        samples[torch.rand(samples.shape, generator=g) < 1 / 200] = 0
    batch = lm_batch(samples, 0, cfg.data.reset_position_ids, cfg.data.reset_attention_mask, cfg.data.eod_mask_loss)
    if layout.mesh is not None:
        batch = local_batch_to_dtensor(batch, layout.mesh)
    with even_expert_share(cfg, layout.sizes):  # as the trainer compiles its step (lmfunc.train.loop)
        for _ in range(2):
            state, _ = step(state, batch)
        held = local_tree_bytes(state) + local_tree_bytes(batch)
        peaks = []
        for _ in range(MEASURED_STEPS):
            (state, _), peak = allocator_peak_bytes(lambda: step(state, batch))
            peaks.append(peak)
    mine = torch.tensor([held, min(peaks), held + min(peaks), sum(local_tree_bytes(p) // p.element_size()
                                                                 for p in torch.utils._pytree.tree_leaves(state.params)),
                         max(peaks)])
    result = {}
    if cfg.model.num_experts and layout.sizes.get("ep", 1) == layout.data_parallel_size > 1:
        result["expert_rows_vs_even"] = expert_rows_vs_even_share(state.params, batch["tokens"], cfg.model, layout.sizes["ep"])
    if layout.mesh is not None:
        # the collectives of one more step (rank 0's are reported: the dry run's rank)
        with even_expert_share(cfg, layout.sizes):
            result["collectives"], result["elements"] = step_collectives(lambda: step(state, batch))
        # every rank's numbers; the most-loaded rank's reported
        ranks = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(ranks, mine)
        mine = max(ranks, key=lambda r: int(r[2]))
        dist.destroy_process_group()
    return {"held_bytes": int(mine[0]), "step_peak_bytes": int(mine[1]), "measured_bytes": int(mine[2]),
            "params": int(mine[3]), "highest_step_peak_bytes": int(mine[4]), **result}


def expert_rows_vs_even_share(params, tokens, model, ep: int) -> float:
    """The rows the most-loaded expert-parallel rank receives in the measured step, over the even share
    that ``lmfunc.plan`` and the dry run count (the most over MoE layers and microbatches): each
    layer's router run again, eagerly, on the step's ``tokens`` ``[M, micro, S]`` with the step's
    parameters; rank r holds experts ``r * E/ep ...``. Right where the ``ep`` group holds the whole
    batch (``ep`` = the data-parallel size), as in the study's cases."""
    import torch
    from torch.distributed.tensor.experimental import implicit_replication

    from lmfunc.model.gpt import decoder

    worst = 0.0
    with torch.no_grad(), implicit_replication():
        for micro in tokens:
            for stats in decoder(params, micro, model).router_stats:
                load = stats.load.full_tensor() if hasattr(stats.load, "full_tensor") else stats.load
                worst = max(worst, float(load.view(ep, -1).sum(1).max() / (load.sum() / ep)))
    return round(worst, 4)


def run_case(name: str, config: Path, options: Options) -> dict:
    """``measure`` of one case in fresh processes (their own compile and allocator history): one, or
    the case's world size under ``torchrun`` (rank 0 prints)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads)}
    world = case_configs(config)[name][1]
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", str(world)]
    began = time.perf_counter()
    proc = subprocess.run([*launch, "-m", "experiments.plan_accuracy", "--case", name, "--config", str(config)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"case {name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


def dry_run_counts_every_buffer(cfg) -> bool:
    """Whether the dry run's peak of ``cfg`` counts every buffer the step allocates (module docstring)."""
    return not cfg.model.scan_layers


def dry_run_as_on_gloo(cfg, world: int, expert_load: float = 1.0):
    """The dry run's ``StepFacts`` of ``cfg`` on ``world`` ranks (rank 0; every rank of these cases
    is alike), each expert-parallel rank exchanging ``expert_load`` times an even share of rows; its
    reduce-scatters lowered as on gloo (an all-to-all and a sum), as in the measured runs."""
    from lmfunc.compiler.gloo_reduce_scatter import as_if_gloo
    from lmfunc.dryrun import dry_run_facts

    with as_if_gloo():
        return dry_run_facts(cfg, world, expert_load=expert_load)


def report(cases: dict, results: dict[str, dict], options: Options) -> tuple[str, list[str], dict]:
    """The table (``tables.md``), the figure (``plan_accuracy.png``), the failed invariants and
    the per-case numbers."""
    from lmfunc.plan import make_plan

    rows, failures, numbers = [], [], {}
    for name, (cfg, world) in cases.items():
        plan = make_plan(cfg, world)
        predicted, measured = plan.lmfunc.peak, results[name]["measured_bytes"]
        error = predicted / measured - 1
        numbers[name] = {"predicted_mib": predicted / MiB, "measured_mib": measured / MiB, "error": error}
        dry, busiest = results[name].get("dry_run_bytes"), results[name].get("dry_run_bytes_at_measured_load")
        limit = DRY_RUN_TOLERANCE["quick" if options.quick else "full"]
        if dry is not None:
            numbers[name] |= {"dry_run_mib": dry / MiB, "dry_run_error": dry / measured - 1}
            if busiest is not None:
                numbers[name]["dry_run_at_measured_load_mib"] = busiest / MiB
                if not dry * (1 - limit) <= measured <= busiest * (1 + limit):
                    failures.append(f"{name}: measured {measured / MiB:.1f} MiB is not between the dry run's peak at an even "
                                    f"share of the experts' rows, {dry / MiB:.1f} MiB, and at the busiest rank's "
                                    f"{results[name]['expert_rows_vs_even']}x, {busiest / MiB:.1f} MiB (give or take {100 * limit:.0f}%)")
            elif dry_run_counts_every_buffer(cfg) and abs(dry / measured - 1) > limit:
                failures.append(f"{name}: the dry run's peak {dry / MiB:.1f} MiB vs measured {measured / MiB:.1f} MiB "
                                f"({100 * (dry / measured - 1):+.1f}%, limit {100 * limit:.0f}%)")
        differences = results[name].get("collective_differences")
        if differences is not None:
            numbers[name]["collectives_equal"] = not differences
            if differences:
                failures.append(f"{name}: the dry run's collectives differ from the measured step's: {'; '.join(differences)}")
        m = cfg.model
        layout = " x ".join(f"{dim} {size}" for dim, size in plan.sizes.items() if size > 1) or "1 process"
        rows.append([name, f"h {m.hidden_size}, L {m.num_layers}" + (", scan" if m.scan_layers else ""), layout,
                     m.recompute_granularity,
                     cfg.precision.compute_dtype, f"{cfg.run.micro_batch_size} x {cfg.data.seq_length}",
                     round(measured / MiB, 1), round(predicted / MiB, 1), f"{100 * error:+.1f}%",
                     round(plan.megatron.weight_and_optimizer / MiB + plan.megatron.activations / MiB, 1),
                     "-" if dry is None else f"{dry / MiB:.1f} ({100 * (dry / measured - 1):+.1f}%)"
                     + ("" if busiest is None else f"; {busiest / MiB:.1f} at the busiest rank's "
                                                    f"{results[name]['expert_rows_vs_even']:.2f}x rows"),
                     "-" if differences is None else "equal" if not differences else "differ"])
        if abs(error) > TOLERANCE:
            failures.append(f"{name}: predicted {predicted / MiB:.1f} MiB vs measured {measured / MiB:.1f} MiB "
                            f"({100 * error:+.1f}%, limit {100 * TOLERANCE:.0f}%)")
    table = markdown_table(["case", "model", "layout (per rank)", "recompute", "compute", "micro batch x seq", "measured MiB",
                            "lmfunc.plan MiB", "error", "Megatron's formula MiB", "dry run MiB",
                            "dry run's collectives vs measured"], rows)
    (options.results / "tables.md").write_text(table)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = list(numbers)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [numbers[n]["measured_mib"] for n in names], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [numbers[n]["predicted_mib"] for n in names], width=0.4, label="lmfunc.plan")
    ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
    ax.set(ylabel="peak step memory (MiB)", title="predicted against measured, CPU (most-loaded rank)")
    ax.legend()
    save_figure(fig, options.out / "plan_accuracy.png")
    return table, failures, numbers


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--case" in argv:
        name, config = argv[argv.index("--case") + 1], Path(argv[argv.index("--config") + 1])
        result = measure(*case_configs(config)[name])
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        from lmfunc.train.__main__ import exit_without_finalizing
        exit_without_finalizing()  # gloo's threads can abort a finalizing interpreter (see there)
    chosen = None
    if "--cases" in argv:
        at = argv.index("--cases")
        chosen, argv = argv[at + 1].split(",") if at + 1 < len(argv) else [], argv[:at] + argv[at + 2:]
    options = parse_options("plan_accuracy", __doc__.splitlines()[0], argv)
    config = HERE / ("quick.yaml" if options.quick else "config.yaml")
    cases = all_cases = case_configs(config)
    if chosen is not None:
        unknown = [name for name in chosen if name not in cases]
        if unknown or not chosen:
            raise SystemExit(f"--cases {','.join(chosen)}: {config.name} has no case {', '.join(unknown) or '(none given)'}; "
                             f"its cases are {', '.join(cases)}")
        cases = {name: cases[name] for name in chosen}
    path = options.results / "measured.json"
    if options.report_only:
        results = json.loads(path.read_text())
    else:
        measured = {name: run_case(name, config, options) for name in cases}
        from lmfunc.dryrun.graph_report import differences_from_measured

        for name, (cfg, world) in cases.items():
            facts = dry_run_as_on_gloo(cfg, world)
            measured[name]["dry_run_bytes"] = facts.memory.peak
            if "collectives" in measured[name]:
                measured[name]["collective_differences"] = differences_from_measured(
                    facts.collectives, measured[name]["collectives"], measured[name]["elements"])
            if "expert_rows_vs_even" in measured[name]:
                load = measured[name]["expert_rows_vs_even"]
                measured[name]["dry_run_bytes_at_measured_load"] = dry_run_as_on_gloo(cfg, world, load).memory.peak
        earlier = json.loads(path.read_text()) if chosen is not None and path.exists() else {}
        results = {**earlier, **measured}  # --cases measures again only those it names
        write_json(path, results)
    table, failures, numbers = report({name: all_cases[name] for name in results if name in all_cases}, results, options)
    conclude(options, config, {name: r["seconds"] for name, r in results.items()}, failures, table, cases=numbers)


if __name__ == "__main__":
    main()
