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
    app()

