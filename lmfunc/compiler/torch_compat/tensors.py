"""Private torch names the model, the optimizer, the pytrees and the train step use at run time."""

from __future__ import annotations

from lmfunc.compiler.torch_compat import Private, lazy_names

_FOREACH_WHY = "fused arithmetic over a tree's leaves (one kernel launch for many leaves)"
_FOREACH_PUBLIC = "none (torch.optim uses the same private ops)"

ENTRIES: dict[str, Private] = {
    "pytree": Private("torch.utils._pytree", "flatten, map and rebuild nested dicts, lists and registered "
                      "dataclasses as Dynamo traces them", "torch.utils.pytree (public from 2.12; its "
                      "flatten_with_path and register_dataclass came later)"),
    "register_dataclass": Private("torch.utils._pytree:register_dataclass", "TrainState, the loss-scale state "
                                  "and the optimizer states as pytree nodes", "torch.utils.pytree.register_dataclass"),
    "foreach_add": Private("torch:_foreach_add", _FOREACH_WHY, _FOREACH_PUBLIC),
    "foreach_sub": Private("torch:_foreach_sub", _FOREACH_WHY, _FOREACH_PUBLIC),
    "foreach_mul": Private("torch:_foreach_mul", _FOREACH_WHY, _FOREACH_PUBLIC),
    "foreach_div": Private("torch:_foreach_div", _FOREACH_WHY, _FOREACH_PUBLIC),
    "foreach_sqrt": Private("torch:_foreach_sqrt", _FOREACH_WHY, _FOREACH_PUBLIC),
    "foreach_norm": Private("torch:_foreach_norm", _FOREACH_WHY, _FOREACH_PUBLIC),
    "grouped_mm": Private("torch:_grouped_mm", "the dropless MoE's experts as one grouped matmul",
                          "torch.nn.functional.grouped_mm (2.14+)"),
    "scan": Private("torch._higher_order_ops.scan:scan", "scanned layers (ModelConfig.scan_layers): one traced "
                    "block for all layers", "none (torch.func has no scan)"),
    "is_fake": Private("torch._subclasses.fake_tensor:is_fake", "the step tells a dry run's fake tensors from "
                       "real ones", "none"),
    "OpOverload": Private("torch._ops:OpOverload", "graph passes and the dry run tell an ATen op's node from "
                          "others", "torch.ops.OpOverload is not exported; none"),
    "HigherOrderOperator": Private("torch._ops:HigherOrderOperator", "graph passes and the dry run tell scan, "
                                   "checkpoint and other higher-order nodes apart", "none"),
    "TorchDispatchMode": Private("torch.utils._python_dispatch:TorchDispatchMode", "the pipeline dry run "
                                 "records the ops each stage runs", "none"),
    "all_to_all_single": Private("torch.distributed._functional_collectives:all_to_all_single",
                                 "expert parallelism's counts exchange, traced into the step",
                                 "torch.distributed.tensor's collectives have no uneven all-to-all"),
    "all_to_all_single_autograd": Private("torch.distributed._functional_collectives:all_to_all_single_autograd",
                                          "expert parallelism's token exchange with its backward", "none"),
    "c10d_functional": Private("torch:ops._c10d_functional", "the functional collectives' operators that graph "
                               "passes match and emit", "none (these are the traced collectives' IR)"),
}

__getattr__ = lazy_names(__name__, ENTRIES)
