"""`workflows` command line: one typed config, `--set a.b=c` overrides on every command.

The commands live in one module per group (stages, models, serving, tools, data); they are
registered here, in the order `workflows --help` lists them."""

from __future__ import annotations

import typer

from workflows.cli import models, serving, stages, tools
from workflows.cli.common import DEFAULT_CONFIG, ConfigOpt, SetOpt, VerboseOpt
from workflows.cli.data import data_app
from workflows.overrides import named_after_model

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ray-based ML workflows: object storage -> Ray Data -> Ray Train/Tune -> Ray Serve.")

for command in (stages.preprocess, stages.train, stages.tune, models.evaluate, models.predict, serving.serve,
                serving.store, stages.pipeline, tools.runs, tools.ui, tools.plan):
    app.command()(command)
app.add_typer(models.models_app, name="models")
app.add_typer(data_app, name="data")
app.command()(tools.bench)

__all__ = ["DEFAULT_CONFIG", "ConfigOpt", "SetOpt", "VerboseOpt", "app", "main", "named_after_model"]


def main() -> None:
    try:
        app()
    except SystemExit as done:  # click ends every command with one, 0 on success
        if done.code in (0, None):
            exit_without_teardown(0)
        raise


def exit_without_teardown(code: int) -> None:
    """End the process as Python's own exit does, up to its C-level teardown: non-daemon threads joined
    (executors told to stop first), atexit handlers run, logging and the standard streams flushed; then
    os._exit. The teardown that follows in a normal exit (every extension's module state: torch, Ray's
    core worker, pyarrow) took 2.4 s of each `workflows pipeline` on 2 cores and writes nothing of ours."""
    import atexit
    import logging
    import os
    import sys
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls first: no public equivalent
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)

