"""Where a run's numbers go: the terminal (a tqdm bar and log lines), ``log.jsonl`` and TensorBoard."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional

from tqdm import tqdm

from lmfunc.config.model import ConfigError, ModelConfig
from lmfunc.config.train import TrainConfig
from lmfunc.model.gpt import param_shapes
from lmfunc.model.moe import moe_layer_names
from lmfunc.parallel.mesh import Layout
from lmfunc.train.state import TrainState
from lmfunc.tree import tree_size


def _tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "log.tensorboard needs the tensorboard package: pip install tensorboard "
            "(or pip install -e '.[tensorboard]'), or drop --log.tensorboard"
        ) from None
    return SummaryWriter


def _wandb_module():
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "log.wandb_project needs the wandb package: pip install wandb (or pip install -e '.[wandb]'), "
            "or drop --log.wandb-project"
        ) from None
    return wandb


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Weights & Biases logging (Megatron's --wandb-project, --wandb-exp-name, --wandb-save-dir)."""

    project: str
    name: Optional[str] = None
    save_dir: Optional[str] = None
    config: Optional[dict] = None
    """The run's resolved config, stored with the W&B run."""


class RunLogger:
    """Writes records to ``RUN_DIR/log.jsonl`` (one JSON object per line with ``kind`` and ``step``),
    mirrors numeric fields to TensorBoard and Weights & Biases as ``<kind>/<field>``, and owns the
    terminal output.

    The files are opened at the first record, so a run refused during setup writes nothing. W&B
    runs offline unless ``WANDB_MODE`` is set (``online`` to upload as the run goes)."""

    def __init__(self, run_dir: Optional[str], total_steps: int, progress_bar: bool = True, tensorboard: bool = False,
                 wandb: Optional[WandbSettings] = None):
        """``run_dir`` None makes a silent logger (the other ranks of a multi-process run)."""
        self.enabled = run_dir is not None
        self.path = os.path.join(run_dir, "log.jsonl") if run_dir is not None else ""
        self._bar: Optional[tqdm] = None
        self._tb, self._file, self._wandb_run = None, None, None
        if not self.enabled:
            return
        self._tb_dir = os.path.join(run_dir, "tensorboard")
        self._tb_class = _tensorboard_writer_class() if tensorboard else None
        self._wandb = wandb
        if wandb is not None:
            self._wandb_module = _wandb_module()
            self._wandb_dir = wandb.save_dir or os.path.join(run_dir, "wandb")
            self._wandb_name = wandb.name or os.path.basename(os.path.normpath(run_dir))
        if progress_bar:
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr)

    def echo(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def progress(self, step: int, **values: Any) -> None:
        """Advance the bar to ``step`` and show ``values`` beside it."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(values, refresh=False)

    def end_progress(self) -> None:
        """Close the progress bar; later lines print plainly."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def record(self, kind: str, step: int, **values: Any) -> None:
        """Append one JSONL record (and TensorBoard scalars for its numbers)."""
        if not self.enabled:
            return
        entry = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        if self._file is None:
            self._file = open(self.path, "a")
            self._tb = self._tb_class(self._tb_dir) if self._tb_class is not None else None
            self._wandb_run = self._start_wandb() if self._wandb is not None else None
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        scalars = {f"{kind}/{key}": value for key, value in values.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb_run is not None and scalars:
            self._wandb_run.log(scalars, step=step)

    def _start_wandb(self):
        os.makedirs(self._wandb_dir, exist_ok=True)
        return self._wandb_module.init(project=self._wandb.project, name=self._wandb_name, dir=self._wandb_dir,
                                       config=self._wandb.config, mode=os.environ.get("WANDB_MODE", "offline"))

    def close(self) -> None:
        self.end_progress()
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._file is not None:
            self._file.close()


def step_extras(metrics: dict, state: TrainState) -> dict[str, float]:
    """The MTP losses and the MoE routers' scalar metrics of the last step and the loss scaler's
    state, for the log line and record."""
    extra = {k: float(v) for k, v in metrics.items() if k.startswith("mtp_") or (k.startswith("moe_") and v.dim() == 0)}
    if state.loss_scale is not None:
        extra["loss_scale"] = float(state.loss_scale.scale)
        extra["skipped_steps"] = float(state.loss_scale.skipped_steps)
    return extra


def router_layer_values(metrics: dict, cfg: ModelConfig) -> dict[str, float]:
    """The MoE routers' per-layer metrics of the last step (``moe_layer_<metric>`` ``[L_moe]``) as
    ``moe_<metric>/<layer name>`` values for the record (not the console line)."""
    names = moe_layer_names(cfg)
    return {f"moe_{key[len('moe_layer_'):]}/{name}": float(value)
            for key, values in metrics.items() if key.startswith("moe_layer_")
            for name, value in zip(names, values.tolist())}


def train_line(step: int, train_iters: int, loss: float, grad_norm: float, lr: float, extra: dict[str, float],
               tokens_per_s: Optional[float], mfu: Optional[float], memory: dict[str, float]) -> str:
    """The console line of a log interval: the interval's mean loss, the last step's grad norm, lr
    and ``extra`` values, throughput and MFU, and the peak memory (CUDA's allocator, or RSS)."""
    return (f"step {step:>6d}/{train_iters} | loss {loss:.4f} | grad norm {grad_norm:.3f} | lr {lr:.3e} | "
            + "".join(f"{k.replace('_', ' ')} {v:.4g} | " for k, v in extra.items())
            + (f"{tokens_per_s:,.0f} tok/s | MFU {100 * mfu:.1f}%" if tokens_per_s else "tok/s - | MFU -")
            + (f" | mem {memory['cuda_peak_allocated']:.0f} MiB CUDA peak" if "cuda_peak_allocated" in memory
               else f" | mem {memory['peak_rss']:.0f} MiB peak RSS"))


def read_log(path: str) -> list[dict]:
    """The records of a ``log.jsonl`` file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_announcement(cfg: TrainConfig, layout: Layout, run_dir: Optional[str], processes: int, train_samples: int,
                     valid_samples: int, train_iters: int, flops_token: float, peak_flops: float, peak_source: str) -> str:
    """The lines a run prints before its first step: its directory, mesh, data, batch, model size,
    FLOPs per token and the MFU peak (``peak_flops`` over all ``processes``)."""
    data, seq = cfg.data, cfg.data.seq_length
    source = data.path or data.train_path or data.text_file or ("mock" if data.mock else "embedded corpus")
    return (
        f"run directory: {run_dir}\n"
        + (f"mesh: {dict(zip(layout.dims(), layout.mesh.mesh.shape))} over {processes} processes\n"
           if layout.mesh is not None else "")
        + f"data: {train_samples} train / {valid_samples} validation samples of {seq} tokens "
        f"({source}); {train_iters} steps of global batch {cfg.run.global_batch_size} "
        f"(micro batch {cfg.run.micro_batch_size} x data-parallel {layout.data_parallel_size}"
        + (f", ramp-up {cfg.run.rampup_batch_size}" if cfg.run.rampup_batch_size else "") + "); model"
        f" {tree_size(param_shapes(cfg.model)) / 1e6:.2f}M params, "
        f"{flops_token / 1e6:.2f} MFLOP/token; MFU peak {peak_flops / 1e9:.1f} GFLOP/s "
        f"({peak_source}" + (f", x {processes} processes" if processes > 1 else "") + f"); device {layout.device}"
    )
