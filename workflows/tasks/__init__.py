"""Tasks: the kinds of model the stages run (workflows.tasks.base.Task).

`model.task` names a built-in (`classification`, `causal_lm`, `image_classification`) or a user's
own by import path, `my_pkg.tasks:MyTask` (importable where the stages run: the working directory
of a `ray job submit --working-dir` job is, on every node).
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import TYPE_CHECKING

from workflows.errors import UserError

if TYPE_CHECKING:
    from workflows.config import WorkflowConfig
    from workflows.model_card import ModelCard
    from workflows.tasks.base import Task

BUILTIN = {
    "classification": "workflows.tasks.text:TextClassification",
    "causal_lm": "workflows.tasks.causal_lm:CausalLM",
    "image_classification": "workflows.tasks.image:ImageClassification",
}
# model cards written before tasks were plug-ins name the text classifier this way
CARD_ALIASES = {"sequence-classification": "classification"}
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def check_task_name(value: str) -> str:
    """A built-in task's name, or `module.path:ClassName` (imported when the task is used)."""
    if value in BUILTIN or IMPORT_PATH.match(value):
        return value
    raise ValueError(f"unknown task {value!r}: use one of {', '.join(BUILTIN)}, or a plug-in as module.path:ClassName")


def task_class(name: str) -> type[Task]:
    from workflows.tasks.base import Task

    name = CARD_ALIASES.get(name, name)
    target = BUILTIN.get(name, name)
    module_name, _, attr = target.partition(":")
    try:
        if "" not in sys.path and module_name.split(".")[0] != "workflows":
            sys.path.insert(0, "")  # a plug-in in the working directory (python -m adds it; console scripts don't)
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"model.task {name!r}: cannot import module {module_name!r} ({e})") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"model.task {name!r}: {module_name}.{attr} is not a workflows.tasks.base.Task subclass")
    return cls


def get_task(cfg: WorkflowConfig) -> Task:
    """The task of a workflow config."""
    return task_class(cfg.model.task)(cfg)


def task_for_card(cfg: WorkflowConfig, card: ModelCard) -> Task:
    """The task that trained a registered model (its card's `task`), for serving and evaluation."""
    return task_class(card.task or "classification")(cfg)
