"""The project's stated Python floor holds: pyproject's requires-python, the README, ruff's target,
the pinned dependencies (constraints.txt) and the package's own syntax all agree on it."""

from __future__ import annotations

import ast
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def floor() -> tuple[int, int]:
    """The lowest Python that pyproject's `requires-python` (one `>=X.Y`) admits."""
    spec = PYPROJECT["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r}: expected one lower bound, >=3.N"
    return 3, int(m.group(1))


def test_readme_states_the_floor_of_requires_python():
    stated = re.findall(r"Needs Python ≥ (\d+)\.(\d+)", (ROOT / "README.md").read_text())
    assert stated == [tuple(map(str, floor()))], (stated, PYPROJECT["project"]["requires-python"])


def test_ruff_targets_the_floor():
    major, minor = floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"


def test_pinned_dependencies_install_on_the_floor():
    """Each version constraints.txt pins (as installed here) supports the floor: `make install` on
    that Python resolves, instead of failing on a pin that needs a newer one."""
    version = "{}.{}".format(*floor())
    checked, refused = 0, []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version.split("+", 1)[0] not in req.specifier:
            continue  # another version installed: its metadata says nothing about the pin
        checked += 1
        needs = dist.metadata.get("Requires-Python")
        if needs and not SpecifierSet(needs).contains(version, prereleases=True):
            refused.append(f"{req.name}=={dist.version} (Requires-Python {needs})")
    assert checked > 50, checked
    assert not refused, f"pinned versions that do not support Python {version}: {refused}"


def test_the_package_parses_as_the_floor_python():
    bad = []
    for path in sorted((ROOT / "workflows").rglob("*.py")):
        try:
            ast.parse(path.read_text(), str(path), feature_version=floor())
        except SyntaxError as e:
            bad.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not bad, bad


def test_mypy_checks_the_whole_package():
    """`make test` runs mypy over [tool.mypy] files: every module of workflows/ (tasks/ included),
    reliability/, examples/ and benchmarks/ is among them, and none is excluded."""
    mypy = PYPROJECT["tool"]["mypy"]
    files = [ROOT / f for f in mypy["files"]]
    assert not mypy.get("exclude"), mypy.get("exclude")
    checked = ("workflows", "reliability", "examples", "benchmarks")
    modules = sorted(m for d in checked for m in (ROOT / d).rglob("*.py"))
    assert any(m.parent.name == "tasks" and m.parent.parent.name == "workflows" for m in modules)
    unchecked = [str(m.relative_to(ROOT)) for m in modules if not any(m == f or f in m.parents for f in files)]
    assert not unchecked, f"not type-checked: {unchecked}"


def test_modules_stay_small():
    """Every module of workflows/, reliability/, examples/ and benchmarks/ is at most 450 lines (#38):
    a longer one is split by what it does."""
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for d in ("workflows", "reliability", "examples", "benchmarks") for p in (ROOT / d).rglob("*.py")}
    long = {path: n for path, n in lines.items() if n > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_the_configs_task_names_are_the_builtin_tasks():
    """workflows.config checks model.task's form without importing a task: its list of built-in names
    is the tasks' own (workflows.tasks.BUILTIN)."""
    from workflows.config.model import BUILTIN_TASKS
    from workflows.tasks import BUILTIN

    assert set(BUILTIN_TASKS) == set(BUILTIN)
