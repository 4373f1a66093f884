"""`workflows` command line: one typed config, `--set a.b=c` overrides on every command."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import typer

from workflows.errors import find_user_error

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ray-based ML workflows: object storage -> Ray Data -> Ray Train/Tune -> Ray Serve.")

DEFAULT_CONFIG = "configs/quickstart.yaml"
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="workflow YAML config")
SetOpt = typer.Option(None, "--set", help="override a config value: --set train.lr=3e-5 (repeatable)")


def _run(fn: Callable[[], object]) -> None:
    try:
        fn()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(130)
    except typer.Exit:
        raise
    except Exception as e:
        ue = find_user_error(e)
        if ue is None:
            raise
        typer.echo(f"error: {ue}", err=True)
        raise typer.Exit(2)


def _in_runtime(config: str, overrides: Optional[List[str]], body: Callable, ray_needed: bool = True) -> None:
    """Load the config, start the runtime (object store, Ray), run `body(rt)`; user errors in one line."""
    def go():
        from workflows.runtime import runtime

        cfg = _load(config, overrides)
        with runtime(cfg, ray_needed=ray_needed) as rt:
            body(rt)
    _run(go)


def _load(config: str, overrides: Optional[List[str]]):
    from workflows.config import load_config

    return load_config(config, overrides or [])


@app.command()
def preprocess(config: str = ConfigOpt, set: Optional[List[str]] = SetOpt):
    """Read raw shards from object storage, tokenize on Ray Data, materialize processed shards."""
    from workflows.pipeline import stage_preprocess

    _in_runtime(config, set, stage_preprocess)


@app.command()
def train(config: str = ConfigOpt, set: Optional[List[str]] = SetOpt,
          resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint of the last run")):
    """Fine-tune with Ray Train (FSDP2 or DDP), checkpoint to object storage, register the best model."""
    from workflows.pipeline import stage_preprocess, stage_train

    _in_runtime(config, set, lambda rt: stage_train(rt, stage_preprocess(rt), resume=resume))


@app.command()
def tune(config: str = ConfigOpt, set: Optional[List[str]] = SetOpt,
         resume: bool = typer.Option(False, "--resume", help="restore an interrupted search")):
    """Search hyperparameters with Ray Tune + ASHA; every trial is a Ray Train run."""
    from workflows.pipeline import stage_preprocess, stage_tune

    _in_runtime(config, set, lambda rt: stage_tune(rt, stage_preprocess(rt), resume=resume))


@app.command()
def evaluate(model: str = typer.Option(..., "--model", "-m", help="NAME[:VERSION] in the registry"),
             data: str = typer.Option(..., "--data", "-d", help="URI of CSV/JSONL/parquet rows with the model's columns"),
             output: Optional[Path] = typer.Option(None, "--output", "-o", help="write the metrics JSON here too"),
             label_column: Optional[str] = typer.Option(None, "--label-column", help="default: the model's"),
             config: str = ConfigOpt, set: Optional[List[str]] = SetOpt):
    """Weighted and per-class precision/recall/F1 of a registered model on any labelled data."""
    from workflows.pipeline import stage_evaluate
    from workflows.preprocess.sources import list_shards, read_dataset

    def body(rt):
        shards, fmt = list_shards(data, rt.storage)
        metrics = stage_evaluate(rt, model, read_dataset(shards, fmt, rt.storage, rt.cfg.cache), label_column)
        result = {"model": model, "data": data, **metrics}
        if output:
            output.parent.mkdir(parents=True, exist_ok=True)
            tmp = output.with_name(output.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, output)
            typer.echo(f"metrics written to {output}", err=True)
        rt.write_summary("evaluate", result)

    _in_runtime(config, set, body)


@app.command()
def serve(model: str = typer.Option(..., "--model", "-m", help="NAME[:VERSION] in the registry (latest by default)"),
          config: str = ConfigOpt, set: Optional[List[str]] = SetOpt,
          block: bool = typer.Option(True, "--block/--no-block", help="keep serving until Ctrl-C / SIGTERM")):
    """Serve a registered model over HTTP with Ray Serve (POST /predict, GET /healthz)."""
    from workflows.pipeline import stage_serve
    from workflows.runtime import say

    def body(rt):
        from ray import serve as ray_serve

        rt.write_summary("serve", stage_serve(rt, model))
        if block:
            stop = {"now": False}
            signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
            say("serve: serving; Ctrl-C to stop")
            try:
                while not stop["now"]:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
            ray_serve.shutdown()

    _in_runtime(config, set, body)


@app.command()
def pipeline(config: str = ConfigOpt, set: Optional[List[str]] = SetOpt):
    """Everything: preprocess -> tune -> train -> evaluate -> register -> serve (serve.enabled)."""
    from workflows.pipeline import run_pipeline

    _in_runtime(config, set, run_pipeline)


@app.command()
def models(config: str = ConfigOpt, set: Optional[List[str]] = SetOpt):
    """List registered models and their versions."""
    from workflows import registry

    def body(rt):
        found = registry.list_models(rt.cfg, rt.storage)
        if not found:
            typer.echo(f"no models registered under {rt.cfg.uri('models')}")
        for name, versions in found.items():
            typer.echo(f"{name}: {', '.join(f'v{v}' for v in versions)}")

    _in_runtime(config, set, body, ray_needed=False)


@app.command()
def bench(name: str = typer.Argument(..., help="benchmark to run (see `workflows bench --help`)"),
          config: Optional[str] = typer.Option(None, "--config", "-c", help="config (default: the benchmark's own)"),
          set: Optional[List[str]] = SetOpt):
    """Run benchmark NAME: writes benchmarks/results/NAME.json and its section of docs/BENCHMARKS.md."""
    def go():
        from workflows.bench import run_benchmark

        run_benchmark(name, config, set or [], sys.argv)
    _run(go)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
