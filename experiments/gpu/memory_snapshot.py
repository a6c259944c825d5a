"""Where a compiled train step's CUDA memory goes: the caching allocator's history of one step.

``python -m experiments.gpu.memory_snapshot OUT_DIR [--dtype fp32|bf16] [--gpt2-small]`` builds the
default job's (or the benchmark's GPT-2-small shape's: 12 layers, width 768, 12 heads, seq 1024,
vocab 50304, batch 8) state and compiled step on cuda exactly as ``experiments.plan_accuracy`` does on the
CPU, runs two steps, then records the allocator's history
(``torch.cuda.memory._record_memory_history``) over the third and writes
``OUT_DIR/snapshot_[gpt2_]DTYPE.pickle``
(read it with ``python -m experiments.gpu.memory_snapshot --read FILE``, or pytorch.org/memory_viz).
It prints the bytes the state and batch hold, the step's peak above them, lmfunc.plan's
prediction, and the first step's peak (compilation and autotuning included).
``--read FILE`` lists the blocks alive at the snapshot's peak, largest first, with the frame
that allocated each (the generated code's line: keep Inductor's output code beside it).
"""

from __future__ import annotations

import json
import pickle
import sys
from collections import Counter
from pathlib import Path

MiB = 2**20


def train_config(dtype: str, gpt2_small: bool):
    """The default job's ``TrainConfig`` in ``dtype``, or the benchmark's GPT-2-small shape."""
    import dataclasses

    from lmfunc.config import ModelConfig
    from lmfunc.config.train import PrecisionConfig, TrainConfig

    cfg = TrainConfig(precision=PrecisionConfig(compute_dtype=dtype))
    if gpt2_small:
        cfg = cfg.replace(model=ModelConfig(vocab_size=50304, hidden_size=768, num_layers=12, num_attention_heads=12,
                                            max_position_embeddings=1024),
                          data=dataclasses.replace(cfg.data, seq_length=1024),
                          run=dataclasses.replace(cfg.run, micro_batch_size=8, global_batch_size=8))
    return cfg.validate(1)


def measure(out_dir: Path, dtype: str, gpt2_small: bool = False) -> dict:
    import torch

    from lmfunc.plan import make_plan
    from lmfunc.precision import compute_dtype
    from lmfunc.train.batch_plan import BatchPlan
    from lmfunc.train.make_optimizer import build_lr_schedule, build_optimizer
    from lmfunc.train.params import init_params
    from lmfunc.train.state import TrainState
    from lmfunc.train.step import make_train_step
    from lmfunc.tree import tree_bytes

    device = torch.device("cuda")
    cfg = train_config(dtype, gpt2_small)
    plan = BatchPlan.from_config(cfg.run, 1)
    schedule = build_lr_schedule(cfg, plan, cfg.run.train_iters, device=device)
    params = init_params(cfg.model, None, seed=cfg.run.seed, device=device)
    tx = build_optimizer(cfg, schedule, params)
    state = TrainState.create(params, tx, seed=cfg.run.seed, loss_scale=cfg.precision.loss_scaling())
    step = make_train_step(cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule,
                           compute_dtype=compute_dtype(dtype), loss_scale=cfg.precision.loss_scaling(),
                           compile=True, donate_state=True)
    microbatches = cfg.run.global_batch_size // cfg.run.micro_batch_size
    tokens = torch.randint(0, 256, (microbatches, cfg.run.micro_batch_size, cfg.data.seq_length), device=device)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, dims=-1)}
    torch.cuda.synchronize()
    before_first = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    state, _ = step(state, batch)
    torch.cuda.synchronize()
    first_peak = torch.cuda.max_memory_allocated() - before_first
    state, _ = step(state, batch)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    state, _ = step(state, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(out_dir / f"snapshot_{'gpt2_' if gpt2_small else ''}{dtype}.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)
    predicted = make_plan(cfg, 1).lmfunc
    return {"dtype": dtype, "held_mib": held / MiB, "state_and_batch_mib": (tree_bytes(state) + tree_bytes(batch)) / MiB,
            "step_peak_above_held_mib": peak / MiB, "measured_mib": (held + peak) / MiB,
            "predicted_mib": predicted.peak / MiB, "first_step_peak_above_held_mib": first_peak / MiB,
            "predicted_rows_mib": {name: value / MiB for name, value in predicted.rows()}}


def read(path: Path, top: int = 40) -> None:
    """Replay the snapshot's alloc/free events of device 0, and print the blocks alive at the peak."""
    snapshot = pickle.loads(path.read_bytes())
    events = snapshot["device_traces"][0]
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: dict[int, dict] = {}
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed":
            total -= event["size"]
            live.pop(event["addr"], None)
    print(f"{path.name}: peak {peak / MiB:.1f} MiB above the bytes held when the recording began; "
          f"{len(at_peak)} blocks allocated since then alive at the peak:")

    def where(event: dict) -> str:
        frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py")]
        inner = next((f for f in frames if "torchinductor" in f["filename"] or "/tmp/" in f["filename"]), None)
        frame = inner or (frames[0] if frames else None)
        return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}" if frame else "?"

    by_site = Counter()
    for event in at_peak.values():
        by_site[where(event)] += event["size"]
    for site, size in by_site.most_common(top):
        print(f"  {size / MiB:9.2f} MiB  {site}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--read"]:
        for name in args[1:]:
            read(Path(name))
    else:
        out = Path(args[0])
        dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "fp32"
        print(json.dumps(measure(out, dtype, gpt2_small="--gpt2-small" in args)))
