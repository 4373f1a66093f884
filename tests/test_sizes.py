"""The size of workflows/'s modules and functions: no file over MAX_FILE_LINES lines, no function
(methods included, from its `def` line to its last, decorators aside) over MAX_FUNCTION_LINES.
No Ray, no torch: the files are parsed, never imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# The bench harness measures whole user paths end to end; its runners read as one script each.
EXEMPT = ("workflows/bench/",)


def oversized(root: Path) -> list[str]:
    """'path: N lines' for each file and 'path:line name(): N lines' for each function over its limit."""
    found = []
    for path in sorted((root / "workflows").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(EXEMPT):
            continue
        source = path.read_text()
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    return found


def test_no_file_or_function_is_over_its_limit():
    found = oversized(ROOT)
    assert not found, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function "
                       "(split it by concern):\n" + "\n".join(found))


def test_the_check_sees_a_long_file_and_a_long_method(tmp_path):
    """The check fails on a fault: a module one line too long, holding a method one line too long,
    and says nothing of the same in the bench harness."""
    method = ["class A:", "    @staticmethod", "    def long():", *["        pass"] * MAX_FUNCTION_LINES]
    module = "\n".join(method + [""] * (MAX_FILE_LINES + 1 - len(method))) + "\n"
    for where in ("workflows/serve", "workflows/bench"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "planted.py").write_text(module)
    assert oversized(tmp_path) == [f"workflows/serve/planted.py: {MAX_FILE_LINES + 1} lines",
                                   f"workflows/serve/planted.py:3 long(): {MAX_FUNCTION_LINES + 1} lines"]
