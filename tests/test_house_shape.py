"""The KV store stays split along its trades: no file of ``kvstore/`` over 400 lines, no class there over
20 methods, and every module says why it exists (a docstring)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

MAX_LINES, MAX_METHODS = 400, 20


def shape_problems(room: Path) -> list[str]:
    """Each file over the line limit, class over the method limit, or module without a docstring."""
    problems = []
    for path in sorted(room.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        if len(source.splitlines()) > MAX_LINES:
            problems.append(f"{path.name}: {len(source.splitlines())} lines")
        if ast.get_docstring(tree) is None:
            problems.append(f"{path.name}: no module docstring")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    problems.append(f"{path.name}: class {node.name} has {len(methods)} methods")
    return problems


def test_the_kv_store_has_no_wide_class_and_no_long_file() -> None:
    assert shape_problems(REPO / "kvstore") == []


def test_the_shape_check_can_fail(tmp_path: Path) -> None:
    methods = "".join(f"    def m{i}(self) -> None:\n        pass\n" for i in range(MAX_METHODS + 1))
    (tmp_path / "wide.py").write_text('"""Wide."""\n\n\nclass Wide:\n' + methods)
    (tmp_path / "bare.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert shape_problems(tmp_path) == ["bare.py: 401 lines", "bare.py: no module docstring",
                                        f"wide.py: class Wide has {MAX_METHODS + 1} methods"]
