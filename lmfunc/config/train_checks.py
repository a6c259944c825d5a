"""The cross-field checks of a run's sections (``TrainConfig.validate`` runs them, section by
section): each message names the fields, their values and the fix."""

from __future__ import annotations

from lmfunc.config.model import ConfigError, ModelConfig, unbuildable_features
from lmfunc.config.parallel import ParallelConfig, check_divisibility
from lmfunc.config.pipeline import check_microbatches, check_schedule_model
from lmfunc.config.sections import CheckpointConfig, DataConfig, LogConfig, OptimConfig, PrecisionConfig, RunConfig, \
    schedule_lengths


def resolve_global_batch_size(run: RunConfig, data_parallel_size: int) -> int:
    """``run.global_batch_size``, or when unset ``micro_batch_size x data_parallel_size`` (one
    microbatch per step, Megatron's default)."""
    if run.global_batch_size is not None:
        return run.global_batch_size
    return run.micro_batch_size * data_parallel_size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(value: object, name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{name} must be a positive integer, got {value!r}")


def validate_batch(run: RunConfig, dp: int) -> None:
    _positive(run.micro_batch_size, "run.micro_batch_size")
    _positive(run.global_batch_size, "run.global_batch_size")
    unit = run.micro_batch_size * dp
    _require(
        run.global_batch_size % unit == 0,
        f"run.global_batch_size ({run.global_batch_size}) is not divisible by run.micro_batch_size "
        f"({run.micro_batch_size}) x data-parallel size ({dp}) = {unit}; make global_batch_size a multiple of {unit}",
    )
    if run.rampup_batch_size is None:
        return
    start, increment, samples = run.rampup_batch_size
    _require(run.train_samples is not None,
             "run.rampup_batch_size needs a sample-based run: set run.train_samples and run.train_iters to None")
    _require(0 < start <= run.global_batch_size and increment > 0 and samples >= 0,
             f"run.rampup_batch_size {run.rampup_batch_size} must be START INCREMENT SAMPLES with "
             f"0 < START <= run.global_batch_size ({run.global_batch_size}), INCREMENT > 0, SAMPLES >= 0")
    _require(
        (run.global_batch_size - start) % increment == 0,
        f"run.rampup_batch_size: global_batch_size - START ({run.global_batch_size} - {start}) is not "
        f"divisible by INCREMENT ({increment}); pick an increment that divides it",
    )
    for size in range(start, run.global_batch_size + 1, increment):
        _require(size % unit == 0,
                 f"run.rampup_batch_size passes through a global batch of {size}, not divisible by "
                 f"run.micro_batch_size x data-parallel size = {unit}; make START and INCREMENT multiples of {unit}")


def validate_length(run: RunConfig, optim: OptimConfig) -> None:
    """The run's length (iterations or samples, not both) and the lr schedule's lengths in its unit."""
    _require((run.train_iters is None) != (run.train_samples is None),
             "set exactly one of run.train_iters (iteration-based) and run.train_samples (sample-based); "
             f"got train_iters={run.train_iters}, train_samples={run.train_samples}")
    if run.train_iters is not None:
        _positive(run.train_iters, "run.train_iters")
        for name in ("lr_decay_samples", "lr_wsd_decay_samples"):
            _require(getattr(optim, name) is None,
                     f"optim.{name} is for sample-based runs; this run sets run.train_iters, so use "
                     f"optim.{name.replace('samples', 'iters')}")
        _require(optim.lr_warmup_samples == 0,
                 "optim.lr_warmup_samples is for sample-based runs; this run sets run.train_iters, so use "
                 "optim.lr_warmup_iters")
    else:
        _positive(run.train_samples, "run.train_samples")
        for name in ("lr_decay_iters", "lr_wsd_decay_iters"):
            _require(getattr(optim, name) is None,
                     f"optim.{name} is for iteration-based runs; this run sets run.train_samples, so use "
                     f"optim.{name.replace('iters', 'samples')}")
        _require(optim.lr_warmup_iters == 0 or optim.lr_warmup_fraction is not None,
                 f"optim.lr_warmup_iters ({optim.lr_warmup_iters}) is for iteration-based runs; this run sets "
                 "run.train_samples, so set optim.lr_warmup_iters to 0 and use optim.lr_warmup_samples")
    if optim.lr_warmup_fraction is not None:
        _require(0.0 <= optim.lr_warmup_fraction <= 1.0,
                 f"optim.lr_warmup_fraction must be in [0, 1], got {optim.lr_warmup_fraction}")
    unit, warmup, total, wsd = schedule_lengths(run, optim)
    length = "run.train_iters" if unit == "iters" else "run.train_samples"
    _require(0 <= warmup <= total,
             f"optim.lr_warmup_{unit} ({warmup}) is longer than the decay (optim.lr_decay_{unit} or {length} = "
             f"{total}); shorten the warmup or train longer")
    if optim.lr_decay_style == "WSD":
        _require(wsd is not None and 0 < wsd <= total,
                 f"optim.lr_decay_style WSD needs 0 < optim.lr_wsd_decay_{unit} <= {total}, got {wsd}")


def validate_precision(precision: PrecisionConfig) -> None:
    _require(precision.compute_dtype in ("fp32", "bf16", "fp16"),
             f"precision.compute_dtype must be fp32, bf16 or fp16, got {precision.compute_dtype!r}")
    _require(precision.loss_scale is None or precision.loss_scale > 0,
             f"precision.loss_scale must be positive (or unset for dynamic scaling), got {precision.loss_scale}")
    _require(precision.initial_loss_scale > 0 and 0 < precision.min_loss_scale <= precision.initial_loss_scale,
             f"need 0 < precision.min_loss_scale <= precision.initial_loss_scale, got "
             f"{precision.min_loss_scale} and {precision.initial_loss_scale}")
    _positive(precision.loss_scale_window, "precision.loss_scale_window")
    _positive(precision.hysteresis, "precision.hysteresis")


def validate_checkpoint(ck: CheckpointConfig) -> None:
    _require(ck.save_interval is None or ck.save_interval > 0,
             f"checkpoint.save_interval must be positive (or None to save only when the run stops), got {ck.save_interval}")
    _require(ck.keep is None or ck.keep > 0, f"checkpoint.keep must be positive (or None to keep all), got {ck.keep}")
    _require(ck.load_step is None or ck.load_step >= 0, f"checkpoint.load_step must be >= 0, got {ck.load_step}")
    for name in ("load_hf", "load_megatron"):
        _require(getattr(ck, name) is None or (ck.load is None and ck.load_step is None),
                 f"checkpoint.{name} starts from imported weights; it cannot be combined with checkpoint.load or "
                 "checkpoint.load_step")
    _require(ck.load_hf is None or ck.load_megatron is None,
             "checkpoint.load_hf and checkpoint.load_megatron both give the initial weights: pass one of them")
    _require(not ck.finetune or ck.load is not None or ck.load_step is not None or ck.load_megatron is not None,
             "checkpoint.finetune loads weights from an earlier run: set checkpoint.load to its checkpoint directory "
             "(or checkpoint.load_megatron to a Megatron save)")


def validate_pipeline(model: ModelConfig, parallel: ParallelConfig, run: RunConfig, world_size: int) -> None:
    """The layer split and the schedule's microbatch rule (``lmfunc.config.pipeline``) of a pp > 1
    run, or of a layer split given without one (``parallel``'s sizes resolved)."""
    p = parallel
    uneven = p.pp_first_stage_layers is not None or p.pp_last_stage_layers is not None
    if p.pp == 1 and p.virtual_stages is None and not uneven:
        return
    _require(p.pp > 1, "parallel.virtual_stages / pp_first_stage_layers / pp_last_stage_layers split a pipeline: "
                       "set --parallel.pp to 2 or more, or drop them")
    split = p.pipeline_split(model.num_layers)
    check_schedule_model(p.pp_schedule, model.tie_embeddings, model.mtp_num_layers, run.compile)
    _require(run.rampup_batch_size is None,
             f"run.rampup_batch_size ({run.rampup_batch_size}) with parallel.pp = {p.pp}: a pipeline schedule is "
             "built for one number of microbatches, so batch shapes are fixed per run; drop the ramp-up or use pp = 1")
    _require(run.calculate_per_token_loss,
             f"run.calculate_per_token_loss off with parallel.pp = {p.pp}: the pipeline divides the step's summed "
             "token losses by its token count (the per-token loss); turn it back on or use pp = 1")
    if run.global_batch_size is not None and run.micro_batch_size:
        per_rank = run.micro_batch_size * p.data_parallel_size(world_size)
        if run.global_batch_size % per_rank == 0:
            check_microbatches(p.pp_schedule, split, run.global_batch_size // per_rank)


def validate_context_parallel(model: ModelConfig, cp: int) -> None:
    """What context parallelism (``parallel.cp > 1``) does not run with, named."""
    _require(model.attention_dropout == 0.0,
             f"model.attention_dropout = {model.attention_dropout} with parallel.cp = {cp}: the attention over keys "
             "gathered across cp has no dropout; set --model.attention-dropout 0")


def validate_data(data: DataConfig, model: ModelConfig) -> None:
    """One data source, and sequences the model is built for."""
    _positive(data.seq_length, "data.seq_length")
    per_split = data.train_path is not None or data.valid_path is not None or data.test_path is not None
    _require(not per_split or data.train_path is not None,
             "data.valid_path/data.test_path need data.train_path too (per-split paths replace data.path + data.split)")
    sources = [name for name, on in (("data.path", data.path is not None), ("data.train_path", per_split),
                                     ("data.text_file", data.text_file is not None), ("data.mock", data.mock)) if on]
    _require(len(sources) <= 1, f"{' and '.join(sources)} are both set; choose one data source")
    table = ("the learned position table" if model.position_embedding_type == "learned_absolute"
             else "the longest sequence the model is built for (generation's context too)")
    _require(data.seq_length <= model.max_position_embeddings,
             f"data.seq_length ({data.seq_length}) exceeds model.max_position_embeddings "
             f"({model.max_position_embeddings}), {table}; raise --model.max-position-embeddings to at least "
             f"{data.seq_length} or lower --data.seq-length (Megatron requires max_position_embeddings >= seq_length)")


def validate_optim(optim: OptimConfig) -> None:
    """AdamW's settings and the learning rates of every parameter group."""
    _require(optim.lr > 0 and 0 <= optim.min_lr <= optim.lr,
             f"need optim.lr > 0 and 0 <= optim.min_lr <= optim.lr, got lr={optim.lr}, min_lr={optim.min_lr}")
    _require(0 <= optim.adam_beta1 < 1 and 0 <= optim.adam_beta2 < 1,
             f"optim.adam_beta1/adam_beta2 must be in [0, 1), got {optim.adam_beta1}, {optim.adam_beta2}")
    _require(optim.clip_grad >= 0, f"optim.clip_grad must be >= 0 (0 disables clipping), got {optim.clip_grad}")
    _require(optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    _require(not (optim.override_opt_param_scheduler and optim.use_checkpoint_opt_param_scheduler),
             "optim.override_opt_param_scheduler and optim.use_checkpoint_opt_param_scheduler exclude each other: "
             "pick this run's schedule or the checkpoint's")
    if optim.decoupled_lr is not None or optim.decoupled_min_lr is not None:
        _require(optim.decoupled_lr is not None, "optim.decoupled_min_lr needs optim.decoupled_lr")
        low = optim.min_lr if optim.decoupled_min_lr is None else optim.decoupled_min_lr
        _require(optim.decoupled_lr > 0 and 0 <= low <= optim.decoupled_lr,
                 f"need optim.decoupled_lr > 0 and 0 <= decoupled_min_lr (or min_lr) <= decoupled_lr, got "
                 f"decoupled_lr={optim.decoupled_lr}, decoupled_min_lr={optim.decoupled_min_lr}, min_lr={optim.min_lr}")
    _require(optim.lr_mult > 0, f"optim.lr_mult must be positive, got {optim.lr_mult}")


def validate_log(log: LogConfig, world_size: int) -> None:
    """Intervals, timers, the profiler's steps and ranks, the MFU peak."""
    _positive(log.log_interval, "log.log_interval")
    _require(log.grad_underflow_interval is None or log.grad_underflow_interval > 0,
             f"log.grad_underflow_interval must be positive (or unset), got {log.grad_underflow_interval}")
    _require(log.timers in (0, 1, 2), f"log.timers must be 0, 1 or 2, got {log.timers}")
    if log.profile:
        _require(1 <= log.profile_step_start < log.profile_step_end,
                 f"log.profile_step_start ({log.profile_step_start}) must be at least 1 and below "
                 f"log.profile_step_end ({log.profile_step_end})")
        bad = [r for r in log.profile_ranks if not 0 <= r < world_size]
        _require(not bad, f"log.profile_ranks {list(log.profile_ranks)}: rank(s) {bad} do not exist in a world of "
                          f"{world_size} process(es); name ranks 0..{world_size - 1}")
    _require(log.peak_flops is None or log.peak_flops > 0, f"log.peak_flops must be positive, got {log.peak_flops}")


def validate_run(run: RunConfig) -> None:
    """Evaluation, exit conditions and the sample at the end."""
    _positive(run.eval_interval, "run.eval_interval")
    _require(run.eval_iters >= 0, f"run.eval_iters must be >= 0, got {run.eval_iters}")
    _require(run.exit_duration_in_mins is None or run.exit_duration_in_mins > 0,
             f"run.exit_duration_in_mins must be positive, got {run.exit_duration_in_mins}")
    _require(run.exit_interval is None or run.exit_interval > 0,
             f"run.exit_interval must be positive, got {run.exit_interval}")
    _require(run.sample_tokens >= 0, f"run.sample_tokens must be >= 0, got {run.sample_tokens}")


def validate_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int, planning: bool) -> None:
    """What the model and the layout (``parallel``'s sizes resolved) can run with: the settings the
    model does not build (accepted when ``planning``: ``lmfunc.plan`` plans them), context
    parallelism's limits, ``scan_layers`` on one process, a positive bucket size."""
    if not planning:
        missing = unbuildable_features(model)
        _require(not missing, f"{'; '.join(missing)}: not implemented in this version of lmfunc (python -m "
                              "lmfunc.plan plans such runs)")
    if parallel.cp > 1:
        validate_context_parallel(model, parallel.cp)
    _require(not model.scan_layers or world_size == 1,
             f"model.scan_layers runs on one process only (this run has {world_size}): torch's scan does "
             "not take the DTensor parameters of a parallel layout yet; turn it off (--model.no-scan-layers) "
             "for multi-process runs")
    _require(parallel.bucket_size_mb > 0, f"parallel.bucket_size_mb must be positive, got {parallel.bucket_size_mb}")


def validate_mesh(model: ModelConfig, parallel: ParallelConfig, seq_length: int, world_size: int) -> None:
    """The model split by the mesh's sizes."""
    check_divisibility(parallel.sizes(world_size), model, seq_length)
