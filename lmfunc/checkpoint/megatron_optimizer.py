"""Megatron-LM's Adam state: the moments and step count of a ``torch_dist`` training save, as lmfunc
trees, so a continued run takes the update Megatron's next step would.

Which of Megatron's optimizer formats are read:
- ``torch_dist`` saves of the plain optimizer, and of the distributed optimizer in its per-parameter
  formats: ``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``) and the
  older ``fully_sharded_model_space``. Each moment is stored whole under its parameter's key,
  ``optimizer.state.exp_avg.<key>`` and ``optimizer.state.exp_avg_sq.<key>``, with the fp32 master
  weights (mixed precision, or any distributed optimizer) as ``optimizer.state.fp32_param.<key>``
  (plain) or ``optimizer.state.param.<key>`` (distributed), and the step count in the common state
  (the plain optimizer's ``common_step``, the distributed one's param groups' ``step``). These are
  read, through the same layouts as the weights (``megatron_layout``: a moment is laid out as its
  parameter). megatron-core's own saves are tested on the CPU: the plain optimizer in fp32, fp16
  and bf16, the distributed one (``fully_reshardable``) in fp32 and bf16.
- The distributed optimizer's flattened formats (``dp_reshardable``, Megatron-LM's default, and the
  older ``dp_zero_gather_scatter`` and ``fully_sharded_bucket_space``: ``optimizer.distributed.*``,
  buffers in the data-parallel ranks' order) and the legacy format's pickled optimizer (integer
  parameter ids, per-rank shards): not read. A run from such a save starts with fresh moments, as
  Megatron's ``--no-load-optim``, and says which format it found and how to save a readable one.
The fp16 loss scaler's state (``grad_scaler`` in the optimizer's unsharded state: ``common.pt``, or
the legacy rank file, whose optimizer state is otherwise not read) is read too, in either format.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from lmfunc.checkpoint.megatron import checkpoint_format, iteration_dir, read_torch_dist_model, run_record, torch_dist_keys
from lmfunc.checkpoint.megatron_common import COMMON, read_common
from lmfunc.checkpoint.megatron_layout import from_megatron_layers
from lmfunc.config.model import ModelConfig
from lmfunc.tree import PyTree

MOMENTS = {"mu": "optimizer.state.exp_avg.", "nu": "optimizer.state.exp_avg_sq."}
"""lmfunc's Adam moment -> the key prefix of Megatron's in a ``torch_dist`` save."""
MASTER_WEIGHTS = ("optimizer.state.fp32_param.", "optimizer.state.param.")
"""The key prefixes of the fp32 master weights: the mixed-precision optimizer's, the distributed one's."""


@dataclasses.dataclass(frozen=True)
class MegatronAdam:
    """Megatron's Adam state, or why it was not read."""

    mu: Optional[PyTree]
    """First moments, full fp32 tensors in ``cfg``'s parameter tree (None when not read)."""
    nu: Optional[PyTree]
    """Second moments, likewise."""
    count: int
    """Adam steps taken (its bias correction's count)."""
    master_weights: Optional[PyTree]
    """The fp32 master weights of a mixed-precision run, which are the weights to continue from."""
    format: str
    """What the save holds: 'model-space moments', or the format that was not read and why."""

    @property
    def read(self) -> bool:
        return self.mu is not None


def _unread(what: str) -> MegatronAdam:
    return MegatronAdam(None, None, 0, None, what)


def _optimizer_states(common: dict) -> list[dict]:
    """The optimizer states in ``common.pt`` (or a legacy file's unsharded record): the one
    optimizer's, or each of a chain's (a list, or a dict by index)."""
    optimizer = common.get("optimizer")
    if isinstance(optimizer, dict) and not {"state", "optimizer", "param_groups"} & optimizer.keys():
        optimizer = list(optimizer.values())
    return [state for state in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]) if isinstance(state, dict)]


def _common_step(common: dict) -> Optional[int]:
    """Adam's step count in ``common.pt``'s optimizer state, of the one optimizer or the first of a
    chain that has one: the plain fp32 optimizer's ``common_step`` (``{"state": {"common_step": n},
    ...}``), the mixed-precision one's, one level down (``{"optimizer": {"state": {"common_step": n}},
    "grad_scaler": ..., ...}``), or the distributed optimizer's param groups' ``step``
    (``{"optimizer": {"param_groups": [{"step": n}, ...]}}``)."""
    for state in _optimizer_states(common):
        inner = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else state
        for level in (state, inner):
            counts = level.get("state")
            if isinstance(counts, dict) and "common_step" in counts:
                return int(counts["common_step"])
        groups = inner.get("param_groups") or []
        steps = {int(group["step"]) for group in groups if isinstance(group, dict) and group.get("step") is not None}
        if len(steps) == 1:
            return steps.pop()
    return None


class MegatronLossScale(NamedTuple):
    """Megatron's ``DynamicGradScaler`` state (its ``state_dict``)."""

    scale: float
    growth_tracker: int
    hysteresis_tracker: int


def read_megatron_loss_scale(path: str) -> Optional[MegatronLossScale]:
    """The dynamic loss scaler's state of the save ``path`` names (``iteration_dir``): the
    mixed-precision optimizer's ``grad_scaler`` (``{"scale": tensor([s]), "growth_tracker": n,
    "hysteresis_tracker": n}``), in ``common.pt`` or the legacy rank file, of the first optimizer of
    a chain that has one (a chain shares one scaler). None when there is none: a bf16 or fp32 run,
    or a constant scale (``--loss-scale``, whose state is empty)."""
    record, _ = run_record(iteration_dir(path))
    for state in _optimizer_states(record):
        scaler = state.get("grad_scaler")
        if isinstance(scaler, dict) and "scale" in scaler:
            return MegatronLossScale(float(torch.as_tensor(scaler["scale"]).reshape(-1)[0]),
                                     int(scaler["growth_tracker"]), int(scaler["hysteresis_tracker"]))
    return None


def _with_buffers(tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], zero: bool) -> dict[str, torch.Tensor]:
    """``tensors`` plus the routers' expert biases, which Megatron keeps as buffers with no optimizer
    state (lmfunc's are non-trainable leaves): zero moments (``zero``), else the weights' values."""
    buffers = {name: torch.zeros_like(t) if zero else t for name, t in weights.items() if name.endswith("router.expert_bias")}
    return {**buffers, **tensors}


def load_megatron_adam(path: str, cfg: ModelConfig) -> MegatronAdam:
    """Megatron's Adam moments and step count from the save ``path`` names (``iteration_dir``), in
    ``cfg``'s parameter tree, when the save holds them in a format lmfunc reads (module docstring);
    else a ``MegatronAdam`` whose ``format`` says what was found."""
    directory = iteration_dir(path)
    if checkpoint_format(directory) != "torch_dist":
        return _unread("the legacy format's pickled optimizer state (not read)")
    keys = torch_dist_keys(directory)
    if not any(key.startswith(MOMENTS["mu"]) for key in keys):
        if any(key.startswith("optimizer.distributed.") for key in keys):
            return _unread("the distributed optimizer's flattened buffers, optimizer.distributed.* (dp_reshardable, "
                           "Megatron-LM's default; not read: save with --dist-ckpt-optim-fully-reshardable to have "
                           "the moments read)")
        return _unread("no optimizer state")
    step = _common_step(read_common(directory))
    if step is None:
        return _unread(f"moments without a step count in {COMMON} (not read)")
    weights = read_torch_dist_model(directory) if cfg.moe_router_enable_expert_bias else {}  # the buffers' values
    source = f"{directory} (optimizer state)"
    mu, nu = (from_megatron_layers(_with_buffers(read_torch_dist_model(directory, prefix), weights, zero=True), cfg, source)
              for prefix in MOMENTS.values())
    master = None
    prefix = next((prefix for prefix in MASTER_WEIGHTS if any(key.startswith(prefix) for key in keys)), None)
    if prefix is not None:
        master = from_megatron_layers(_with_buffers(read_torch_dist_model(directory, prefix), weights, zero=False),
                                      cfg, source)
    return MegatronAdam(mu, nu, step, master, "model-space moments")
