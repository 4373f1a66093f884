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


# --- the import map of workflows/ ---------------------------------------------------------------------
# Layers, lowest first: a module may import its own layer and those below. The longest matching prefix
# places a module (a package line covers its submodules); a module no line covers fails the test, so a
# new top-level module or package is placed on purpose.
LAYERS: dict[str, int] = {
    # 0 foundation: errors, configs, storage, tracking, the card, the console, the seeds; imports no task
    **dict.fromkeys(["workflows", "workflows.errors", "workflows.console", "workflows.net", "workflows.overrides",
                     "workflows.stop", "workflows.cluster_scoped", "workflows.model_card", "workflows.plots",
                     "workflows.seeds", "workflows.storage", "workflows.config", "workflows.tracking"], 0),
    # 1 data: the processed dataset, preprocessing helpers, the loaders
    **dict.fromkeys(["workflows.dataset", "workflows.preprocess", "workflows.loader"], 1),
    # 2 engine primitives: the training loop, parallelism, checkpoints, models, export; Serve's contract
    # and ingress; the task base class; the progress display of training reports
    **dict.fromkeys(["workflows.train", "workflows.serve", "workflows.tasks.base", "workflows.progress"], 2),
    # 3 tasks: the built-in wings, the classification base, the plug-in API
    **dict.fromkeys(["workflows.tasks", "workflows.api"], 3),
    # 4 stages and commands: what runs a task (trainer drivers, Tune, serving app, batch prediction,
    # evaluation, registry, runtime, the pipeline, the CLI, the user benchmarks)
    **dict.fromkeys(["workflows.train.trainer", "workflows.train.standalone", "workflows.train.planner",
                     "workflows.tune", "workflows.serve.app", "workflows.serve.batch", "workflows.serve.deploy_config",
                     "workflows.serve.predictor", "workflows.evaluate", "workflows.registry", "workflows.runtime",
                     "workflows.pipeline", "workflows.cli", "workflows.bench", "workflows.config_reference",
                     "workflows.__main__"], 4),
}
MAX_UPWARD = 5


def import_map(root) -> dict[str, set[str]]:
    """Every import of a workflows module by another (module level and inside functions; not those
    under `if TYPE_CHECKING:`, which never run), as {importer: {imported}}; `from pkg import name`
    counts as an import of pkg.name where that is a module, else of pkg."""
    modules = {}
    for path in (root / "workflows").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

        def visit(node: ast.AST) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                    continue
                if isinstance(child, ast.Import):
                    targets = {resolve(a.name) for a in child.names if a.name.startswith("workflows")}
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                    if not base.startswith("workflows"):
                        continue
                    subs = {resolve(f"{base}.{a.name}") for a in child.names} - {resolve(base)}
                    targets = subs or {resolve(base)}
                else:
                    visit(child)
                    continue
                edges[module] |= targets - {None, module}
        visit(ast.parse(path.read_text()))
    return edges


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert prefix is not None, f"{module}: no line of LAYERS places it; add one"
    return LAYERS[prefix]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def test_the_import_map_has_no_circles_and_few_imports_up_the_layers():
    """Over every import of workflows/, in functions too: no module imports one that imports it back
    (a circle makes each importable only in the right order, and hides which way the layers go), and
    at most MAX_UPWARD imports run from a lower layer of LAYERS to a higher one (two today: Ray Train's
    worker builds the config's task, and the chat task reads a registered base model,
    `model.name_or_path: registry:NAME`, through workflows.registry)."""
    edges = import_map(ROOT)
    found = circles(edges)
    assert not found, f"import circles: {found}"
    up = upward(edges)
    assert len(up) <= MAX_UPWARD, f"{len(up)} imports up the layers (at most {MAX_UPWARD}): {up}"


def test_the_import_map_sees_a_planted_circle_and_upward_imports(tmp_path):
    """The checks above fail on a fault: a config module that imports a task (as config.model's
    validators once did: a circle through tasks) and more upward imports than allowed."""
    import shutil

    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    model = tmp_path / "workflows" / "config" / "model.py"
    model.write_text(model.read_text() + "\n\ndef _planted():\n    from workflows.tasks import check_task_name\n")
    edges = import_map(tmp_path)
    assert any({"workflows.config.model", "workflows.tasks"} <= set(c) for c in circles(edges)), circles(edges)
    assert "workflows.config.model -> workflows.tasks" in upward(edges)
    storage = tmp_path / "workflows" / "storage" / "uri.py"
    storage.write_text(storage.read_text() + "".join(f"\n\ndef _up{i}():\n    import workflows.{m}\n" for i, m in
                                                   enumerate(("pipeline", "cli", "evaluate", "registry", "tune"))))
    assert len(upward(import_map(tmp_path))) > MAX_UPWARD


def test_the_configs_task_names_are_the_builtin_tasks():
    """workflows.config checks model.task's form without importing a task: its list of built-in names
    is the tasks' own (workflows.tasks.BUILTIN)."""
    from workflows.config.model import BUILTIN_TASKS
    from workflows.tasks import BUILTIN

    assert set(BUILTIN_TASKS) == set(BUILTIN)
