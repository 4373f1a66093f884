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
            uri, ds = found["uri"], found["data"].read(split, rt.storage, cache=rt.cfg.cache)
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


def models(config: str = ConfigOpt, set: list[str] | None = SetOpt):
    """List registered models and their versions."""
    from workflows import registry

    def body(rt):
        found = registry.list_models(rt.cfg, rt.storage)
        if not found:
            typer.echo(f"no models registered under {rt.cfg.uri('models')}")
        for name, versions in found.items():
            typer.echo(f"{name}: {', '.join(f'v{v}' for v in versions)}")

    _in_runtime("models", config, set, body, ray_needed=False)

