"""The layers of workflows/: which unit may import which (docs/ARCHITECTURE.md draws them).

A unit is a subpackage of workflows/ (`tasks`, `train`, ...) or a top-level module (`errors`,
`runtime`, ...; the package's own __init__ is `workflows`). Every import of a workflows module counts:
module level, inside functions and under `if TYPE_CHECKING:` alike. A unit may import its own layer
and the layers below, and no unit imports one that imports it back (directly or round a longer
circle), as Ray's circular-import check holds Ray Train to. No Ray, no torch: the files are parsed.
"""

from __future__ import annotations

import ast
import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. docs/ARCHITECTURE.md's table lists the same layers in the same order.
LAYERS: list[tuple[str, ...]] = [
    ("workflows", "errors", "seeds", "net", "console", "stop", "overrides", "cluster_scoped", "cluster_state",
     "model_card", "parallel", "ray_start"),
    ("storage",),
    ("config",),
    ("dataset", "loader", "plots", "tracking", "registry", "registry_aliases", "registry_history", "registry_signing",
     "lineage"),
    ("preprocess",),
    ("tasks", "api", "config_reference"),
    ("serve", "evaluate"),
    ("runtime",),
    ("train", "progress", "tune"),
    ("pipeline",),
    ("cli", "bench", "__main__", "workflow"),
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# In-function imports of the package's own modules, as a share of all of them (TYPE_CHECKING ones
# aside), outside the units that import lazily on purpose for start-up time: the CLI and its user
# benchmarks (`workflows --help` and a config check import no torch and no Ray) and a task wing's
# __init__ (a task class is imported by every command's config check; its model, data and serving
# modules, which import torch, transformers or Ray Data, are imported when a stage calls it).
LAZY_ON_PURPOSE = ("workflows/cli/*", "workflows/bench/*", "workflows/__main__.py", "workflows/tasks/*/__init__.py")
MAX_IN_FUNCTION_SHARE = 0.15


def unit_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root / "workflows").parts
    if len(parts) > 1:
        return parts[0]
    return "workflows" if parts[0] == "__init__.py" else parts[0].removesuffix(".py")


def unit_of_module(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "workflows"


def own_imports(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(imported workflows module, line, where) of every import in a module; where: "module",
    "function" or "type" (under `if TYPE_CHECKING:`). `from workflows import x` imports workflows.x."""
    found: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and where == "module":
                inner = "function"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for c in child.body:
                    visit(ast.Module(body=[c], type_ignores=[]), "type")
                for c in child.orelse:
                    visit(ast.Module(body=[c], type_ignores=[]), where)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, where) for a in child.names if a.name.split(".")[0] == "workflows")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module == "workflows":
                    found.extend((f"workflows.{a.name}", child.lineno, where) for a in child.names)
                elif child.module.startswith("workflows."):
                    found.append((child.module, child.lineno, where))
            visit(child, inner)

    visit(tree, "module")
    return found


def unit_edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """{(importer unit, imported unit): ["path:line", ...]} over every module of workflows/."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted((root / "workflows").rglob("*.py")):
        source = unit_of(path, root)
        for module, line, _ in own_imports(ast.parse(path.read_text())):
            target = unit_of_module(module)
            if target != source:
                edges.setdefault((source, target), []).append(f"{path.relative_to(root)}:{line}")
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def unit_graph(edges: dict[tuple[str, str], list[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    return graph


def upward(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    return sorted(f"{a} -> {b} ({', '.join(where)})" for (a, b), where in edges.items() if RANK[b] > RANK[a])


def module_circles(root: Path) -> list[list[str]]:
    """Circles between modules (not units): a module that imports one that imports it back, in
    functions too (TYPE_CHECKING imports aside, which never run)."""
    modules = {}
    for path in (root / "workflows").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _, where in own_imports(ast.parse(path.read_text())):
            if where != "type" and (target := resolve(name)) not in (None, module):
                graph[module].add(target)  # type: ignore[arg-type]
    return cycles(graph)


def test_every_unit_has_one_layer():
    units = {unit_of(p, ROOT) for p in (ROOT / "workflows").rglob("*.py")}
    listed = [u for layer in LAYERS for u in layer]
    assert len(listed) == len(set(listed)), "a unit is listed twice in LAYERS"
    assert units == set(listed), (f"not placed in LAYERS: {sorted(units - set(listed))}; "
                                  f"listed but gone: {sorted(set(listed) - units)}")


def test_no_import_cycle_between_subpackages():
    found = cycles(unit_graph(unit_edges(ROOT)))
    assert not found, f"units that import each other (round a circle): {found}"


def test_imports_go_down_the_layers():
    up = upward(unit_edges(ROOT))
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_no_import_circle_between_modules():
    found = module_circles(ROOT)
    assert not found, f"import circles: {found}"


def test_the_checks_see_a_planted_cycle_and_an_upward_import(tmp_path):
    """The checks fail on a fault: storage importing a task inside a function (upward and, as tasks
    import storage, a circle of units and of modules)."""
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    uri = tmp_path / "workflows" / "storage" / "uri.py"
    uri.write_text(uri.read_text() + "\n\ndef _planted():\n    from workflows.tasks.base import Task\n")
    edges = unit_edges(tmp_path)
    assert any({"storage", "tasks"} <= set(c) for c in cycles(unit_graph(edges)))
    assert any(u.startswith("storage -> tasks (workflows/storage/uri.py:") for u in upward(edges))
    assert any({"workflows.storage.uri", "workflows.tasks.base"} <= set(c) for c in module_circles(tmp_path))


# The chat wing's rooms (workflows/tasks/chat/), lowest first, as LAYERS orders the units: a room imports
# only the rooms below it, and no two rooms import each other. A room is a subpackage of the wing or a
# module in it; `task` is the wing's own __init__ (the task class the platform calls). Each room's
# docstring says what it owns and which rooms it imports.
CHAT_WING = "workflows.tasks.chat"
CHAT_ROOMS = ["engine", "grammar", "adapters", "training", "vllm_engine", "openai", "serving", "task"]


def chat_rooms(root: Path) -> set[str]:
    """The wing's subpackages and modules, its __init__ as `task`."""
    wing = root / Path(*CHAT_WING.split("."))
    return {"task" if p.stem == "__init__" else p.stem for p in wing.glob("*.py")} | {
        p.name for p in wing.iterdir() if (p / "__init__.py").is_file()}


def chat_room_edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """{(importer room, imported room): ["path:line", ...]} over the chat wing's modules; every import
    counts (in functions and under TYPE_CHECKING too), `from workflows.tasks.chat import x` as room x
    where x is one, else as the task's."""
    wing, rooms = root / Path(*CHAT_WING.split(".")), chat_rooms(root)

    def room(parts: list[str]) -> str:
        return parts[0] if parts and parts[0] in rooms else "task"

    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(wing.rglob("*.py")):
        source = room(list(path.relative_to(wing).with_suffix("").parts))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == CHAT_WING else [node.module]
            else:
                continue
            for name in names:
                if name == CHAT_WING or name.startswith(CHAT_WING + "."):
                    target = room(name.removeprefix(CHAT_WING).lstrip(".").split("."))
                    if target != source:
                        edges.setdefault((source, target), []).append(f"{path.relative_to(root)}:{node.lineno}")
    return edges


def upward_rooms(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    rank = {room: i for i, room in enumerate(CHAT_ROOMS)}
    return sorted(f"{a} -> {b} ({', '.join(where)})" for (a, b), where in edges.items() if rank[b] > rank[a])


def test_every_chat_room_has_its_place():
    on_disk = chat_rooms(ROOT)
    assert len(CHAT_ROOMS) == len(set(CHAT_ROOMS)), "a room is listed twice in CHAT_ROOMS"
    assert on_disk == set(CHAT_ROOMS), (f"not placed in CHAT_ROOMS: {sorted(on_disk - set(CHAT_ROOMS))}; "
                                        f"listed but gone: {sorted(set(CHAT_ROOMS) - on_disk)}")


def test_the_chat_rooms_import_down_and_never_round_a_circle():
    edges = chat_room_edges(ROOT)
    up = upward_rooms(edges)
    assert not up, "imports up the chat wing's rooms:\n" + "\n".join(up)
    found = cycles(unit_graph(edges))
    assert not found, f"chat rooms that import each other (round a circle): {found}"


def test_the_chat_room_checks_see_a_planted_upward_import(tmp_path):
    """The checks fail on a fault: the engine importing serving inside a function (upward and, as serving
    imports the engine, a circle of rooms)."""
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows", ignore=shutil.ignore_patterns("__pycache__"))
    loop = tmp_path / "workflows" / "tasks" / "chat" / "engine" / "loop.py"
    loop.write_text(loop.read_text() + "\n\ndef _planted():\n    from workflows.tasks.chat import serving\n")
    edges = chat_room_edges(tmp_path)
    assert any(u.startswith("engine -> serving (workflows/tasks/chat/engine/loop.py:") for u in upward_rooms(edges))
    assert any({"engine", "serving"} <= set(c) for c in cycles(unit_graph(edges)))


def in_function_share(root: Path) -> tuple[int, int]:
    """(in-function imports, all imports) of workflows modules, TYPE_CHECKING ones and the units
    that import lazily on purpose (LAZY_ON_PURPOSE) aside."""
    inside = total = 0
    for path in (root / "workflows").rglob("*.py"):
        if any(fnmatch(str(path.relative_to(root)), pattern) for pattern in LAZY_ON_PURPOSE):
            continue
        wheres = [where for _, _, where in own_imports(ast.parse(path.read_text())) if where != "type"]
        total += len(wheres)
        inside += wheres.count("function")
    return inside, total


def test_imports_inside_functions_stay_few():
    """Under 15% of the package's own imports sit inside functions, where no start-up time asks for it:
    an import that is not lazy on purpose goes at the top of its module."""
    inside, total = in_function_share(ROOT)
    assert inside / total <= MAX_IN_FUNCTION_SHARE, f"{inside} of {total} own imports sit inside functions"


def test_the_architecture_doc_lists_the_layers():
    """docs/ARCHITECTURE.md's table of layers names every unit, in LAYERS' order, and its one-line
    order names the layers' first units in that order."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = [line for line in doc.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    table = [tuple(re.findall(r"`([\w.]+)`", row.split("|")[2])) for row in rows]
    assert table == LAYERS, f"docs/ARCHITECTURE.md's layers {table} are not tests/test_layers.py's {LAYERS}"
    line = re.search(r"^\*\*Order:\*\* (.+)$", doc, re.M)
    assert line, "docs/ARCHITECTURE.md states the order on a line starting **Order:**"
    named = re.findall(r"`([\w.]+)`", line.group(1))
    assert [RANK[u] for u in named] == list(range(len(LAYERS))), \
        f"the order line {named} does not name one unit of each layer, lowest first"
