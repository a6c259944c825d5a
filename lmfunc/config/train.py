"""``TrainConfig``: one frozen dataclass tree describing a whole training run.

Sections: ``model`` (the network), ``data`` (where tokens come from), ``optim`` (AdamW and the
lr schedule), ``precision``, ``parallel``, ``checkpoint``, ``log`` and ``run`` (batch sizes,
length, evaluation, seeds, output directory). Field names follow Megatron-LM's arguments; the
field docstrings are the ``--help`` text of ``python -m lmfunc.train``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.config.parallel import ParallelConfig, check_divisibility
from lmfunc.optim.schedules import DecayStyle, WSDDecayStyle

if TYPE_CHECKING:
    from lmfunc.precision import LossScaleConfig


@dataclass(frozen=True)
class DataConfig:
    """Training text, its split into train/validation/test documents, and how samples are masked."""

    path: Optional[str] = None
    """Megatron .bin/.idx data: 'PREFIX', 'PREFIX_A PREFIX_B' or a blend 'W_A PREFIX_A W_B PREFIX_B'."""
    train_path: Optional[str] = None
    """Data of the train split only (blend syntax); replaces data.path + data.split for that split."""
    valid_path: Optional[str] = None
    """Data of the validation split only (blend syntax)."""
    test_path: Optional[str] = None
    """Data of the test split only (blend syntax)."""
    text_file: Optional[str] = None
    """A UTF-8 text file to train on (its paragraphs, separated by blank lines, are the documents).
    With neither data.path nor data.text_file the run trains on the embedded corpus: the Python
    reference topics that ship with every Python installation (``pydoc_data``)."""
    mock: bool = False
    """Train on Megatron's synthetic mock documents. As in Megatron (``--mock-data``), the split is
    then always "1,1,1" (data.split is not used), so samples match Megatron's."""
    tokenizer: str = "byte"
    """'byte' (no files) or the path of a Hugging Face tokenizer.json."""
    split: str = "90,10,0"
    """Train/validation/test weights over the sequences of each dataset, Megatron's ``--split``."""
    cache_dir: Optional[str] = None
    """Where tokenised text and dataset indices are cached; None means RUN.OUT_DIR/cache."""
    seq_length: int = 256
    """Tokens per training sequence."""
    seed: Optional[int] = None
    """Seed of the dataset indices (document and sample shuffles); None uses run.seed."""
    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool = False
    """Block attention across documents inside a sequence."""
    eod_mask_loss: bool = False
    """Do not train on predictions whose input token is end-of-document."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with Megatron's learning-rate schedule (warmup, then decay)."""

    lr: float = 2e-3
    """Peak learning rate."""
    min_lr: float = 2e-4
    """Learning rate at the end of the decay."""
    lr_decay_style: DecayStyle = "cosine"
    """Decay after warmup: constant, linear, cosine, inverse-square-root or WSD."""
    lr_warmup_iters: int = 20
    """Warmup length in iterations (iteration-based runs)."""
    lr_warmup_samples: int = 0
    """Warmup length in samples (sample-based runs, with run.train_samples)."""
    lr_warmup_fraction: Optional[float] = None
    """Warmup as a fraction of the decay length; overrides lr_warmup_iters/samples."""
    lr_warmup_init: float = 0.0
    """Learning rate at the start of the warmup."""
    lr_decay_iters: Optional[int] = None
    """Iterations until min_lr; None means run.train_iters."""
    lr_decay_samples: Optional[int] = None
    """Samples until min_lr (sample-based runs); None means run.train_samples."""
    lr_wsd_decay_style: WSDDecayStyle = "exponential"
    """Annealing shape of the WSD schedule's final phase."""
    lr_wsd_decay_iters: Optional[int] = None
    """Length of the WSD annealing phase in iterations."""
    lr_wsd_decay_samples: Optional[int] = None
    """Length of the WSD annealing phase in samples (sample-based runs)."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (norm scales and biases are exempt)."""
    embedding_weight_decay: bool = True
    """Decay the embeddings and the output layer too (False exempts them)."""
    decoupled_lr: Optional[float] = None
    """Peak lr of the token embedding and the output layer (Megatron's --decoupled-lr); None uses optim.lr."""
    decoupled_min_lr: Optional[float] = None
    """Final lr of the decoupled group; None uses optim.min_lr."""
    override_opt_param_scheduler: bool = False
    """On resume, use this run's learning-rate and weight-decay settings although the checkpoint's
    differ (Megatron's --override-opt_param-scheduler)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, use the checkpoint's learning-rate and weight-decay settings instead of this run's
    (Megatron's --use-checkpoint-opt_param-scheduler)."""
    scale_lr_patterns: tuple[str, ...] = ()
    """Dotted parameter names (shell patterns, e.g. '*.mlp.*') whose lr is multiplied by optim.lr_mult."""
    lr_mult: float = 1.0
    """Learning-rate multiplier of the parameters matching optim.scale_lr_patterns."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.95
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""


@dataclass(frozen=True)
class PrecisionConfig:
    """Numerics: fp32 master weights and optimizer state; the compute dtype; loss scaling (Megatron's)."""

    compute_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Dtype of the forward and backward matmuls; norms, softmax, logits' loss and gradients stay fp32."""
    loss_scale: Optional[float] = None
    """A static loss scale; None means dynamic scaling with fp16 and none otherwise."""
    initial_loss_scale: float = 2.0**32
    """Starting scale of dynamic loss scaling."""
    min_loss_scale: float = 1.0
    """The dynamic scale never backs off below this."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves."""
    check_for_nan_in_loss: bool = True
    """Stop with an error naming the step when the training loss is NaN or infinite."""

    def loss_scaling(self) -> Optional["LossScaleConfig"]:
        """The loss scaler these settings ask for: static, dynamic (fp16) or None."""
        from lmfunc.precision import LossScaleConfig

        if self.loss_scale is not None:
            return LossScaleConfig(dynamic=False, initial_scale=self.loss_scale, min_scale=min(1.0, self.loss_scale))
        if self.compute_dtype != "fp16":
            return None
        return LossScaleConfig(initial_scale=self.initial_loss_scale, min_scale=self.min_loss_scale,
                               growth_interval=self.loss_scale_window, hysteresis=self.hysteresis)


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded training checkpoints (torch.distributed.checkpoint), resuming and weight import/export."""

    save: bool = True
    """Write training checkpoints to checkpoint.save_dir every save_interval steps and when the run
    stops (end of training, SIGTERM/SIGINT, run.exit_interval, run.exit_duration_in_mins)."""
    save_dir: Optional[str] = None
    """Directory of the iter_NNNNNNN/ checkpoints; None means RUN_DIR/checkpoints."""
    save_interval: Optional[int] = 100
    """Save every this many steps; None saves only when the run stops."""
    keep: Optional[int] = 2
    """Keep the newest this many checkpoints (older ones are deleted); None keeps all."""
    async_save: bool = True
    """Write checkpoints on a background thread while training goes on (one save in flight)."""
    resume: bool = True
    """Resume from the newest complete checkpoint in checkpoint.load (or save_dir) when there is one."""
    load: Optional[str] = None
    """Directory to resume from (Megatron's --load); None means checkpoint.save_dir."""
    load_step: Optional[int] = None
    """Load this step instead of the newest (Megatron's --ckpt-step)."""
    finetune: bool = False
    """Load only the weights from the checkpoint; start at step 0 with a fresh optimizer."""
    load_hf: Optional[str] = None
    """Start from Hugging Face Llama weights in this directory (config.json + *.safetensors)."""
    exit_signal_handler: bool = True
    """On SIGTERM or SIGINT every rank finishes the current step, saves a checkpoint and exits 0."""
    save_weights: bool = True
    """Write the final parameters to RUN_DIR/model.safetensors (read by ``python -m lmfunc.generate``)."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """When a checkpoint save fails mid-run (a full disk, a lost mount): stop at once, or keep
    training and try again at the next save. A run whose last save failed still writes its final
    weights (to a temporary folder if RUN_DIR cannot take them; the path is printed) and exits 1."""


@dataclass(frozen=True)
class LogConfig:
    """Terminal, JSONL and TensorBoard logging."""

    log_interval: int = 10
    """Print a log line (and a JSONL record) every this many iterations."""
    progress_bar: bool = True
    """Show a tqdm progress bar."""
    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard (needs the tensorboard package)."""
    peak_flops: Optional[float] = None
    """Peak FLOP/s of one process's device for MFU (multiplied by the process count); None measures an fp32 matmul peak at start."""


@dataclass(frozen=True)
class RunConfig:
    """Batch sizes, training length, evaluation, seeds and the output directory."""

    micro_batch_size: int = 8
    """Sequences per microbatch (per data-parallel rank)."""
    global_batch_size: Optional[int] = None
    """Sequences per optimizer step; microbatches = global / (micro x data-parallel size). None (the
    default) means micro_batch_size x data-parallel size, Megatron's rule."""
    rampup_batch_size: Optional[tuple[int, int, int]] = None
    """Megatron's ramp-up: START INCREMENT SAMPLES. The global batch grows from START by INCREMENT
    over SAMPLES samples (needs run.train_samples)."""
    train_iters: Optional[int] = 300
    """Optimizer steps to train (iteration-based runs)."""
    train_samples: Optional[int] = None
    """Sequences to train on (sample-based runs; set run.train_iters to None)."""
    exit_duration_in_mins: Optional[float] = None
    """Stop after this many minutes of training (saving a checkpoint first)."""
    exit_interval: Optional[int] = None
    """Stop (saving a checkpoint first) at the first step that is a multiple of this."""
    eval_interval: int = 100
    """Evaluate on the validation split every this many iterations (and at the end)."""
    eval_iters: int = 4
    """Validation batches (of global_batch_size sequences) per evaluation; 0 disables evaluation."""
    seed: int = 1234
    """Seed of the parameter init, the data order (unless data.seed) and dropout."""
    out_dir: str = "runs"
    """Directory that holds one sub-directory per run."""
    name: Optional[str] = None
    """Run directory name inside out_dir; None uses a timestamp."""
    compile: bool = True
    """Compile the train and eval steps with torch.compile."""
    sample_prompt: str = "The "
    """Prompt of the text sample printed at the end of training."""
    sample_tokens: int = 200
    """Tokens generated for the end-of-run sample; 0 skips it."""
    calculate_per_token_loss: bool = True
    """Divide the whole batch's summed token loss once by its token count (Megatron's
    --calculate-per-token-loss); False averages per-microbatch means (Megatron's default)."""


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self, world_size: int = 1) -> "TrainConfig":
        """Raise ``ConfigError`` naming the fields and the fix when settings contradict (the parallel
        sizes checked against ``world_size`` processes); return the config with an unset
        ``run.global_batch_size`` resolved (``resolve_global_batch_size``)."""
        dp = self.parallel.data_parallel_size(world_size) if _valid_mesh(self, world_size) else 1
        cfg = self.replace(run=dataclasses.replace(self.run, global_batch_size=resolve_global_batch_size(self.run, dp)))
        validate_train(cfg, world_size)
        return cfg

    def replace(self, **sections: object) -> "TrainConfig":
        return dataclasses.replace(self, **sections)


def resolve_global_batch_size(run: RunConfig, data_parallel_size: int) -> int:
    """``run.global_batch_size``, or when unset ``micro_batch_size x data_parallel_size`` (one
    microbatch per step, Megatron's default)."""
    if run.global_batch_size is not None:
        return run.global_batch_size
    return run.micro_batch_size * data_parallel_size if isinstance(run.micro_batch_size, int) else run.micro_batch_size


def _valid_mesh(cfg: "TrainConfig", world_size: int) -> bool:
    try:
        cfg.parallel.data_parallel_size(world_size)
    except ConfigError:
        return False
    return True


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(value: object, name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             f"{name} must be a positive integer, got {value!r}")


def _validate_batch(run: RunConfig, dp: int) -> None:
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


def _validate_length(cfg: TrainConfig) -> None:
    run, optim = cfg.run, cfg.optim
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
        unit, total, warmup = "iters", optim.lr_decay_iters or run.train_iters, optim.lr_warmup_iters
    else:
        _positive(run.train_samples, "run.train_samples")
        for name in ("lr_decay_iters", "lr_wsd_decay_iters"):
            _require(getattr(optim, name) is None,
                     f"optim.{name} is for iteration-based runs; this run sets run.train_samples, so use "
                     f"optim.{name.replace('iters', 'samples')}")
        unit, total, warmup = "samples", optim.lr_decay_samples or run.train_samples, optim.lr_warmup_samples
        _require(optim.lr_warmup_iters == 0 or optim.lr_warmup_fraction is not None,
                 f"optim.lr_warmup_iters ({optim.lr_warmup_iters}) is for iteration-based runs; this run sets "
                 "run.train_samples, so set optim.lr_warmup_iters to 0 and use optim.lr_warmup_samples")
    if optim.lr_warmup_fraction is not None:
        _require(0.0 <= optim.lr_warmup_fraction <= 1.0,
                 f"optim.lr_warmup_fraction must be in [0, 1], got {optim.lr_warmup_fraction}")
        warmup = int(optim.lr_warmup_fraction * total)
    length = "run.train_iters" if unit == "iters" else "run.train_samples"
    _require(0 <= warmup <= total,
             f"optim.lr_warmup_{unit} ({warmup}) is longer than the decay (optim.lr_decay_{unit} or {length} = "
             f"{total}); shorten the warmup or train longer")
    if optim.lr_decay_style == "WSD":
        wsd = optim.lr_wsd_decay_iters if unit == "iters" else optim.lr_wsd_decay_samples
        _require(wsd is not None and 0 < wsd <= total,
                 f"optim.lr_decay_style WSD needs 0 < optim.lr_wsd_decay_{unit} <= {total}, got {wsd}")


def _validate_precision(precision: PrecisionConfig) -> None:
    _require(precision.compute_dtype in ("fp32", "bf16", "fp16"),
             f"precision.compute_dtype must be fp32, bf16 or fp16, got {precision.compute_dtype!r}")
    _require(precision.loss_scale is None or precision.loss_scale > 0,
             f"precision.loss_scale must be positive (or unset for dynamic scaling), got {precision.loss_scale}")
    _require(precision.initial_loss_scale > 0 and 0 < precision.min_loss_scale <= precision.initial_loss_scale,
             f"need 0 < precision.min_loss_scale <= precision.initial_loss_scale, got "
             f"{precision.min_loss_scale} and {precision.initial_loss_scale}")
    _positive(precision.loss_scale_window, "precision.loss_scale_window")
    _positive(precision.hysteresis, "precision.hysteresis")


def _validate_checkpoint(ck: CheckpointConfig) -> None:
    _require(ck.save_interval is None or ck.save_interval > 0,
             f"checkpoint.save_interval must be positive (or None to save only when the run stops), got {ck.save_interval}")
    _require(ck.keep is None or ck.keep > 0, f"checkpoint.keep must be positive (or None to keep all), got {ck.keep}")
    _require(ck.load_step is None or ck.load_step >= 0, f"checkpoint.load_step must be >= 0, got {ck.load_step}")
    _require(ck.load_hf is None or (ck.load is None and ck.load_step is None),
             "checkpoint.load_hf starts from imported weights; it cannot be combined with checkpoint.load or "
             "checkpoint.load_step")
    _require(not ck.finetune or ck.load is not None or ck.load_step is not None,
             "checkpoint.finetune loads weights from an earlier run: set checkpoint.load to its checkpoint directory")


def validate_train(cfg: TrainConfig, world_size: int = 1) -> None:
    """Cross-field checks of a ``TrainConfig`` run on ``world_size`` processes (each section's own
    fields are checked too)."""
    run, data, optim, log = cfg.run, cfg.data, cfg.optim, cfg.log
    for name in ("pp", "cp", "ep"):
        value = getattr(cfg.parallel, name)
        _require(value == 1, f"parallel.{name} = {value}: {name} parallelism is not implemented in this version of "
                             "lmfunc; set it to 1 (dp_replicate, dp_shard and tp are)")
    _validate_batch(run, cfg.parallel.data_parallel_size(world_size))
    _validate_length(cfg)
    _positive(data.seq_length, "data.seq_length")
    per_split = data.train_path is not None or data.valid_path is not None or data.test_path is not None
    _require(not per_split or data.train_path is not None,
             "data.valid_path/data.test_path need data.train_path too (per-split paths replace data.path + data.split)")
    sources = [name for name, on in (("data.path", data.path is not None), ("data.train_path", per_split),
                                     ("data.text_file", data.text_file is not None), ("data.mock", data.mock)) if on]
    _require(len(sources) <= 1, f"{' and '.join(sources)} are both set; choose one data source")
    table = ("the learned position table" if cfg.model.position_embedding_type == "learned_absolute"
             else "the longest sequence the model is built for (generation's context too)")
    _require(data.seq_length <= cfg.model.max_position_embeddings,
             f"data.seq_length ({data.seq_length}) exceeds model.max_position_embeddings "
             f"({cfg.model.max_position_embeddings}), {table}; raise --model.max-position-embeddings to at least "
             f"{data.seq_length} or lower --data.seq-length (Megatron requires max_position_embeddings >= seq_length)")
    _require(optim.lr > 0 and 0 <= optim.min_lr <= optim.lr,
             f"need optim.lr > 0 and 0 <= optim.min_lr <= optim.lr, got lr={optim.lr}, min_lr={optim.min_lr}")
    _require(0 <= optim.adam_beta1 < 1 and 0 <= optim.adam_beta2 < 1,
             f"optim.adam_beta1/adam_beta2 must be in [0, 1), got {optim.adam_beta1}, {optim.adam_beta2}")
    _require(optim.clip_grad >= 0, f"optim.clip_grad must be >= 0 (0 disables clipping), got {optim.clip_grad}")
    _require(optim.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    _require(not (optim.override_opt_param_scheduler and optim.use_checkpoint_opt_param_scheduler),
             "optim.override_opt_param_scheduler and optim.use_checkpoint_opt_param_scheduler exclude each other: "
             "pick this run's schedule or the checkpoint's")
    _positive(log.log_interval, "log.log_interval")
    _require(log.peak_flops is None or log.peak_flops > 0, f"log.peak_flops must be positive, got {log.peak_flops}")
    _positive(run.eval_interval, "run.eval_interval")
    _require(run.eval_iters >= 0, f"run.eval_iters must be >= 0, got {run.eval_iters}")
    _require(run.exit_duration_in_mins is None or run.exit_duration_in_mins > 0,
             f"run.exit_duration_in_mins must be positive, got {run.exit_duration_in_mins}")
    _require(run.exit_interval is None or run.exit_interval > 0,
             f"run.exit_interval must be positive, got {run.exit_interval}")
    _validate_checkpoint(cfg.checkpoint)
    _require(run.sample_tokens >= 0, f"run.sample_tokens must be >= 0, got {run.sample_tokens}")
    _validate_precision(cfg.precision)
    if optim.decoupled_lr is not None or optim.decoupled_min_lr is not None:
        _require(optim.decoupled_lr is not None, "optim.decoupled_min_lr needs optim.decoupled_lr")
        low = optim.min_lr if optim.decoupled_min_lr is None else optim.decoupled_min_lr
        _require(optim.decoupled_lr > 0 and 0 <= low <= optim.decoupled_lr,
                 f"need optim.decoupled_lr > 0 and 0 <= decoupled_min_lr (or min_lr) <= decoupled_lr, got "
                 f"decoupled_lr={optim.decoupled_lr}, decoupled_min_lr={optim.decoupled_min_lr}, min_lr={optim.min_lr}")
    _require(optim.lr_mult > 0, f"optim.lr_mult must be positive, got {optim.lr_mult}")
    sizes = cfg.parallel.sizes(world_size)
    check_divisibility(sizes, cfg.model, data.seq_length)
    mesh_dims = [name for name, size in sizes.items() if size > 1]
    _require(not (run.compile and cfg.model.mtp_num_layers and len(mesh_dims) > 1),
             f"model.mtp_num_layers > 0 on a {len(mesh_dims)}-D mesh ({' x '.join(mesh_dims)}) does not compile with "
             "torch 2.13 (Dynamo: PendingUnbackedSymbolNotFound); use a 1-D layout or --run.no-compile")
