"""lmfunc.compiler.torch_compat is the one place lmfunc uses torch's private API: no other module
of lmfunc names a private torch module or attribute, torch_compat imports nothing else of lmfunc,
and every entry it lists resolves on the installed torch (so a torch release that moved one fails
here, by name, not somewhere inside a compile)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

from lmfunc.compiler import torch_compat

LMFUNC = Path(__file__).resolve().parents[1] / "lmfunc"
COMPAT = LMFUNC / "compiler" / "torch_compat"
SUBMODULES = ("tensors", "tracing", "inductor", "scheduling", "distributed")
ATEN_OPS = ("torch.ops.aten.", "torch.ops.prims.")
"""ATen's and prims' operator names (``torch.ops.aten._unsafe_view``) are the graph IR that passes
match, not Python API: allowed anywhere."""
PRIVATE_PATH = re.compile(r"^torch(\.\w+)*\._[A-Za-z]\w*(\.\w+)*$")


def _is_private(dotted: str) -> bool:
    if not (dotted == "torch" or dotted.startswith("torch.")) or dotted.startswith(ATEN_OPS):
        return False
    return any(part.startswith("_") and not part.endswith("__") for part in dotted.split(".")[1:])


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each use of a private torch module or attribute in ``source``: an import of
    one, a dotted name through one (``torch._inductor.config``), or a string that is such a module
    path (what ``importlib.import_module`` takes)."""
    uses: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [name for name in [_dotted(node)] if name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and PRIVATE_PATH.match(node.value):
            names = [node.value]
        uses += [(node.lineno, name) for name in names if _is_private(name)]
    return sorted(set(uses))


def test_the_scanner_finds_each_kind_of_private_use():
    source = ("import torch._dynamo\nfrom torch.utils import _pytree as pytree\nfrom torch._ops import OpOverload\n"
              "x = torch._foreach_add(a, b)\ny = torch.ops._c10d_functional.wait_tensor\n"
              "importlib.import_module('torch._inductor.codecache')\n"
              "ok = torch.ops.aten._unsafe_view.default\nfine = torch.nn.functional.relu\ndoc = 'see torch._inductor docs'\n")
    lines = sorted({line for line, _ in private_torch_uses(source)})
    assert lines == [1, 2, 3, 4, 5, 6]


def test_no_private_torch_use_outside_torch_compat():
    found = []
    for path in sorted(LMFUNC.rglob("*.py")):
        if COMPAT in path.parents:
            continue
        found += [f"{path.relative_to(LMFUNC.parent)}:{line}: {name}" for line, name in private_torch_uses(path.read_text())]
    assert not found, ("private torch API used outside lmfunc/compiler/torch_compat (add an entry there and "
                       "import it from there):\n" + "\n".join(found))


def test_torch_compat_imports_nothing_else_of_lmfunc():
    for path in sorted(COMPAT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in modules:
                assert not module.startswith("lmfunc") or module.startswith("lmfunc.compiler.torch_compat"), (
                    f"{path.name} imports {module}: torch_compat must import nothing else of lmfunc")


@pytest.mark.parametrize("submodule", SUBMODULES)
def test_every_entry_resolves_on_this_torch_and_says_why(submodule):
    module = importlib.import_module(f"lmfunc.compiler.torch_compat.{submodule}")
    assert module.ENTRIES
    for name, entry in module.ENTRIES.items():
        assert entry.why.strip() and entry.public.strip(), f"{submodule}.{name}: say why and what would replace it"
        assert _is_private(entry.path.replace(":", ".")), f"{submodule}.{name}: {entry.path} is public API"
        if torch_compat.torch_at_least(*entry.since):
            assert getattr(module, name) is torch_compat.resolve(entry.path)
        else:
            with pytest.raises(ImportError, match=f"needs torch >= {entry.since[0]}.{entry.since[1]}"):
                getattr(module, name)


def test_a_missing_entry_is_an_import_error_that_names_it():
    getter = torch_compat.lazy_names("somewhere", {"gone": torch_compat.Private("torch._no_such_module", "a test",
                                                                                "none")})
    with pytest.raises(ImportError, match=r"has no torch\._no_such_module \(somewhere\.gone: a test\)"):
        getter("gone")


def test_a_too_old_torch_is_refused_in_one_line_that_names_the_torch_that_can():
    major, minor = torch_compat.TORCH_MINOR
    torch_compat.require_torch(major, minor, "anything")
    with pytest.raises(torch_compat.TorchTooOld) as refused:
        torch_compat.require_torch(major, minor + 1, "a compiled step on a DTensor mesh")
    message = str(refused.value)
    assert "\n" not in message
    assert f"needs torch >= {major}.{minor + 1}; this is torch {torch.__version__}" in message


def test_the_installed_torch_is_in_the_supported_range():
    oldest, newest = torch_compat.SUPPORTED_TORCH
    assert oldest <= torch_compat.TORCH_MINOR <= newest
    pyproject = (LMFUNC.parent / "pyproject.toml").read_text()
    assert f'"torch>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"' in pyproject
