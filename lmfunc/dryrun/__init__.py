"""The dry run: one rank's real train step for a target world, traced on one CPU with fake tensors
and a fake process group, and what it would hold, send and compute (``python -m lmfunc.dryrun``);
with pipeline parallelism, the first, a middle and the last pipeline rank's step, run on fake
tensors with their compiled stages captured (``lmfunc.dryrun.pipeline``)."""

from lmfunc.dryrun.capture import CapturedStep, trace, trace_rank
from lmfunc.dryrun.extrapolate import dry_run_facts
from lmfunc.dryrun.graph_report import StepFacts, collectives, flops, memory, step_facts
from lmfunc.dryrun.pipeline import trace_pipeline_rank
from lmfunc.dryrun.report import Hardware, RoleReport, hardware, role_report

__all__ = ["CapturedStep", "Hardware", "RoleReport", "StepFacts", "collectives", "dry_run_facts", "flops", "hardware",
           "memory", "role_report", "step_facts", "trace", "trace_pipeline_rank", "trace_rank"]
