"""A task's `model.options`: validated by its `Options` model. (A built-in's setting under a key it
had before tasks had options is refused when the config loads: workflows.config.moved.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workflows.errors import UserError

if TYPE_CHECKING:
    from workflows.tasks.base import Task


def parse_options(task: type[Task], options: Mapping[str, Any]) -> Any:
    """`model.options` validated by `task.Options`; any error is a UserError naming the key."""
    from pydantic import ValidationError

    name = task.name or task.__name__
    if task.Options is None:
        if options:
            raise UserError(f"model.options: task {name} takes no options (got {', '.join(map(str, options))})")
        return None
    fields = task.Options.model_fields
    known = [*fields, *(f.alias for f in fields.values() if f.alias and f.alias not in fields)]
    problems = []
    if task.Options.model_config.get("extra", "ignore") == "ignore":  # a typo is an error even so
        problems = [f"model.options.{k}: unknown option" for k in options if k not in known]
    try:
        if not problems:
            return task.Options.model_validate(dict(options))
    except ValidationError as e:
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = {"extra_forbidden": "unknown option", "missing": "required option is missing"}.get(
                err["type"], err["msg"])
            if err["type"] not in ("extra_forbidden", "missing") and not isinstance(err.get("input"), dict | list):
                msg += f" (got {err.get('input')!r})"
            problems.append(f"model.options{'.' + key if key else ''}: {msg}")
    raise UserError(f"task {name}: " + "; ".join(problems) + f" (its options: {', '.join(known) or 'none'})")
