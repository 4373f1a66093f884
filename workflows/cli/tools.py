"""Commands around the runs: runs and ui (MLflow), plan (training memory), bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from workflows.cli.common import ConfigOpt, SetOpt, _in_runtime, _load, _run


def runs(config: str = ConfigOpt, set: list[str] | None = SetOpt,
         limit: int = typer.Option(20, "--limit", "-n", min=1, help="newest runs to list"),
         as_json: bool = typer.Option(False, "--json", help="print the runs as JSON")):
    """List recent tracked runs (MLflow): name, status, duration, key metrics; stages under their pipeline."""

    def go():
        from workflows.tracking.commands import format_runs, recent_runs

        found = recent_runs(_load(config, set), limit)
        typer.echo(json.dumps(found, indent=2) if as_json else format_runs(found) if found else "no tracked runs yet")

    _run(go)


def ui(config: str = ConfigOpt, set: list[str] | None = SetOpt,
       host: str = typer.Option("127.0.0.1", "--host", help="address to bind (default: this machine only)"),
       port: int = typer.Option(5000, "--port", min=1, max=65535)):
    """Start the MLflow UI on the configured tracking store (artifacts from the configured object store)."""
    from workflows.runtime import say
    from workflows.tracking.commands import run_ui

    def body(rt):
        code = run_ui(rt, host, port, say)
        if code:
            raise typer.Exit(code)

    _in_runtime("ui", config, set, body, ray_needed=False)


def plan(
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
    device_memory: str | None = typer.Option(
        None,
        "--device-memory",
        help="memory per device, e.g. 80GiB, 40GB (default: this machine's GPU, else 80GiB assumed)",
    ),
    devices: int | None = typer.Option(
        None, "--devices", min=1, help="data-parallel devices (default: train.num_workers)"
    ),
    seq_len: int | None = typer.Option(
        None, "--seq-len", min=1, help="tokens per sequence (default: preprocess.max_length)"
    ),
    micro_batch: int | None = typer.Option(
        None, "--micro-batch", min=1, help="sequences per device and step (default: train.batch_size)"
    ),
    precision: str = typer.Option(
        "auto", "--precision", help="auto (as the trainer: bf16 for FSDP on GPU, else fp32), fp32 or bf16"
    ),
    attention: str = typer.Option(
        "auto", "--attention", help="auto, eager (s x s scores kept) or fused (SDPA flash/memory-efficient)"
    ),
    checkpointing: bool = typer.Option(False, "--activation-checkpointing", help="plan with activation checkpointing"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
):
    """Estimate per-device training memory (DDP vs FSDP), the largest micro-batch that fits, and a strategy."""

    def go():
        from workflows.train.planner import format_plan, plan_from_config

        result = plan_from_config(
            _load(config, set),
            device_memory=device_memory,
            devices=devices,
            seq_len=seq_len,
            micro_batch=micro_batch,
            precision=precision,
            attention=attention,
            checkpointing=checkpointing,
        )
        typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_plan(result))

    _run(go)


def bench(
    name: str = typer.Argument(..., help="benchmark to run: data, train, tune, serve, lm or generate"),
    config: str | None = typer.Option(None, "--config", "-c", help="config (default: the benchmark's own)"),
    set: list[str] | None = SetOpt,
    out: str | None = typer.Option(None, "--out", help="also write what it measured to this JSON file"),
):
    """Run benchmark NAME on your config, cluster and model; print what it measured (JSON)."""

    def go():
        import shlex

        from workflows.bench import run_benchmark
        from workflows.storage.atomic import atomic_write

        command = "workflows " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        text = json.dumps(run_benchmark(name, config, set or [], command), indent=2, sort_keys=True)
        if out:
            atomic_write(Path(out), text)
        typer.echo(text)

    _run(go)

