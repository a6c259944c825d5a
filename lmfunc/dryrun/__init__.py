"""The dry run: one rank's real train step for a target world, traced on one CPU with fake tensors
and a fake process group, and what it would hold, send and compute (``python -m lmfunc.dryrun``)."""

from lmfunc.dryrun.capture import CapturedStep, trace, trace_rank
from lmfunc.dryrun.graph_report import collectives, flops, memory
from lmfunc.dryrun.report import Hardware, RoleReport, hardware, role_report

__all__ = ["CapturedStep", "Hardware", "RoleReport", "collectives", "flops", "hardware", "memory", "role_report",
           "trace", "trace_rank"]
