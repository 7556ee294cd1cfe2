"""Code outside ``kernels`` uses only the kernels' public names: no private module, no underscored name.

What the service and the benchmarks need below ``kernels.conv_transpose2d`` (the raw forward with a forced kernel
choice, the loaded extension, the output's size, packed weights) is public in ``kernels.internal``; a name with a
leading underscore, or a module whose name has one, is its module's own and may change with it (import-linter's
contracts speak of modules, not of the names imported from them, so this test holds the rule).

The rule, checked on every ``import`` and ``from ... import`` (at any depth of a file) of every Python file under
service/, bench/, client/, layers/, deploy/ and tests/: none imports a name that starts with one underscore from a
``kernels`` module, nor a ``kernels`` module with such a part in its path. One exception: the kernels' own tests
(tests/kernels/, the folder that mirrors the package) are not checked, as they may import a private function of the
kernels module they test (test_cpu_args.py tests ``kernels.internal._pair``, test_cuda_gemm.py ``kernels.op``'s
layout checks); tests elsewhere test through public names. Dunder names (``__version__``) are not private.
Attribute access (``module._name``) is not an import and is not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("service", "bench", "client", "layers", "deploy", "tests")
GUARDED = "kernels"
OWN_TESTS = ROOT / "tests" / "kernels"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import in ``source`` of a private ``kernels`` module or name, as ``line: statement``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == GUARDED and any(_private(p) for p in parts):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            parts = node.module.split(".")
            if parts[0] != GUARDED:
                continue
            names = [alias.name for alias in node.names]
            if any(_private(p) for p in parts) or any(_private(n) for n in names):
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
    return [f"{line}: {text}" for line, text in sorted(found)]


def checked_files() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (ROOT / folder).rglob("*.py") if OWN_TESTS not in p.parents)


def test_the_rule_finds_each_form() -> None:
    source = (
        "from kernels._ops import forward_cuda\n"
        "from kernels.internal import _pair, out_hw\n"
        "import kernels._ops as ops\n"
        "def f():\n"
        "    from kernels import _ops\n"
        "from kernels.internal import forward_cuda, load_extension\n"
        "from kernels import __doc__\n"
        "from service.engine.ops import _helper\n"
        "from ._local import _x\n"
    )
    assert private_imports(source) == [
        "1: from kernels._ops import forward_cuda",
        "2: from kernels.internal import _pair, out_hw",
        "3: import kernels._ops",
        "5: from kernels import _ops",
    ]


def test_no_private_kernels_import_outside_kernels() -> None:
    files = checked_files()
    assert len(files) > 50, f"only {len(files)} files found under {CHECKED}: the walk is wrong"
    assert any(p.is_relative_to(ROOT / "service" / "engine") for p in files)
    offences = [f"{p.relative_to(ROOT)}:{hit}" for p in files for hit in private_imports(p.read_text(), str(p))]
    assert offences == [], "private kernels names imported outside kernels (use kernels.internal):\n" + "\n".join(
        offences)
