"""``python -m experiments.bench.checkpoint``: checkpoint save/load times and the training stall of async saves.

Workload: the default ``TrainConfig`` (the ``small`` model, seq 256, 8 sequences per step, fp32
AdamW state: params + two moments) and its compiled train step on synthetic tokens, one process.

- sync save: ``CheckpointManager(async_save=False).save`` (DCP write, marker, rename, tracker);
- load: the state loaded back into a fresh one (``load_tree``);
- async save: ``save`` with training going on. Reported: how long ``save`` blocks the loop, the time
  until the write is committed, and the step time while it is written against steps without a save.
  Compared with DCP's default stager, which first copies the whole state. The step here is
  ``make_train_step``'s default, which never writes into its input, so the state itself is passed;
  the trainer's step donates its state and saves with ``stage=True`` (a copy, as DCP's stager).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time

import torch
import tyro


@dataclasses.dataclass(frozen=True)
class CheckpointBenchConfig:
    """Measurement settings (the workload is the default training config)."""

    repeats: int = 5
    """Saves and loads timed for each variant (medians reported)."""
    steps_between: int = 6
    """Train steps between two async saves (the first ones overlap the write)."""
    directory: str = ""
    """Where checkpoints are written; empty means a temporary directory."""


def _dir_size_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files) / 2**20


def main(bc: CheckpointBenchConfig) -> None:
    from torch.distributed.checkpoint import async_save

    from lmfunc import model
    from lmfunc.checkpoint.manager import CheckpointManager
    from lmfunc.checkpoint.sharded import load_tree, to_state_dict
    from lmfunc.config.train import TrainConfig
    from lmfunc.train.batch_plan import BatchPlan
    from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
    from lmfunc.train.state import TrainState
    from lmfunc.train.step import make_train_step
    from lmfunc.tree import tree_bytes

    cfg = TrainConfig()
    run, seq = cfg.run, cfg.data.seq_length
    schedule = build_lr_schedule(cfg, BatchPlan.from_config(run), run.train_iters)
    params = model.init(cfg.model, seed=0)
    tx = build_optimizer(cfg, schedule, params, None)
    state = TrainState.create(params, tx)
    step = make_train_step(cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, cfg.model.vocab_size, (1, run.micro_batch_size, seq + 1), generator=g)
    batch = {"tokens": stream[..., :-1], "labels": stream[..., 1:]}
    state, _ = step(state, batch)  # compile

    def timed_step() -> float:
        nonlocal state
        began = time.perf_counter()
        state, metrics = step(state, batch)
        float(metrics["loss"])
        return time.perf_counter() - began

    root = bc.directory or tempfile.mkdtemp(prefix="lmfunc_ckpt_bench_")
    print(f"workload: default config, model {cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
          f"state {tree_bytes(state) / 2**20:.1f} MiB (params + Adam moments, fp32); {torch.get_num_threads()} threads; "
          f"directory {root}")
    base_steps = [timed_step() for _ in range(10)]
    base = statistics.median(base_steps)

    sync = CheckpointManager(os.path.join(root, "sync"), keep=1, async_save=False)
    save_times = []
    for i in range(bc.repeats):
        began = time.perf_counter()
        sync.save(i + 1, state)
        save_times.append(time.perf_counter() - began)
    size = _dir_size_mib(sync.path(bc.repeats))

    load_times = []
    for _ in range(bc.repeats):
        like = TrainState.create(model.init(cfg.model, seed=1), tx)
        began = time.perf_counter()
        load_tree(like, sync.path(bc.repeats))
        load_times.append(time.perf_counter() - began)

    def async_variant(launch) -> tuple[float, float, float]:
        """(median blocking time of a save, median time to commit, median step time during the write)."""
        blocks, commits, during = [], [], []
        for i in range(bc.repeats):
            began = time.perf_counter()
            finish = launch(i, state)
            blocks.append(time.perf_counter() - began)
            steps, done = [], False
            for _ in range(bc.steps_between):
                steps.append(timed_step())
                if not done and finish():
                    done = True
                    commits.append(time.perf_counter() - began)
                    during.extend(steps)
            if not done:
                finish(wait=True)
                commits.append(time.perf_counter() - began)
                during.extend(steps)
        return statistics.median(blocks), statistics.median(commits), statistics.median(during)

    unstaged = CheckpointManager(os.path.join(root, "async"), keep=1, async_save=True)

    def launch_unstaged(i, tree):
        unstaged.save(i + 1, tree)

        def finish(wait: bool = False) -> bool:
            if wait:
                unstaged.wait()
            return unstaged.in_flight() is None
        return finish

    def launch_staged(i, tree):
        future = async_save(to_state_dict(tree), checkpoint_id=os.path.join(root, "staged", str(i)), no_dist=True)

        def finish(wait: bool = False) -> bool:
            if wait:
                future.result()
            return future.done()
        return finish

    results = {"lmfunc (no copy)": async_variant(launch_unstaged), "DCP default stager (copy)": async_variant(launch_staged)}
    base_after = statistics.median([timed_step() for _ in range(10)])

    print(f"step without a save: {1e3 * base:.1f} ms (median of 10 before, {1e3 * base_after:.1f} after)")
    print(f"checkpoint size: {size:.1f} MiB")
    print(f"sync save: {1e3 * statistics.median(save_times):.0f} ms (median of {bc.repeats}; "
          f"{size / statistics.median(save_times):.0f} MiB/s)")
    print(f"load: {1e3 * statistics.median(load_times):.0f} ms (median of {bc.repeats})")
    print("async save                 | save() blocks | committed after | step during write | extra per step")
    for name, (block, commit, during) in results.items():
        print(f"{name:<26} | {1e3 * block:>10.1f} ms | {1e3 * commit:>12.0f} ms | {1e3 * during:>14.1f} ms | "
              f"{1e3 * (during - base):>+11.1f} ms")
    if not bc.directory:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(tyro.cli(CheckpointBenchConfig, prog="python -m experiments.bench.checkpoint"))
