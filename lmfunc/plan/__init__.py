"""Plans of a run before it starts: Megatron-LM's theoretical memory and FLOPs
(``lmfunc.plan.megatron``), lmfunc's own per-rank memory prediction (``lmfunc.plan.memory``),
and the printout of ``python -m lmfunc.plan`` (``lmfunc.plan.report``)."""

from lmfunc.plan.megatron import MegatronArgs, megatron_report, num_floating_point_operations
from lmfunc.plan.memory import MemoryPlan, predict_memory
from lmfunc.plan.report import Plan, format_plan, make_plan

__all__ = ["MegatronArgs", "MemoryPlan", "Plan", "format_plan", "make_plan", "megatron_report",
           "num_floating_point_operations", "predict_memory"]
