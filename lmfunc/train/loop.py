"""The training loop: data, the compiled step, evaluation, logging, checkpoints, exit conditions,
a final sample.

``train(cfg)`` runs a whole ``TrainConfig`` (on every rank of a torchrun launch) and returns what
happened. Everything random is seeded from the config and the train state, so the same config
gives the same losses, and a run resumed from a checkpoint continues them exactly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Optional

import numpy as np
import torch.distributed as dist

from lmfunc import model
from lmfunc.checkpoint import save_weights
from lmfunc.checkpoint.locate import CONFIG_FILE
from lmfunc.checkpoint.manager import CheckpointManager
from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import config_yaml, save_config
from lmfunc.data.batch import lm_batch
from lmfunc.data.loader import PrefetchLoader
from lmfunc.data.pipeline import build_datasets
from lmfunc.data.tokenizer import load_tokenizer, padded_vocab_size
from lmfunc.generate import generate
from lmfunc.metrics import flops_per_token, measure_matmul_peak_flops, memory_stats_mib
from lmfunc.parallel.mesh import Layout, build_mesh, data_parallel_rank, launched_world_size
from lmfunc.parallel.sharding import full_tensors, local_batch_to_dtensor
from lmfunc.precision import check_for_nan_in_loss, compute_dtype
from lmfunc.train.batching import BatchPlan
from lmfunc.train.checkpointing import RunPaths, broadcast, prepare_run_paths, restore_state
from lmfunc.train.log import RunLogger
from lmfunc.train.optimizer import build_lr_schedule, build_optimizer
from lmfunc.train.params import init_params, place_params
from lmfunc.train.signals import StopRequests
from lmfunc.train.state import TrainState
from lmfunc.train.step import make_eval_step, make_train_step
from lmfunc.tree import tree_size


@dataclasses.dataclass
class RunResult:
    """What a run did: its directory, the losses it logged and the final text sample."""

    run_dir: str
    steps: int
    consumed_samples: int
    train_losses: list[tuple[int, float]]
    val_losses: list[tuple[int, float]]
    sample: Optional[str]
    exit_reason: str


class _Throughput:
    """Tokens per second since the last ``reset``, with paused time (evaluation) left out."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def pause(self, seconds: float) -> None:
        self.since += seconds

    def rate(self) -> Optional[float]:
        """None until a timed step has finished."""
        return self.tokens / (time.perf_counter() - self.since) if self.tokens else None


def _datasets(cfg: TrainConfig, tokenizer, train_iters: int) -> tuple[object, Optional[object]]:
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


def _batch(dataset, start: int, microbatches: int, cfg: TrainConfig, tokenizer, layout: Layout) -> dict:
    """This rank's part of the global batch that starts at sample ``start``, Megatron's sequential
    sampler: microbatch j covers samples ``start + j * micro * dp ...``, of which data-parallel rank
    r loads ``micro`` from offset ``r * micro``. A ``[microbatches, micro_batch_size, S]`` batch, as
    DTensors of the global batch on a mesh."""
    micro, dp, rank = cfg.run.micro_batch_size, layout.data_parallel_size, data_parallel_rank(layout)
    indices = [start + j * micro * dp + rank * micro + i for j in range(microbatches) for i in range(micro)]
    samples = np.stack([dataset[i] for i in indices]).reshape(microbatches, micro, -1)
    d = cfg.data
    batch = lm_batch(samples, tokenizer.eod, d.reset_position_ids, d.reset_attention_mask, d.eod_mask_loss,
                     getattr(tokenizer, "pad", None))
    return local_batch_to_dtensor(batch, layout.mesh) if layout.mesh is not None else batch


def _eval_batches(dataset, cfg: TrainConfig, tokenizer, layout: Layout) -> list[dict]:
    """The first ``eval_iters`` global batches of the validation split (the same at every evaluation)."""
    microbatches = cfg.run.global_batch_size // (cfg.run.micro_batch_size * layout.data_parallel_size)
    return [_batch(dataset, i * cfg.run.global_batch_size, microbatches, cfg, tokenizer, layout)
            for i in range(cfg.run.eval_iters)]


def _evaluate(eval_step, params, batches: list[dict]) -> float:
    """Mean loss per token over ``batches``."""
    loss_sum, count = 0.0, 0.0
    for batch in batches:
        out = eval_step(params, batch)
        loss_sum, count = loss_sum + float(out["loss_sum"]), count + float(out["num_tokens"])
    return loss_sum / max(count, 1.0)


def _step_extras(metrics: dict, state: TrainState) -> dict[str, float]:
    """The MTP losses of the last step and the loss scaler's state, for the log line and record."""
    extra = {k: float(v) for k, v in metrics.items() if k.startswith("mtp_")}
    if state.loss_scale is not None:
        extra["loss_scale"] = float(state.loss_scale.scale)
        extra["skipped_steps"] = float(state.loss_scale.skipped_steps)
    return extra


def _sample_text(params, cfg: TrainConfig, tokenizer) -> Optional[str]:
    prompt = tokenizer.encode(cfg.run.sample_prompt) or [tokenizer.eod]
    new_tokens = min(cfg.run.sample_tokens, cfg.model.max_position_embeddings - len(prompt))
    if new_tokens <= 0:
        return None
    tokens = generate(params, cfg.model, prompt, new_tokens, temperature=0.8, top_k=40, seed=cfg.run.seed)
    return tokenizer.decode(tokens.tolist())


def train(cfg: TrainConfig) -> RunResult:
    """Train ``cfg`` (validated first) and return the run's losses, directory and sample."""
    world_size = launched_world_size()
    cfg.validate(world_size)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's {tokenizer.vocab_size} ids; "
            f"set model.vocab_size to at least {tokenizer.vocab_size} ({padded_vocab_size(tokenizer.vocab_size)} is "
            "the Megatron-padded size)"
        )
    layout = build_mesh(cfg.parallel.sizes(world_size))
    if layout.mesh is None:
        return _train(cfg, tokenizer, layout)
    try:
        result = _train(cfg, tokenizer, layout)
        # Every rank leaves together: a rank that tears down its process group while another is
        # still saving or sampling makes gloo abort the process at exit.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _run_paths(cfg: TrainConfig, main_rank: bool) -> RunPaths:
    """Rank 0's ``prepare_run_paths`` on every rank (its ConfigError raised on every rank)."""
    decision: object = None
    if main_rank:
        try:
            decision = prepare_run_paths(cfg)
        except ConfigError as err:
            decision = err
    decision = broadcast(decision)
    if isinstance(decision, ConfigError):
        raise decision
    return decision


def _initial_params(cfg: TrainConfig, layout: Layout, resuming: bool):
    """Freshly initialised parameters, or those imported from ``checkpoint.load_hf`` (unless the run
    resumes from its own checkpoint), in the layout."""
    if cfg.checkpoint.load_hf is not None and not resuming:
        from lmfunc.checkpoint.hf import load_llama

        return place_params(load_llama(cfg.checkpoint.load_hf, cfg.model), cfg.model, layout.mesh)
    return init_params(cfg.model, layout.mesh, seed=cfg.run.seed)


def _train(cfg: TrainConfig, tokenizer, layout: Layout) -> RunResult:
    run, seq = cfg.run, cfg.data.seq_length
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    plan = BatchPlan.from_config(run, layout.data_parallel_size)
    train_iters = run.train_iters if run.train_iters is not None else plan.train_iters_for_samples(run.train_samples)
    if train_iters < 1:
        raise ConfigError(f"run.train_samples ({run.train_samples}) is less than one global batch; train longer")
    train_data, valid_data = _datasets(cfg, tokenizer, train_iters)

    paths = _run_paths(cfg, main_rank)
    run_dir = paths.run_dir if main_rank else None
    if run_dir is not None:
        save_config(cfg, os.path.join(run_dir, CONFIG_FILE))
    logger = RunLogger(run_dir, train_iters, cfg.log.progress_bar, cfg.log.tensorboard)
    logger.echo("resolved config:\n" + config_yaml(cfg).rstrip())
    processes = dist.get_world_size() if dist.is_initialized() else 1
    peak_flops = (cfg.log.peak_flops or measure_matmul_peak_flops()) * processes
    flops_token = flops_per_token(cfg.model, seq)
    source = cfg.data.path or cfg.data.train_path or cfg.data.text_file or ("mock" if cfg.data.mock else "embedded corpus")
    logger.echo(
        f"run directory: {run_dir}\n"
        + (f"mesh: {dict(zip(layout.dims(), layout.mesh.mesh.shape))} over {dist.get_world_size()} processes\n"
           if layout.mesh is not None else "")
        + f"data: {len(train_data)} train / {len(valid_data) if valid_data else 0} validation samples of {seq} tokens "
        f"({source}); {train_iters} steps; model {tree_size(model.param_shapes(cfg.model)) / 1e6:.2f}M params, "
        f"{flops_token / 1e6:.2f} MFLOP/token; MFU peak {peak_flops / 1e9:.1f} GFLOP/s "
        f"({'configured' if cfg.log.peak_flops else 'measured fp32 matmul'}"
        + (f", x {processes} processes" if processes > 1 else "") + ")"
    )

    schedule = build_lr_schedule(cfg, plan, train_iters)
    decoupled = (build_lr_schedule(cfg, plan, train_iters, cfg.optim.decoupled_lr, cfg.optim.decoupled_min_lr)
                 if cfg.optim.decoupled_lr is not None else None)
    params = _initial_params(cfg, layout, resuming=paths.load_step is not None)
    tx = build_optimizer(cfg, schedule, params, decoupled)
    loss_scale = cfg.precision.loss_scaling()
    dtype = compute_dtype(cfg.precision.compute_dtype)
    manager = (CheckpointManager(paths.save_dir, cfg.checkpoint.keep, cfg.checkpoint.async_save)
               if cfg.checkpoint.save else None)
    if manager is not None and manager.removed_partial:
        logger.echo(f"removed unfinished checkpoint saves in {paths.save_dir}: {', '.join(manager.removed_partial)}")
    restored = restore_state(cfg, TrainState.create(params, tx, seed=run.seed, loss_scale=loss_scale),
                             paths.load_dir, paths.load_step)
    state = restored.state
    start_step, consumed = int(state.step), int(state.consumed_samples)
    if restored.source is not None:
        what = "weights only, fresh optimizer (finetune)" if restored.finetune else f"step {start_step}, {consumed} samples consumed"
        logger.echo(f"loaded checkpoint {restored.source}: {what}")
        logger.record("resume", start_step, checkpoint=restored.source, consumed_samples=consumed,
                      finetune=restored.finetune)
    train_step = make_train_step(
        cfg.model, tx, clip_grad=cfg.optim.clip_grad, lr_schedule=schedule, compute_dtype=dtype,
        loss_scale=loss_scale, calculate_per_token_loss=run.calculate_per_token_loss, compile=run.compile,
        donate_state=True,
    )
    eval_step = make_eval_step(cfg.model, compute_dtype=dtype, compile=run.compile)

    train_losses: list[tuple[int, float]] = []
    val_losses: list[tuple[int, float]] = []

    def validate(step: int) -> None:
        began = time.perf_counter()
        val_loss = _evaluate(eval_step, state.params, eval_batches)
        val_losses.append((step, val_loss))
        logger.record("valid", step, loss=val_loss, ppl=math.exp(min(val_loss, 50.0)))
        note = " (compiling the eval step included)" if step == 0 and run.compile else ""
        logger.echo(f"validation at step {step}: loss {val_loss:.4f} | ppl {math.exp(min(val_loss, 50.0)):.2f}{note}")
        meter.pause(time.perf_counter() - began)

    committed = manager.last_saved if manager is not None else None

    def note_commits() -> None:
        """Log the background saves that have been committed since the last call."""
        nonlocal committed
        if manager is not None and manager.last_saved != committed:
            committed = manager.last_saved
            logger.record("checkpoint", committed, path=manager.path(committed))
            logger.echo(f"saved checkpoint {manager.path(committed)}")

    def save(step: int) -> None:
        began = time.perf_counter()
        manager.save(step, state, files={CONFIG_FILE: config_yaml(cfg)}, stage=True)  # the next step donates state
        note_commits()
        meter.pause(time.perf_counter() - began)

    evaluating = valid_data is not None and run.eval_iters > 0
    eval_batches = _eval_batches(valid_data, cfg, tokenizer, layout) if evaluating else []

    def train_batch(start: int) -> tuple[int, dict]:
        microbatches = plan.num_microbatches_at(start)
        return microbatches, _batch(train_data, start, microbatches, cfg, tokenizer, layout)

    # The next batches are built on a thread while the step runs.
    loader = PrefetchLoader(train_batch, plan.samples_before_steps(max(train_iters - start_step, 0), consumed)[:-1])
    stop = StopRequests(cfg.checkpoint.exit_signal_handler,
                        None if run.exit_duration_in_mins is None else 60 * run.exit_duration_in_mins)
    meter, interval_losses, step, saved_step = _Throughput(), [], start_step, start_step
    exit_reason = "train_iters" if run.train_iters is not None else "train_samples"
    try:
        if evaluating and start_step == 0:
            validate(0)
        start = time.perf_counter()
        for step, (microbatches, batch) in enumerate(loader, start=start_step + 1):
            state, metrics = train_step(state, batch)
            loss = float(metrics["loss"])
            if cfg.precision.check_for_nan_in_loss:
                check_for_nan_in_loss(loss, step, dist.get_rank() if dist.is_initialized() else 0,
                                      skipped=bool(metrics.get("skipped", 0.0)))
            consumed += microbatches * run.micro_batch_size * layout.data_parallel_size
            interval_losses.append(loss)
            if step == start_step + 1:
                logger.echo(f"step {step} took {time.perf_counter() - start:.1f} s"
                            + (" (compiling the train step included)" if run.compile else ""))
                meter.reset()
            else:
                meter.add(microbatches * run.micro_batch_size * layout.data_parallel_size * seq)
            tokens_per_s = meter.rate()
            logger.progress(step, loss=f"{loss:.3f}", lr=f"{float(metrics['lr']):.2e}", tok_s=f"{tokens_per_s or 0:.0f}")
            if step % cfg.log.log_interval == 0:
                mean_loss = sum(interval_losses) / len(interval_losses)
                memory = memory_stats_mib()
                mfu = tokens_per_s * flops_token / peak_flops if tokens_per_s else None
                extra = _step_extras(metrics, state)
                logger.record(
                    "train", step, loss=mean_loss, grad_norm=float(metrics["grad_norm"]), lr=float(metrics["lr"]),
                    tokens_per_s=tokens_per_s, mfu=mfu, consumed_samples=consumed,
                    global_batch_size=microbatches * run.micro_batch_size * layout.data_parallel_size,
                    **extra, **{f"mem_{k}_mib": round(v, 1) for k, v in memory.items()},
                )
                logger.echo(
                    f"step {step:>6d}/{train_iters} | loss {mean_loss:.4f} | grad norm {float(metrics['grad_norm']):.3f} | "
                    f"lr {float(metrics['lr']):.3e} | "
                    + "".join(f"{k.replace('_', ' ')} {v:.4g} | " for k, v in extra.items())
                    + (f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if tokens_per_s else "tok/s - | MFU -")
                    + f" | mem {memory['peak_rss']:.0f} MiB peak RSS"
                )
                train_losses.append((step, mean_loss))
                interval_losses = []
                meter.reset()
            if evaluating and (step % run.eval_interval == 0 or step == train_iters):
                validate(step)
            if manager is not None:
                manager.in_flight()
                note_commits()
                if cfg.checkpoint.save_interval is not None and step % cfg.checkpoint.save_interval == 0:
                    save(step)
                    saved_step = step
            reason = stop.should_stop()
            if reason is None and run.exit_interval is not None and step % run.exit_interval == 0:
                reason = "exit_interval"
            if reason is not None:
                exit_reason = reason
                break
        logger.end_progress()
        if manager is not None:
            if saved_step != step:
                save(step)
            manager.wait()
            note_commits()
        finished = exit_reason in ("train_iters", "train_samples")
        if evaluating and finished and (not val_losses or val_losses[-1][0] != step):
            validate(step)
        final_params = full_tensors(state.params) if layout.mesh is not None else state.params
        if cfg.checkpoint.save_weights and run_dir is not None:
            save_weights(final_params, os.path.join(run_dir, "model.safetensors"), {"step": str(step)})
        sample = (_sample_text(final_params, cfg, tokenizer)
                  if run.sample_tokens > 0 and main_rank and finished else None)
        duration = time.perf_counter() - start
        logger.record("end", step, consumed_samples=consumed, duration_s=duration, exit_reason=exit_reason, sample=sample)
        logger.echo(f"finished at step {step} ({exit_reason}) after {duration:.0f} s; logs: {logger.path}")
        if sample is not None:
            logger.echo(f"sample (temperature 0.8, top-k 40):\n{sample}")
    finally:
        stop.close()
        loader.close()
        if manager is not None and manager.in_flight() is not None:
            try:  # an error is on its way out: still finish the save that was being written
                manager.wait()
            except RuntimeError as err:
                logger.echo(str(err))
        logger.close()
    return RunResult(run_dir, step, consumed, train_losses, val_losses, sample, exit_reason)
