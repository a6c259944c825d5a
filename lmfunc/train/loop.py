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

import torch.distributed as dist

from lmfunc.checkpoint.locate import CONFIG_FILE
from lmfunc.compiler.isa_probe import start_cpu_vec_isa_probe
from lmfunc.config.model import ConfigError
from lmfunc.config.train import TrainConfig
from lmfunc.config.yaml_io import config_to_dict, config_yaml, save_config
from lmfunc.data.loader import PrefetchLoader
from lmfunc.data.tokenizer import load_tokenizer, padded_vocab_size
from lmfunc.generate import sample_text
from lmfunc.metrics import Throughput, memory_stats_mib, peak_flops
from lmfunc.plan.report import format_plan, make_plan
from lmfunc.parallel.mesh import Layout, build_mesh, launched_world_size, resolve_device
from lmfunc.parallel.sharding import full_tensors
from lmfunc.precision import check_for_nan_in_loss, compute_dtype, set_tf32
from lmfunc.train.batch_plan import BatchPlan
from lmfunc.train.grad_underflow import underflow_at_step
from lmfunc.train.resume import check_writable, prepare_run_paths_on_every_rank, restore_state
from lmfunc.train.host_memory import keep_freed_host_memory
from lmfunc.train.run_checkpoints import RunCheckpoints
from lmfunc.train.run_lock import RunLock
from lmfunc.train.run_step import even_expert_share
from lmfunc.train.log import RunLogger, WandbSettings, router_layer_values, run_announcement, step_extras, train_line
from lmfunc.train.make_optimizer import run_optimizer
from lmfunc.train.memory_watch import MemoryWatch
from lmfunc.train.timers import PhaseTimers, format_timers
from lmfunc.train.from_megatron import megatron_start
from lmfunc.train.params import initial_params
from lmfunc.train.pipeline_run import gather_pipeline_params, initial_rank_params, pipeline_rank, pipeline_steps
from lmfunc.train.profiling import StepProfiler
from lmfunc.train.run_data import eval_batches, global_batch_part, run_datasets
from lmfunc.train.signals import StopRequests
from lmfunc.train.skipped_steps import first_step_overflow, mostly_skipped
from lmfunc.train.state import TrainState
from lmfunc.train.run_step import run_eval_step, run_train_step
from lmfunc.train.torch_support import refuse_what_this_torch_cannot
from lmfunc.train.step import evaluate


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


def train(cfg: TrainConfig) -> RunResult:
    """Train ``cfg`` (validated first) and return the run's losses, directory and sample."""
    world_size = launched_world_size()
    cfg = cfg.validate(world_size)
    refuse_what_this_torch_cannot(cfg.model, world_size, cfg.run.compile)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's {tokenizer.vocab_size} ids; "
            f"set model.vocab_size to at least {tokenizer.vocab_size} ({padded_vocab_size(tokenizer.vocab_size)} is "
            "the Megatron-padded size)"
        )
    device = resolve_device(cfg.run.device)
    set_tf32(cfg.precision.tf32)
    if cfg.run.keep_host_memory:
        keep_freed_host_memory()
    layout = build_mesh(cfg.parallel.sizes(world_size), device)
    if layout.mesh is None:
        return _train(cfg, tokenizer, layout)
    try:
        with even_expert_share(cfg, layout.sizes):
            result = _train(cfg, tokenizer, layout)
        # Every rank leaves together: a rank that tears down its process group while another is
        # still saving or sampling makes gloo abort the process at exit.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _train(cfg: TrainConfig, tokenizer, layout: Layout) -> RunResult:
    """The run in named phases: setup, the step loop (with evaluation and checkpoint saves inside),
    finish; whatever happens, the loader, the signal handlers, an in-flight save and the log are
    closed."""
    run = _Run(cfg, tokenizer, layout)
    try:
        run.setup()
        run.step_loop()
        return run.finish()
    finally:
        run.close()


class _Run:
    """One training run between its phases: what setup built and what the loop has done so far."""

    def __init__(self, cfg: TrainConfig, tokenizer, layout: Layout) -> None:
        self.cfg, self.tokenizer, self.layout = cfg, tokenizer, layout
        self.main_rank = not dist.is_initialized() or dist.get_rank() == 0
        self.plan = BatchPlan.from_config(cfg.run, layout.data_parallel_size)
        self.train_losses: list[tuple[int, float]] = []
        self.val_losses: list[tuple[int, float]] = []
        self.meter, self.interval_losses = Throughput(), []
        self.timers = PhaseTimers(cfg.log.timers)
        self.started = time.perf_counter()
        # Set by setup; close() releases whatever was set.
        self.locks: list[RunLock] = []
        self.logger: Optional[RunLogger] = None
        self.checkpoints: Optional[RunCheckpoints] = None
        self.loader: Optional[PrefetchLoader] = None
        self.stop: Optional[StopRequests] = None
        self.profiler: Optional[StepProfiler] = None
        self.pipe = None

    # Phase 1: setup.
    def setup(self) -> None:
        """Datasets, the run directory (checked, locked) and log, the model and optimizer, the
        restored state, the compiled steps, the batch loader and the stop requests. Nothing is
        written before every check that can refuse the run has passed."""
        cfg = self.cfg
        run = cfg.run
        if run.compile and self.layout.device.type == "cpu":
            start_cpu_vec_isa_probe()  # Inductor's CPU check, on other cores while the data is read
        check_writable(run.out_dir, "run.out_dir")  # the data index cache is written there first
        self.train_iters = (run.train_iters if run.train_iters is not None
                            else self.plan.train_iters_for_samples(run.train_samples))
        if self.train_iters < 1:
            raise ConfigError(f"run.train_samples ({run.train_samples}) is less than one global batch; train longer")
        self.train_data, self.valid_data = run_datasets(cfg, self.tokenizer, self.train_iters)
        self.paths, self.locks = prepare_run_paths_on_every_rank(cfg, self.main_rank)
        self.cfg = cfg = self.paths.cfg
        self.run_dir = self.paths.run_dir if self.main_rank else None
        wandb = (WandbSettings(cfg.log.wandb_project, cfg.log.wandb_exp_name, cfg.log.wandb_save_dir, config_to_dict(cfg))
                 if cfg.log.wandb_project else None)
        self.logger = RunLogger(self.run_dir, self.train_iters, cfg.log.progress_bar, cfg.log.tensorboard, wandb)
        for lock in self.locks:
            if lock.taken_over:
                self.logger.echo(lock.taken_over)
        self.logger.echo("resolved config:\n" + config_yaml(cfg).rstrip())
        self.profiler = StepProfiler(cfg.log, dist.get_rank() if dist.is_initialized() else 0, self.paths.run_dir,
                                     self.layout.device, self.logger.echo)
        # From here on a first Ctrl-C or SIGTERM means: stop after the (first) step, with a checkpoint.
        self.stop = StopRequests(cfg.checkpoint.exit_signal_handler,
                                 None if run.exit_duration_in_mins is None else 60 * run.exit_duration_in_mins,
                                 self.layout.device)
        self._set_up_throughput_and_announce()
        self._set_up_state_and_steps()
        if self.run_dir is not None:
            save_config(cfg, os.path.join(self.run_dir, CONFIG_FILE))
        self.evaluating = self.valid_data is not None and run.eval_iters > 0
        self.eval_batches = eval_batches(self.valid_data, cfg, self.tokenizer, self.layout) if self.evaluating else []
        # The next batches are built on a thread while the step runs.
        self.loader = PrefetchLoader(self._train_batch, self.plan.samples_before_steps(
            max(self.train_iters - self.start_step, 0), self.consumed)[:-1])
        self.step = self.checkpoints.saved_step = self.start_step
        self.exit_reason = "train_iters" if run.train_iters is not None else "train_samples"

    def _set_up_throughput_and_announce(self) -> None:
        cfg, layout = self.cfg, self.layout
        processes = dist.get_world_size() if dist.is_initialized() else 1
        plan = make_plan(cfg, processes)
        self.logger.echo(format_plan(plan))
        self.memory_watch = MemoryWatch(plan, layout.device, compiled=cfg.run.compile)
        peak, peak_source = peak_flops(layout.device, cfg.precision.compute_dtype, cfg.precision.tf32, cfg.log.peak_flops)
        self.peak_flops = peak * processes
        self.flops_token = plan.flops_per_token
        self.logger.echo(run_announcement(cfg, layout, self.run_dir, processes, len(self.train_data),
                                          len(self.valid_data) if self.valid_data else 0, self.train_iters,
                                          self.flops_token, self.peak_flops, peak_source))

    def _set_up_state_and_steps(self) -> None:
        cfg, run, plan, iters = self.cfg, self.cfg.run, self.plan, self.train_iters
        device = self.layout.device
        self.pipe = pipe = pipeline_rank(cfg, self.layout)
        if pipe is not None:
            params = initial_rank_params(cfg, pipe, device, resuming=self.paths.load_step is not None)
        else:
            params = initial_params(cfg, self.layout, resuming=self.paths.load_step is not None)
        tx, schedule = run_optimizer(cfg, plan, iters, params, device)
        loss_scale = cfg.precision.loss_scaling()
        dtype = compute_dtype(cfg.precision.compute_dtype)
        self.checkpoints = RunCheckpoints(cfg, self.paths.save_dir, self.logger)
        fresh = TrainState.create(params, tx, seed=run.seed, loss_scale=loss_scale)
        if self.paths.load_step is None:  # a Megatron run continues where it stopped (when it is one)
            fresh = megatron_start(cfg, fresh, self.logger.echo)
        restored = restore_state(cfg, fresh, self.paths.load_dir, self.paths.load_step, warn=self.logger.echo,
                                 part=pipe is not None)
        self.state = restored.state
        self.checkpoints.note_damaged(self.paths.load_dir, restored.damaged)
        self.start_step, self.consumed = int(self.state.step), int(self.state.consumed_samples)
        self.skipped_before = int(self.state.loss_scale.skipped_steps) if self.state.loss_scale is not None else 0
        if restored.source is not None:
            what = ("weights only, fresh optimizer (finetune)" if restored.finetune
                    else f"step {self.start_step}, {self.consumed} samples consumed")
            self.logger.echo(f"loaded checkpoint {restored.source}: {what}")
            self.logger.record("resume", self.start_step, checkpoint=restored.source, consumed_samples=self.consumed,
                               finetune=restored.finetune)
        if pipe is not None:
            self._set_up_pipeline_steps(tx, schedule, loss_scale, dtype)
            return
        on_mesh = self.layout.mesh is not None
        self.train_step = run_train_step(cfg, tx, schedule, on_mesh)
        self.eval_step = run_eval_step(cfg, on_mesh)

    def _set_up_pipeline_steps(self, tx, schedule, loss_scale, dtype) -> None:
        self.train_step, self.eval_step, description = pipeline_steps(
            self.cfg, self.pipe, self.plan.num_microbatches_at(0), tx, schedule, loss_scale, dtype, self.layout.device)
        self.logger.echo(description)

    def _train_batch(self, start: int) -> tuple[int, dict]:
        microbatches = self.plan.num_microbatches_at(start)
        return microbatches, global_batch_part(self.train_data, start, microbatches, self.cfg, self.tokenizer,
                                               self.layout)

    # Phase 2: the step loop.
    def step_loop(self) -> None:
        """Train until the length is reached or a stop is requested, evaluating, logging and saving
        at their intervals."""
        run = self.cfg.run
        if self.evaluating and self.start_step == 0:
            self.validate(0)
        self.started = time.perf_counter()
        timers, batches = self.timers, iter(self.loader)
        for step in range(self.start_step + 1, self.train_iters + 1):
            self.profiler.before_step(step)
            with timers.phase("data"):
                item = next(batches, None)
            if item is None:
                break
            microbatches, batch = item
            self.step = step
            self._measure_underflow(step, batch)
            began = time.perf_counter()
            self.state, metrics = self.train_step(self.state, batch)
            dispatched = time.perf_counter()
            loss = float(metrics["loss"])  # waits for the device's results
            timers.add("step_host", dispatched - began)
            timers.add("step_device", time.perf_counter() - dispatched)
            timers.add("step", time.perf_counter() - began)
            self._after_step(step, microbatches, metrics, loss)
            if self.evaluating and (step % run.eval_interval == 0 or step == self.train_iters):
                self.validate(step)
            began = time.perf_counter()
            with timers.phase("save"):
                self.checkpoints.after_step(step, self.state)
            self.meter.pause(time.perf_counter() - began)
            self.profiler.after_step(step)
            reason = self.stop.should_stop(save_failed=self.checkpoints.stop_requested)
            if reason is None and run.exit_interval is not None and step % run.exit_interval == 0:
                reason = "exit_interval"
            if reason is not None:
                self.exit_reason = reason
                break
        self.logger.end_progress()

    def _measure_underflow(self, step: int, batch: dict) -> None:
        """The ``underflow`` record at the steps ``log.grad_underflow_interval`` asks for
        (``underflow_at_step``); not counted in tokens/s."""
        began = time.perf_counter()
        fractions = underflow_at_step(self.cfg, self.state, batch, step, step == self.start_step + 1,
                                      self.pipe is not None, self.logger.echo)
        if fractions is not None:
            self.logger.record("underflow", step, **fractions)
            self.meter.pause(time.perf_counter() - began)

    def _after_step(self, step: int, microbatches: int, metrics: dict, loss: float) -> None:
        """The NaN check, the counters, the progress bar and, at the log interval, the log record."""
        run, cfg = self.cfg.run, self.cfg
        if cfg.precision.check_for_nan_in_loss:
            check_for_nan_in_loss(loss, step, dist.get_rank() if dist.is_initialized() else 0,
                                  skipped=bool(metrics.get("skipped", 0.0)))
        if step == self.start_step + 1 and metrics.get("skipped") is not None and bool(metrics["skipped"]):
            self.logger.echo(first_step_overflow(self.cfg.precision, float(self.state.loss_scale.scale), step))
        global_batch = microbatches * run.micro_batch_size * self.layout.data_parallel_size
        self.consumed += global_batch
        self.interval_losses.append(loss)
        if step == self.start_step + 1:
            self.logger.echo(f"step {step} took {time.perf_counter() - self.started:.1f} s"
                             + (" (compiling the train step included)" if run.compile else ""))
            self.memory_watch.report(self.logger, step, "first step")
            self.meter.reset()
        else:
            self.meter.add(global_batch * cfg.data.seq_length)
        tokens_per_s = self.meter.rate()
        self.logger.progress(step, loss=f"{loss:.3f}", lr=f"{float(metrics['lr']):.2e}", tok_s=f"{tokens_per_s or 0:.0f}")
        if step % cfg.log.log_interval == 0:
            with self.timers.phase("log"):
                self._log_interval(step, global_batch, metrics, tokens_per_s)
            self._report_timers(step)

    def _log_interval(self, step: int, global_batch: int, metrics: dict, tokens_per_s: Optional[float]) -> None:
        mean_loss = sum(self.interval_losses) / len(self.interval_losses)
        memory = memory_stats_mib(self.layout.device)
        mfu = tokens_per_s * self.flops_token / self.peak_flops if tokens_per_s else None
        extra = step_extras(metrics, self.state)
        grad_norm, lr = float(metrics["grad_norm"]), float(metrics["lr"])
        self.logger.record(
            "train", step, loss=mean_loss, grad_norm=grad_norm, lr=lr, tokens_per_s=tokens_per_s, mfu=mfu,
            consumed_samples=self.consumed, global_batch_size=global_batch,
            **extra, **router_layer_values(metrics, self.cfg.model),
            **{f"mem_{k}_mib": round(v, 1) for k, v in memory.items()},
        )
        self.logger.echo(train_line(step, self.train_iters, mean_loss, grad_norm, lr, extra, tokens_per_s, mfu, memory))
        self.train_losses.append((step, mean_loss))
        self.interval_losses = []
        self.meter.reset()

    def _report_timers(self, step: int) -> None:
        report = self.timers.report()
        if report:
            self.logger.record("timers", step, **report)
            self.logger.echo(format_timers(report, dist.get_world_size() if dist.is_initialized() else 1))

    # Phase 3: evaluation and checkpoints (called from the loop and at the end).
    def validate(self, step: int) -> None:
        with self.timers.phase("eval"):
            self._validate(step)

    def _validate(self, step: int) -> None:
        began = time.perf_counter()
        val_loss = evaluate(self.eval_step, self.state.params, self.eval_batches)
        self.val_losses.append((step, val_loss))
        ppl = math.exp(min(val_loss, 50.0))
        self.logger.record("valid", step, loss=val_loss, ppl=ppl)
        note = " (compiling the eval step included)" if step == 0 and self.cfg.run.compile else ""
        self.logger.echo(f"validation at step {step}: loss {val_loss:.4f} | ppl {ppl:.2f}{note}")
        self.meter.pause(time.perf_counter() - began)

    # Phase 4: finish.
    def finish(self) -> RunResult:
        """The last save and evaluation, the weights, the sample and the end record."""
        cfg, step = self.cfg, self.step
        self.checkpoints.finish(step, self.state, save=self.exit_reason != "save_failed")
        failed = self.checkpoints.error
        finished = self.exit_reason in ("train_iters", "train_samples")
        if self.evaluating and finished and (not self.val_losses or self.val_losses[-1][0] != step):
            self.validate(step)
        if self.pipe is not None:
            final_params = gather_pipeline_params(self.state.params, cfg.model, self.pipe, self.layout.device)
        else:
            final_params = full_tensors(self.state.params) if self.layout.mesh is not None else self.state.params
        if (cfg.checkpoint.save_weights or failed is not None) and self.run_dir is not None:
            self.checkpoints.write_weights(final_params, self.run_dir, step, self.logger.echo)
        sample = (sample_text(final_params, cfg.model, self.tokenizer, cfg.run.sample_prompt, cfg.run.sample_tokens, cfg.run.seed)
                  if cfg.run.sample_tokens > 0 and self.main_rank and finished else None)
        duration = time.perf_counter() - self.started
        self.memory_watch.report(self.logger, step, "end")
        self.logger.record("end", step, consumed_samples=self.consumed, duration_s=duration,
                           exit_reason=self.exit_reason, sample=sample)
        self.logger.echo(f"finished at step {step} ({self.exit_reason}) after {duration:.0f} s; logs: {self.logger.path}")
        if self.state.loss_scale is not None:
            warning = mostly_skipped(self.cfg.precision, int(self.state.loss_scale.skipped_steps) - self.skipped_before,
                                     step - self.start_step)
            if warning is not None:
                self.logger.echo(warning)
        if sample is not None:
            self.logger.echo(f"sample (temperature 0.8, top-k 40):\n{sample}")
        if failed is not None:
            raise failed
        return RunResult(self.run_dir, step, self.consumed, self.train_losses, self.val_losses, sample,
                         self.exit_reason)

    def close(self) -> None:
        """Release what setup built, as far as it got."""
        try:
            if self.stop is not None:
                self.stop.close()
            if self.loader is not None:
                self.loader.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
            if self.profiler is not None:  # a window the run ended inside is written here
                self.profiler.finish()
            if self.logger is not None:
                self.logger.close()
        finally:
            for lock in self.locks:
                lock.release()
