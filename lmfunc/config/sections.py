"""The sections of a ``TrainConfig`` besides the model and the parallel layout: ``data`` (where
tokens come from), ``optim`` (AdamW and the lr schedule), ``precision``, ``checkpoint``, ``log`` and
``run`` (batch sizes, length, evaluation, seeds, output directory); and ``schedule_lengths``, the
one place the lr schedule's warmup and decay lengths are resolved. Field names follow Megatron-LM's
arguments; the field docstrings are the ``--help`` text of ``python -m lmfunc.train``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Optional

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
    tf32: bool = False
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores: inputs rounded to a 10-bit
    mantissa (about 1e-3 relative error per product, fp32 range and accumulation), several times
    faster. Only fp32 compute is affected; bf16/fp16 matmuls never use TF32. Off by default, as in
    PyTorch."""
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
    """Start from Hugging Face Llama (or, for an MoE model, Qwen3-MoE) weights in this directory
    (config.json + *.safetensors)."""
    load_megatron: Optional[str] = None
    """Start from a Megatron-LM checkpoint: a save directory (Megatron's --save; its newest save)
    or one iter_NNNNNNN/, torch_dist or legacy format, any TP/PP layout. The model settings must
    match those stored in it (the error lists the flags to pass). A training save also continues
    Megatron's run at its iteration, consumed samples and lr (fresh Adam moments); with
    checkpoint.finetune only the weights are taken."""
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
    grad_underflow_interval: Optional[int] = None
    """With bf16/fp16: at the first step and every this many steps, record in log.jsonl (kind
    'underflow') the fraction of gradient elements, per parameter group, that are exactly zero in
    the scaled low-precision gradients but not in fp32 (two extra eager passes of one microbatch)."""
    wandb_project: Optional[str] = None
    """Also log to Weights & Biases under this project (needs the wandb package: pip install -e
    '.[wandb]'). Offline unless WANDB_MODE says otherwise, so machines without internet work; sync
    later with `wandb sync`. Only rank 0 logs."""
    wandb_exp_name: Optional[str] = None
    """The W&B run name; None uses the run directory's name."""
    wandb_save_dir: Optional[str] = None
    """Where W&B writes its files; None means RUN_DIR/wandb."""
    timers: int = 1
    """Per-phase timers at each log interval (log.jsonl kind 'timers', the console, TensorBoard), as
    max/min over ranks with the slowest rank (Megatron's --timing-log-level): 0 off; 1 data wait,
    step, evaluation, checkpoint save (blocking part) and logging; 2 also the step's host and
    device parts."""
    profile: bool = False
    """Run the PyTorch profiler over steps profile_step_start <= step < profile_step_end and write a
    Chrome trace per profiled rank to RUN_DIR/profile (Megatron's --profile)."""
    profile_step_start: int = 10
    """First profiled step (Megatron's --profile-step-start)."""
    profile_step_end: int = 12
    """The step after the last profiled one (Megatron's --profile-step-end)."""
    profile_ranks: tuple[int, ...] = (0,)
    """Global ranks that profile (Megatron's --profile-ranks)."""
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
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where params, optimizer state, batches and the step run: 'cuda' (GPU LOCAL_RANK of a torchrun
    launch, NCCL between processes), 'cpu' (gloo), or 'auto' (cuda when a GPU is visible)."""
    compile: bool = True
    """Compile the train and eval steps with torch.compile."""
    precompile: bool = True
    """With compile on one process: save each compiled step whole (torch's precompile) beside
    Inductor's cache, and load it in a restarted or resumed job instead of tracing it again
    (``lmfunc.compiler.precompiled_step``). A distributed job compiles the ordinary way."""
    sample_prompt: str = "The "
    """Prompt of the text sample printed at the end of training."""
    sample_tokens: int = 200
    """Tokens generated for the end-of-run sample; 0 skips it."""
    calculate_per_token_loss: bool = True
    """Divide the whole batch's summed token loss once by its token count (Megatron's
    --calculate-per-token-loss); False averages per-microbatch means (Megatron's default)."""
    keep_host_memory: bool = True
    """Keep freed host memory in the process for the next step (glibc: no mmap for large blocks, no
    trimming; ``lmfunc.train.host_memory``) instead of faulting fresh pages in on every step for
    each block of 32 MiB or more. The process's RSS then stays at its peak. False keeps glibc's
    defaults."""


class ScheduleLengths(NamedTuple):
    """The lr schedule's lengths, resolved: in iterations (``unit == "iters"``) or, for a
    sample-based run, in samples."""

    unit: str
    warmup: int
    decay: int
    wsd_decay: Optional[int]


def schedule_lengths(run: RunConfig, optim: OptimConfig) -> ScheduleLengths:
    """Warmup, decay and WSD-decay lengths of the run's lr schedule: ``optim.lr_decay_iters`` (or
    ``run.train_iters``) for an iteration-based run, the ``*_samples`` fields (or
    ``run.train_samples``) for a sample-based one; ``optim.lr_warmup_fraction``, when set, replaces
    the warmup by that fraction of the decay (Megatron's rule)."""
    if run.train_iters is not None:
        unit, decay, warmup, wsd = "iters", optim.lr_decay_iters or run.train_iters, optim.lr_warmup_iters, optim.lr_wsd_decay_iters
    else:
        unit, decay, warmup, wsd = ("samples", optim.lr_decay_samples or run.train_samples, optim.lr_warmup_samples,
                                    optim.lr_wsd_decay_samples)
    if optim.lr_warmup_fraction is not None:
        warmup = int(optim.lr_warmup_fraction * decay)
    return ScheduleLengths(unit, warmup, decay, wsd)
