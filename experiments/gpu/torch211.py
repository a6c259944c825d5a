"""Make a scratch copy of the repository that runs on torch 2.11, the torch of the lent GPU
machines' image (lmfunc pins 2.13; a CUDA build of 2.13 is too large to carry there).

``python -m experiments.gpu.torch211 DEST`` copies ``lmfunc/``, ``experiments/``, ``tests/`` and
``pyproject.toml`` to DEST and applies five edits to the copy, never to this checkout:

1. ``lmfunc.grad.value_and_grad`` differentiates through ``torch.func.grad_and_value`` while
   Dynamo traces it: torch 2.11's Dynamo refuses the ``requires_grad_()`` on fresh leaves that
   lmfunc's own version traces under 2.13. Eagerly it keeps lmfunc's ``torch.autograd.grad``.
   torch.func takes only tensors as aux, so the aux's other leaves (``None``) pass around it;
   it hides the DTensor API, so compiled runs of the copy are for plain tensors (one process).
   torch.func on 2.11 also refuses custom ops' autograd (``lmfunc::grouped_mm``), so a compiled
   dropless MoE step needs 2.13; eager MoE runs and compiled capacity-factor MoE work.
2. The post-grad pre-passes (recompute, slice copies, reversed scans) are chained in one pass object: 2.11's
   Inductor takes one callable where 2.13 takes a list.
3. ``gloo_reduce_scatter`` imports ``_resolve_group_name`` only where it exists (2.13 added it).
4. ``saved_values`` sizes a value with ``hint_int`` where ``optimization_hint`` (2.13) is missing;
   both give a size's hint, or the fallback for an unbacked one.
5. ``compiling`` leaves out the ``aot_inductor.enable_line_tables`` setting, which 2.11's Inductor
   lacks (it builds its CPU kernels with line tables; the kernels are the same).

Each edit must match exactly once, or the script stops and names the file: a changed source
needs this script updated, not a silently unpatched copy.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("lmfunc", "experiments", "tests", "pyproject.toml")

GRAD_OLD_START = "        inputs = [\n"
GRAD_OLD_END = "        grad_iter = iter(grads_wrt)\n"
GRAD_COMPILED = '''        if torch.compiler.is_compiling():
            aux_layout = {}

            def of_differentiable(wrt: list) -> tuple[Any, Any]:
                it = iter(wrt)
                new_args = list(args)
                new_args[argnum] = tree_unflatten_as(
                    args[argnum], [next(it) if diff else x for x, diff in zip(leaves, differentiable)])
                out = fn(*new_args, **kwargs)
                value, aux = out if has_aux else (out, None)
                aux_layout["leaves"], aux_layout["spec"] = torch.utils._pytree.tree_flatten(aux)
                return value, [x for x in aux_layout["leaves"] if isinstance(x, torch.Tensor)]

            wrt = [x for x, diff in zip(leaves, differentiable) if diff]
            grads_wrt, (value, aux_tensors) = torch.func.grad_and_value(of_differentiable, has_aux=True)(wrt)
            aux_iter = iter(aux_tensors)
            aux = torch.utils._pytree.tree_unflatten(
                [next(aux_iter) if isinstance(x, torch.Tensor) else x for x in aux_layout["leaves"]], aux_layout["spec"])
        else:
'''

PASSES_OLD = '    if bucket_size_mb is not None:\n        options["post_grad_custom_post_pass"]'
PASSES_NEW = '''    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Chained(CustomGraphPass):
        def __init__(self, passes):
            self.passes = passes

        def __call__(self, graph):
            for graph_pass in self.passes:
                graph_pass(graph)

        def uuid(self):
            return b"".join(graph_pass.uuid() for graph_pass in self.passes)

    options["post_grad_custom_pre_pass"] = Chained(options["post_grad_custom_pre_pass"])
''' + PASSES_OLD

BUCKETS_OLD = "from torch._inductor.fx_passes.bucketing import (\n    _resolve_group_name,\n"
BUCKETS_NEW = ("try:\n    from torch._inductor.fx_passes.bucketing import _resolve_group_name\n"
               "except ImportError:\n    _resolve_group_name = None\n"
               "from torch._inductor.fx_passes.bucketing import (\n")

HINT_OLD = "from torch.fx.experimental.symbolic_shapes import optimization_hint\n"
HINT_NEW = ("try:\n    from torch.fx.experimental.symbolic_shapes import optimization_hint\n"
            "except ImportError:\n    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint\n")

LINE_TABLES_OLD = ',\n                                           "aot_inductor.enable_line_tables": False}'
LINE_TABLES_NEW = "}"


def replace_once(path: Path, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``path``; stop with the file's name otherwise."""
    text = path.read_text()
    if text.count(old) != 1:
        sys.exit(f"torch211: expected exactly one match in {path}, found {text.count(old)}; "
                 "update experiments/gpu/torch211.py for the changed source")
    path.write_text(text.replace(old, new))


def patch_grad(path: Path) -> None:
    text = path.read_text()
    start, end = text.find(GRAD_OLD_START), text.find(GRAD_OLD_END)
    if text.count(GRAD_OLD_START) != 1 or text.count(GRAD_OLD_END) != 1 or end < start:
        sys.exit(f"torch211: value_and_grad's gradient lines not found in {path}; update experiments/gpu/torch211.py")
    eager = "".join("    " + line if line.strip() else line for line in text[start:end].splitlines(keepends=True))
    path.write_text(text[:start] + GRAD_COMPILED + eager + text[end:])


def make_copy(dest: Path) -> None:
    """Copy the repository's code to ``dest`` and apply the torch 2.11 edits. ``dest`` must be new,
    empty, or an earlier copy of this script's (which it replaces)."""
    if dest.resolve() == ROOT or ROOT in dest.resolve().parents:
        sys.exit(f"torch211: {dest} lies inside the checkout; give a scratch directory outside it")
    marker = dest / ".torch211-copy"
    if dest.exists() and any(dest.iterdir()) and not marker.exists():
        sys.exit(f"torch211: {dest} exists and was not made by this script; give an empty or new directory")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    marker.write_text("made by experiments/gpu/torch211.py; replaced on the next run\n")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "runs", "cache"))
        else:
            shutil.copy2(source, dest / name)
    patch_grad(dest / "lmfunc" / "grad.py")
    replace_once(dest / "lmfunc" / "compiler" / "compiling.py", PASSES_OLD, PASSES_NEW)
    replace_once(dest / "lmfunc" / "compiler" / "gloo_reduce_scatter.py", BUCKETS_OLD, BUCKETS_NEW)
    replace_once(dest / "lmfunc" / "compiler" / "saved_values.py", HINT_OLD, HINT_NEW)
    replace_once(dest / "lmfunc" / "compiler" / "compiling.py", LINE_TABLES_OLD, LINE_TABLES_NEW)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m experiments.gpu.torch211 DEST  (a scratch directory outside the checkout)")
    make_copy(Path(sys.argv[1]))
    print(f"torch211: patched copy in {sys.argv[1]}")
