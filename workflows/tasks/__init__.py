"""Tasks: the kinds of model the stages run (workflows.tasks.base.Task).

`model.task` names a built-in (`classification`, `causal_lm`, `image_classification`, `chat`) or a user's
own by import path, `my_pkg.tasks:MyTask`, with its settings in `model.options` (the task's
`Options` model validates them). It must import where the stages run: the working directory of a
`ray job submit --working-dir` job does, on every node; a command that starts its own local cluster
passes its PYTHONPATH and working directory to the workers; one that joins a running cluster ships
the module's file or top-level package to them (`plugin_source`, workflows.runtime.init_ray).
A plug-in imports workflows.api only; examples/tasks/ holds complete ones kept outside the package.
The config checks only the form of `model.task` (workflows.config imports no task); `check_task`
imports the plug-in and checks its class (`check_task_class`) once the config has loaded, before
anything starts: the CLI's config load and workflows.runtime.runtime call it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import TYPE_CHECKING

from workflows.config.model import IMPORT_PATH
from workflows.errors import UserError
from workflows.tasks.base import Task

if TYPE_CHECKING:
    from workflows.config import WorkflowConfig
    from workflows.model_card import ModelCard
    from workflows.tasks.base import Task

BUILTIN = {
    "classification": "workflows.tasks.text:TextClassification",
    "causal_lm": "workflows.tasks.causal_lm:CausalLM",
    "image_classification": "workflows.tasks.image:ImageClassification",
    "chat": "workflows.tasks.chat:ChatTask",
}
# model cards written before tasks were plug-ins name the text classifier this way
CARD_ALIASES = {"sequence-classification": "classification"}


def check_task(cfg: WorkflowConfig) -> WorkflowConfig:
    """The loaded config, once its `model.task` is checked (`check_task_name`): a mistake stops the
    command before anything starts, with one line naming the module, class or method."""
    check_task_name(cfg.model.task)
    if cfg.registry.promote is not None:
        check_promotion(cfg)
    return cfg


def check_promotion(cfg: WorkflowConfig) -> None:
    """The promotion gate needs a metric of the task's evaluation that says which of two versions is
    better (its evaluation seam's `comparable_metrics`): a task that registers its model without one, or a metric it
    does not compare, is refused. A task that registers no model never reaches the gate (the pipeline
    refuses it), so its commands (`plan`, `train`) take a config with the gate on."""
    cls = task_class(cfg.model.task)
    if not cls.registers:
        return
    metrics = cls(cfg).evaluation.comparable_metrics()
    if not metrics:
        raise UserError(f"registry.promote: model.task={cfg.model.task} has no evaluation metric to compare two "
                        "versions by (its evaluation seam's comparable_metrics is empty): unset registry.promote")
    metric = cfg.registry.promote.metric if cfg.registry.promote is not None else None
    if metric is not None and metric not in metrics:
        raise UserError(f"registry.promote.metric={metric!r}: model.task={cfg.model.task} compares "
                        f"{', '.join(metrics)}")


def check_task_name(value: str) -> str:
    """`model.task`: a built-in task's name, or `module.path:ClassName`, a plug-in that is imported
    here and whose class must define what the stages call (`task_class`)."""
    if value in BUILTIN:
        return value
    if IMPORT_PATH.match(value):
        task_class(value)
        return value
    raise ValueError(f"unknown task {value!r}: use one of {', '.join(BUILTIN)}, or a plug-in as module.path:ClassName")


def _parameters(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()]


def check_task_class(cls: type[Task], name: str) -> None:
    """A UserError naming the class and the method when `cls` lacks a method it must define
    (Task.required_methods) or defines one whose parameters are not the base's (by name, in order)."""
    where = f"model.task {name!r}: {cls.__module__}.{cls.__qualname__}"
    for method in cls.required_methods():
        fn, base = getattr(cls, method), getattr(Task, method)
        if fn is base or getattr(fn, "__isabstractmethod__", False):
            raise UserError(f"{where} does not define {method}({', '.join(_parameters(base))}), which a task must "
                            "(see workflows.api.Task)")
        if _parameters(fn) != _parameters(base):
            raise UserError(f"{where}.{method} takes ({', '.join(_parameters(fn))}); a task's {method} takes "
                            f"({', '.join(_parameters(base))})")


def task_class(name: str) -> type[Task]:
    name = CARD_ALIASES.get(name, name)
    target = BUILTIN.get(name, name)
    module_name, _, attr = target.partition(":")
    try:
        if "" not in sys.path and module_name.split(".")[0] != "workflows":
            # a plug-in in the working directory (python -m adds it; console scripts don't): last, so
            # that a file there never shadows an installed module
            sys.path.append("")
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"model.task {name!r}: cannot import module {module_name!r} ({e}); make it importable: "
                        "run from the directory that holds it, put that directory on PYTHONPATH or `pip install -e` "
                        "its project (on a cluster: ray job submit --working-dir)") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise UserError(f"model.task {name!r}: {module_name}.{attr} is not a workflows.tasks.base.Task subclass")
    check_task_class(cls, name)
    return cls


def plugin_source(name: str) -> str | None:
    """The file (or package directory) of a plug-in task's top-level module, to ship to the workers of
    a cluster this process joins (`runtime_env.py_modules`); None for a built-in, a module installed
    in the environment (site-packages: the cluster's image has it too) or one not found here."""
    import importlib.util
    import sysconfig

    target = BUILTIN.get(CARD_ALIASES.get(name, name), name)
    top = target.partition(":")[0].split(".")[0]
    if top == "workflows":
        return None
    if "" not in sys.path:
        sys.path.append("")  # as task_class finds it
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if len(locations) > 1 or (not locations and not (spec.origin or "").endswith(".py")):
        return None  # a namespace package spread over directories, or an extension module
    origin = locations[0] if locations else spec.origin
    if origin is None:
        return None
    path = os.path.abspath(origin)
    installed = {os.path.abspath(sysconfig.get_path(k)) for k in ("purelib", "platlib")}
    return None if any(path.startswith(d + os.sep) for d in installed) else path


def get_task(cfg: WorkflowConfig) -> Task:
    """The task of a workflow config."""
    return task_class(cfg.model.task)(cfg)


def check_card_task(cfg: WorkflowConfig, card: ModelCard) -> str:
    """The task a registered model's card names, if this command may import it: a built-in, the
    config's own `model.task`, or one listed in `model.trusted_tasks`. The card is read from the
    store, so whoever can write to the bucket would otherwise choose the code that every replica and
    evaluator imports."""
    name = CARD_ALIASES.get(card.task or "classification", card.task or "classification")
    if name in BUILTIN or name == cfg.model.task or name in cfg.model.trusted_tasks:
        return name
    raise UserError(
        f"model {card.name}:v{card.version} names the plug-in task {name!r}, which this command does not import: "
        f"run it with the config that trained it (--set model.task={name}) or list it in model.trusted_tasks")


def task_for_card(cfg: WorkflowConfig, card: ModelCard) -> Task:
    """The task that trained a registered model (its card's `task`), for serving and evaluation."""
    return task_class(check_card_task(cfg, card))(cfg)
