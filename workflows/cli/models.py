"""Commands on registered models: evaluate, predict (batch inference), and the list of models."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from workflows import console
from workflows.cli.common import ConfigOpt, SetOpt, VerboseOpt, _in_runtime, _registered
from workflows.overrides import named_after_model
from workflows.storage.atomic import atomic_write


def evaluate(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="NAME[:VERSION] in the registry"),
    data: str | None = typer.Option(None, "--data", "-d", help="URI of CSV/JSONL/parquet rows, the model's columns"),
    split: str | None = typer.Option(
        None, "--split", help="instead of --data: train, val or test of the processed dataset the model was trained on"
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="write the metrics JSON here too"),
    label_column: str | None = typer.Option(None, "--label-column", help="default: the model's"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
    verbose: bool = VerboseOpt,
):
    """Weighted and per-class precision/recall/F1 and the confusion matrix of a registered model on
    labelled data: any URI, or a split of the model's own processed dataset (--split test: held out)."""
    from workflows.dataset import SplitRows
    from workflows.pipeline.stages import stage_evaluate
    from workflows.preprocess.sources import list_shards, read_dataset

    if (data is None) == (split is None):
        console.echo("error: give exactly one of --data URI and --split train|val|test")
        raise typer.Exit(2)
    found: dict = {}  # --split: what model_split read from the store before Ray started

    def check(cfg, storage):
        if split is None:
            _registered(model)(cfg, storage)
        else:
            from workflows.pipeline.stages import model_split

            found["card"], found["uri"], found["data"] = model_split(cfg, storage, model, split)

    def body(rt):
        if split is not None:
            uri, ds = found["uri"], SplitRows(found["data"], split, rt.storage, rt.cfg.cache)
        else:
            shards, fmt = list_shards(data, rt.storage)
            uri, ds = data, read_dataset(shards, fmt, rt.storage, rt.cfg.cache)
        metrics = stage_evaluate(rt, model, ds, label_column, card=found.get("card"))
        result = {"model": model, "data": uri, "precision": rt.cfg.serve.precision, **metrics}
        if output:
            output.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(output, json.dumps(result, indent=2))
            console.say(f"evaluate: metrics written to {output}")
        rt.write_summary("evaluate", result)

    _in_runtime("evaluate", config, named_after_model(set, ctx, model), body, before_ray=check, verbose=verbose)


def predict(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="NAME[:VERSION] in the registry"),
    data: str = typer.Option(..., "--data", "-d", help="URI of CSV/JSONL/parquet rows with the model's text columns"),
    output: str = typer.Option(..., "--output", "-o", help="URI of a new directory/prefix for parquet output"),
    concurrency: int | None = typer.Option(None, help="predictor actors (default: the cluster's CPUs, at most 4)"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
    verbose: bool = VerboseOpt,
):
    """Batch inference over Ray Data with the serving predictor: adds `prediction` and `score` columns."""
    from workflows.runtime import say
    from workflows.serve.batch import check_predict, predict_batch

    def body(rt):
        result = predict_batch(rt, model, data, output, concurrency)
        say(f"predict: {result['rows']} rows scored by {result['model']} -> {output} ({len(result['files'])} files)")
        rt.write_summary("predict", result)

    _in_runtime(
        "predict",
        config,
        named_after_model(set, ctx, model),
        body,
        before_ray=lambda cfg, storage: check_predict(cfg, storage, model, output),
        verbose=verbose,
    )


models_app = typer.Typer(help="Registered models: their versions and aliases (no subcommand: the list), alias "
                          "moves and history.", invoke_without_command=True)


@models_app.callback()
def models(ctx: typer.Context, config: str = ConfigOpt, set: list[str] | None = SetOpt):
    """List registered models, their versions and the aliases each version holds."""
    if ctx.invoked_subcommand is not None:
        return
    from workflows import registry, registry_aliases

    def body(rt):
        found = registry.list_models(rt.cfg, rt.storage)
        if not found:
            typer.echo(f"no models registered under {rt.cfg.uri('models')}")
        for name, versions in found.items():
            held: dict[int, list[str]] = {}
            for alias, version in registry_aliases.aliases(rt.cfg, rt.storage, name).items():
                held.setdefault(version, []).append(f"@{alias}")
            typer.echo(f"{name}: {', '.join(' '.join([f'v{v}', *held.get(v, [])]) for v in versions)}")

    _in_runtime("models", config, set, body, ray_needed=False)


@models_app.command("alias")
def alias(
    model: str = typer.Argument(..., help="NAME:VERSION the alias is to point at (with --delete: NAME, or "
                                "NAME:VERSION to delete it only while it points there)"),
    alias_name: str = typer.Argument(..., metavar="ALIAS", help="production, staging, any valid name"),
    delete: bool = typer.Option(False, "--delete", help="remove the alias instead"),
    reason: str = typer.Option("", "--reason", help="why, for the history"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
):
    """Point ALIAS of a model at a version (a rollback is the same: point it back), or remove it; the move
    is recorded in the history and set in MLflow's model registry (where tracking is on), and `serve
    --model NAME@ALIAS` follows it."""
    from workflows import registry, registry_aliases
    from workflows.errors import UserError

    def body(rt):
        name, version = registry.parse_spec(model)
        if "@" in model:
            raise UserError(f"{model!r}: give the version as NAME:VERSION")
        if version is None and not delete:
            raise UserError(f"{model!r}: name the version the alias is to point at, NAME:VERSION")
        expect = version if delete and version is not None else registry_aliases.UNSET
        record = registry.move_alias(rt.cfg, rt.storage, name, alias_name, None if delete else version,
                                     by=f"workflows models alias ({_who()})", reason=reason, expect=expect,
                                     warn=console.warn)
        label = registry_aliases.version_label
        typer.echo(f"{name}@{alias_name}: {label(record.previous)} -> {label(record.version)} (move {record.seq})")

    _in_runtime("models", config, set, body, ray_needed=False)


@models_app.command("history")
def history(
    name: str = typer.Argument(..., help="the model's NAME"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
):
    """The versions of a model with the data, config and code commit that produced each, and every alias
    move (from, to, when, by which run or command, why), in time order."""
    from workflows.registry_history import format_history, model_history

    def body(rt):
        typer.echo(format_history(model_history(rt.cfg, rt.storage, name)))

    _in_runtime("models", config, set, body, ray_needed=False)


def _who() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
