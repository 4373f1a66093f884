"""Render the configuration reference, docs/CONFIG.md, from the pydantic models in workflows/config/
and the built-in tasks' `Options` (their `model.options`).

    python -m workflows.config_reference            # (re)write docs/CONFIG.md
    python -m workflows.config_reference --check    # exit 1 if docs/CONFIG.md is stale

Every section and field appears under its dotted path (the key `--set` takes), with its type,
default, constraints and description: the field's `Field(description=...)`, else the comment on or
directly above its line in its module of workflows/config/, else nothing.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from workflows.config import WorkflowConfig
from workflows.config.moved import MOVED
from workflows.tasks import BUILTIN, task_class

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
REGENERATE = "python -m workflows.config_reference"

HEADER = f"""# Configuration reference

<!-- Generated from workflows/config/ and the built-in tasks' Options by `{REGENERATE}`: do not edit by hand. -->

Every command reads one YAML file (`--config FILE`: a path, or a shipped config by name, default
`quickstart`, the package's copy of `configs/quickstart.yaml`) and any
number of `--set key=value` overrides, where `key` is a dotted path below (`--set train.lr=3e-5`;
values are YAML: `--set 'data.text_columns=[subject, body]'`, `--set data.builtin=null`). Unknown
keys, wrong types and values outside the constraints are rejected with the key and the file named;
a key that moved to a task's `model.options` ([the table at the end](#keys-that-moved)) with its new
place.
"""


def _is_model(tp: Any) -> bool:
    return inspect.isclass(tp) and issubclass(tp, BaseModel)


def _model_of(tp: Any) -> type[BaseModel] | None:
    """The model a field holds directly, or through `X | None`."""
    if _is_model(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 and _is_model(args[0]):
        return args[0]
    return None


def type_name(tp: Any) -> str:
    """A reader's name for an annotation: `int | null`, `"auto" | "csv"`, `list[str]`, ..."""
    if tp is type(None):
        return "null"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(parts + (["null"] if type(None) in args else []))
    if origin in (list, tuple, set, frozenset):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "[" + ", ".join(type_name(a) for a in args) + "]"
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return f"map[{type_name(args[0])} → {type_name(args[1])}]" if args else "map"
    if tp is Any:
        return "any"
    if inspect.isclass(tp):
        return {"str": "str", "int": "int", "float": "float", "bool": "bool"}.get(tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


_CONSTRAINTS = {"ge": "≥ {}", "gt": "> {}", "le": "≤ {}", "lt": "< {}", "min_length": "min length {}",
                "max_length": "max length {}", "multiple_of": "multiple of {}", "pattern": "matches `{}`"}


def constraints_text(field: FieldInfo) -> str:
    out = []
    for meta in field.metadata:
        for attr, fmt in _CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(fmt.format(value))
    return ", ".join(out)


@functools.cache
def source_comments(model: type[BaseModel]) -> dict[str, str]:
    """Comments documenting fields in the class body: `name: int = 0  # this` or comment lines
    directly above the field's line."""
    try:
        source = inspect.getsource(model)
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
    except (tokenize.TokenError, IndentationError):
        return {}
    found: dict[str, str] = {}
    for lineno, line in enumerate(lines, start=1):
        m = re.match(r"^    ([A-Za-z_]\w*)\s*:", line)
        if not m or m.group(1) not in model.model_fields:
            continue
        parts: list[str] = []
        above = lineno - 1
        while above >= 1 and above in comments and lines[above - 1].lstrip().startswith("#"):
            parts.insert(0, comments[above])
            above -= 1
        if lineno in comments and not line.lstrip().startswith("#"):
            parts.append(comments[lineno])
        if parts:
            found[m.group(1)] = " ".join(parts)
    return found


def description(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    text = field.description or source_comments(model).get(name, "")
    return " ".join(text.split())


def class_doc(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if doc == inspect.getdoc(BaseModel) or doc.startswith("Usage docs:"):
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def validator_docs(model: type[BaseModel]) -> list[str]:
    """Docstrings of the model's own validators (the rules beyond types and constraints)."""
    decorators = model.__pydantic_decorators__
    docs = []
    for group in (decorators.field_validators, decorators.model_validators):
        for dec in group.values():
            doc = inspect.getdoc(dec.func)
            if doc and dec.cls_ref.split(":")[0].endswith(f".{model.__qualname__}"):
                docs.append(" ".join(doc.split()))
    return docs


def required_keys(model: type[BaseModel] = WorkflowConfig) -> list[str]:
    return [key for _, _, rows in sections(model) for key, _, field in rows if field.is_required()]


def sections(
    model: type[BaseModel], prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[tuple[str, str, FieldInfo]]]]:
    """(section path, model, [(dotted key, field name, field)]) for `model` and, depth first, for
    every model nested in it: a field holding a model is a section; a map of models (tune.space)
    is a section keyed by `<name>`."""
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model_of(field.annotation)
        if sub is not None:
            nested.append((key, sub))
            continue
        rows.append((key, name, field))
        if typing.get_origin(field.annotation) is dict:
            value_type = typing.get_args(field.annotation)[1]
            if _is_model(value_type):
                nested.append((f"{key}.<{_map_key_name(name)}>", value_type))
    yield prefix.rstrip("."), model, rows
    for key, sub in nested:
        yield from sections(sub, key + ".")


def _map_key_name(field_name: str) -> str:
    return {"space": "train field"}.get(field_name, "key")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole docs/CONFIG.md."""
    out = [HEADER]
    required = required_keys()
    if required:
        out.append(
            "Keys without a default (the config must set them): " + ", ".join(f"`{k}`" for k in required) + ".\n"
        )
    all_sections = list(sections(WorkflowConfig))
    out.append(
        "Sections: " + ", ".join(f"[`{path or 'top level'}`](#{_anchor(path)})" for path, _, _ in all_sections) + ".\n"
    )
    tasks = list(task_option_sections())
    out.append("Built-in tasks' options (`model.options`): "
               + ", ".join(f"[`{name}`](#{_anchor(f'task {name}: model.options')})" for name, _ in tasks) + ".\n")
    for path, model, rows in all_sections:
        _section(out, f"`{path}`" if path else "Top level", model, rows)
    for name, task_sections in tasks:
        for path, model, rows in task_sections:
            _section(out, f"Task `{name}`: `{path}`", model, rows)
    out.append("## Keys that moved\n")
    out.append("Settings of one task are that task's `model.options`. A config file or `--set` that sets one "
               "under its old key is refused, in one line naming the file, the key and its new place.\n")
    out.append("| old key | now | task |\n| --- | --- | --- |")
    out.extend(f"| `{old}` | `{new}` | `{task}` |" for old, (new, task) in MOVED.items())
    return "\n".join(out).rstrip() + "\n"


def task_option_sections() -> Iterator[tuple[str, list]]:
    """(task name, its sections) for each built-in task with an `Options` model: the settings a
    built-in takes under `model.options` (a plug-in's Options are its own)."""
    for name in BUILTIN:
        cls = task_class(name)
        if cls.Options is not None:
            yield name, list(sections(cls.Options, "model.options."))


def _section(out: list[str], title: str, model: type[BaseModel], rows: list[tuple[str, str, FieldInfo]]) -> None:
    out.append(f"## {title}\n")
    doc = class_doc(model)
    if doc:
        out.append(doc + "\n")
    rules = validator_docs(model)
    if rules:
        out.append("\n".join(f"- {rule}" for rule in rules) + "\n")
    if not rows:
        out.append("(only the sections below)\n")
        return
    out.append("| key | type | default | constraints | description |")
    out.append("| --- | --- | --- | --- | --- |")
    for key, name, field in rows:
        cells = [f"`{key}`", _cell(f"`{type_name(field.annotation)}`"), _cell(default_text(field)),
                 _cell(constraints_text(field)), _cell(description(model, name, field))]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")


def _anchor(path: str) -> str:
    """GitHub's heading anchor for `## `path`` / `## Top level`."""
    text = path or "Top level"
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workflows.config_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be rendered")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help=f"default: {DEFAULT_OUTPUT}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else None
        if current != text:
            what = "is missing" if current is None else "is stale (workflows/config/ changed)"
            print(f"{args.output} {what}: run `{REGENERATE}` and commit the result", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
