"""`workflows` command line: one typed config, `--set a.b=c` overrides on every command."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import typer

from workflows import console, stop
from workflows.errors import UserError, find_user_error
from workflows.overrides import named_after_model
from workflows.storage.atomic import atomic_write

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Ray-based ML workflows: object storage -> Ray Data -> Ray Train/Tune -> Ray Serve.")

DEFAULT_CONFIG = "quickstart"
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c",
                         help="a workflow YAML file, or a shipped config by name: quickstart, madewithml")
SetOpt = typer.Option(None, "--set", help="override a config value: --set train.lr=3e-5 (repeatable)")
VerboseOpt = typer.Option(False, "--verbose", "-v", envvar="WORKFLOWS_VERBOSE",
                          help="show Ray's logs and progress here instead of only in the run's log file")


def _run(fn: Callable[[], object]) -> None:
    """User errors in one line (exit 2). Once Ray's output goes to a log file, any failure also
    shows the log's last lines, and an unexpected exception's traceback goes into the log (exit 1).
    SIGTERM/SIGINT: what was started is shut down, one line, exit 143/130 (workflows.stop)."""
    stop.install()
    try:
        fn()
    except KeyboardInterrupt as e:
        log = console.active_log()
        console.echo(f"stopped by {stop.signal_name(e)}" + (f"; Ray's output is in {log.path}" if log else ""))
        raise typer.Exit(stop.exit_code(e)) from None
    except typer.Exit:
        raise
    except Exception as e:
        ue, log = find_user_error(e), console.active_log()
        if ue is None:
            if log is None:
                raise
            log.log_exception()
        console.echo(f"error: {ue if ue is not None else _one_line(e)}")
        console.show_log_tail()
        raise typer.Exit(2 if ue is not None else 1) from e
    finally:
        if (log := console.active_log()) is not None:
            log.finish()


def _one_line(e: BaseException) -> str:
    first = next((ln for ln in console.strip_ansi(str(e)).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def _in_runtime(command: str, config: str, overrides: list[str] | None, body: Callable, ray_needed: bool = True,
                before_ray: Callable | None = None, verbose: bool = False,
                on_load: Callable | None = None) -> None:
    """Load the config, start the runtime (object store, Ray), run `body(rt)`; user errors in one line.
    `on_load(cfg)` checks the config before anything starts; `before_ray(cfg, storage)` checks
    what needs only the object store before Ray starts. Unless
    `verbose`, everything written to fds 1/2 from Ray's start on goes to
    `<output_dir>/<name>/logs/<command>-<time>.log` (workflows.console)."""
    def go():
        from workflows.runtime import runtime

        cfg = _load(config, overrides)
        if on_load is not None:
            on_load(cfg)

        def check(storage):
            if before_ray is not None:
                before_ray(cfg, storage)
            if ray_needed and not verbose:
                console.capture(Path(cfg.output_dir) / cfg.name / "logs", command)

        with runtime(cfg, ray_needed=ray_needed, before_ray=check) as rt:
            body(rt)
    _run(go)


def _registered(*specs: str) -> Callable:
    """A before_ray check: every model spec names a registered version whose task may be imported."""
    def check(cfg, storage):
        from workflows import registry
        from workflows.tasks import check_card_task

        for spec in specs:
            check_card_task(cfg, registry.model_card(cfg, storage, spec))
    return check


def _task_ready(cfg) -> None:
    """An on_load check: the config's task imports and takes its model.options (before the store starts)."""
    from workflows.tasks import get_task

    get_task(cfg).check_config()


def _load(config: str, overrides: list[str] | None):
    from workflows.config import load_config

    return load_config(config, overrides or [])


@app.command()
def preprocess(config: str = ConfigOpt, set: list[str] | None = SetOpt, verbose: bool = VerboseOpt):
    """Read raw shards from object storage, tokenize on Ray Data, materialize processed shards."""
    from workflows.pipeline import stage_preprocess

    _in_runtime("preprocess", config, set, stage_preprocess, verbose=verbose,
                on_load=_task_ready)


@app.command()
def train(config: str = ConfigOpt, set: list[str] | None = SetOpt,
          resume: bool = typer.Option(False, "--resume", help="continue from the latest checkpoint of the last run"),
          verbose: bool = VerboseOpt):
    """Fine-tune with Ray Train (FSDP2 or DDP), checkpoint to object storage, register the best model."""
    from workflows.pipeline import stage_preprocess, stage_train

    _in_runtime("train", config, set, lambda rt: stage_train(rt, stage_preprocess(rt), resume=resume), verbose=verbose,
                on_load=_task_ready)


@app.command()
def tune(config: str = ConfigOpt, set: list[str] | None = SetOpt,
         resume: bool = typer.Option(False, "--resume", help="restore an interrupted search"),
         verbose: bool = VerboseOpt):
    """Search hyperparameters with Ray Tune + ASHA; every trial is a Ray Train run."""
    from workflows.pipeline import stage_preprocess, stage_tune

    _in_runtime("tune", config, set, lambda rt: stage_tune(rt, stage_preprocess(rt), resume=resume), verbose=verbose,
                on_load=_task_ready)


@app.command()
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
    from workflows.pipeline import stage_evaluate
    from workflows.preprocess.sources import list_shards, read_dataset

    if (data is None) == (split is None):
        console.echo("error: give exactly one of --data URI and --split train|val|test")
        raise typer.Exit(2)
    found: dict = {}  # --split: what model_split read from the store before Ray started

    def check(cfg, storage):
        if split is None:
            _registered(model)(cfg, storage)
        else:
            from workflows.pipeline import model_split

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


@app.command()
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


@app.command()
def serve(
    model: list[str] = typer.Option(
        ...,
        "--model",
        "-m",
        help="NAME[:VERSION] in the registry (latest by default); "
        "repeat to serve several side by side at /NAME, or /NAME/vN for versions of one name",
    ),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
    block: bool = typer.Option(True, "--block/--no-block", help="keep serving until Ctrl-C / SIGTERM"),
    emit_config: Path | None = typer.Option(
        None,
        "--emit-config",
        help="write a Ray Serve config YAML (for `serve run FILE`, `serve deploy FILE`, a RayService) and exit",
    ),
    verbose: bool = VerboseOpt,
):
    """Serve registered models over HTTP with Ray Serve (POST /predict, GET /healthz, /docs)."""
    from workflows.pipeline import stage_serve
    from workflows.runtime import say

    if emit_config is not None:

        def write():
            import yaml

            from workflows.serve.deploy_config import serve_config

            cfg = _load(config, set)
            doc = serve_config(cfg, config, set or [], model)
            emit_config.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(emit_config, yaml.safe_dump(doc, sort_keys=False))
            first = "`workflows store` (the embedded store it reads the model from), then " \
                if cfg.storage.embedded.enabled else ""
            typer.echo(
                f"Serve config for {', '.join(model)} written to {emit_config}; run it with: {first}"
                f"serve run {emit_config}"
            )
            if cfg.serve.haproxy is not False:  # a Serve config cannot set the cluster's environment
                typer.echo("serve.haproxy: for HAProxy ingress, start the cluster with RAY_SERVE_ENABLE_HA_PROXY=1 "
                           "in its environment (cluster/kuberay/rayservice.yaml does)")

        _run(write)
        return

    def body(rt):
        from workflows.serve import drain
        from workflows.serve.deploy_config import app_name, route_prefixes

        # before the replicas start, so that each finds it (workflows.serve.drain)
        drainer = drain.create() if block else None
        served = [
            stage_serve(rt, spec, route_prefix=prefix, app_name=app_name(spec))
            for spec, prefix in route_prefixes(model).items()
        ]
        rt.write_summary("serve", served[0] if len(served) == 1 else {"applications": served})
        if block:
            say("serve: serving; Ctrl-C to stop (SIGTERM too)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt as e:
                _stop_serving(drainer, e)

    def check(cfg, storage):
        _registered(*model)(cfg, storage)
        _serve_port_free(cfg)

    _in_runtime("serve", config, set, body, before_ray=check, verbose=verbose)


def _serve_port_free(cfg) -> None:
    """A cluster this command starts must bind serve.port: free it of a stale HAProxy of ours, or
    name its holder now rather than after Ray started (a cluster joined serves on its own port)."""
    from workflows.runtime import cluster_address, say
    from workflows.serve.stale_ingress import free_serve_port

    if cluster_address(cfg) is None:
        free_serve_port(cfg.serve.host, cfg.serve.port, say)


def _stop_serving(drainer, signal: KeyboardInterrupt) -> None:
    """Drain (in-flight requests answered, new ones 503), shut Serve down; Ray stops with the runtime.
    Exit 0 for Ctrl-C, the usual way to stop a server, 143 for SIGTERM."""
    from ray import serve as ray_serve

    from workflows.runtime import say
    from workflows.serve import drain

    t0 = time.time()
    drained = drain.drain(drainer)
    # serve.shutdown() waits for Serve's controller, which behind HAProxy waits for each replica's
    # deregistration window (Ray's 30 s on a cluster we joined, 2 s on ours: workflows.serve.ingress):
    # give it 15 s (the client's own timeout; serve.shutdown has none), then Ray's shutdown ends the rest.
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is not None:
        client.shutdown(timeout_s=15)
    ray_serve.shutdown()
    say(f"serve: stopped by {stop.signal_name(signal)} in {time.time() - t0:.1f}s: "
        f"{drained['in_flight_answered']} request(s) in flight answered, new ones answered 503 meanwhile"
        + (f"; not drained first ({drained['error']})" if drained.get("error") else "")
        + ("" if drained["drained"] == drained["replicas"] else
           f"; {drained['replicas'] - drained['drained']} replica(s) had not drained after {drained['seconds']}s"))
    code = stop.exit_code(signal)
    raise typer.Exit(0 if code == 130 else code)


@app.command()
def store(config: str = ConfigOpt, set: list[str] | None = SetOpt):
    """Keep the config's embedded S3 endpoint up until Ctrl-C, for what runs outside a `workflows`
    command (`serve run` of an emitted config, a notebook); commands meanwhile use it."""

    from workflows.storage.embedded import check_store_enabled, keep_up

    _in_runtime("store", config, set, lambda rt: keep_up(rt, console.echo), ray_needed=False,
                on_load=check_store_enabled)


@app.command()
def pipeline(config: str = ConfigOpt, set: list[str] | None = SetOpt, verbose: bool = VerboseOpt):
    """Everything: preprocess -> tune -> train -> evaluate -> register -> serve (serve.enabled)."""
    from workflows.pipeline import run_pipeline

    def check(cfg, storage):
        if cfg.serve.enabled:
            _serve_port_free(cfg)

    _in_runtime("pipeline", config, set, run_pipeline, verbose=verbose, before_ray=check, on_load=_task_ready)


@app.command()
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


@app.command()
def runs(config: str = ConfigOpt, set: list[str] | None = SetOpt,
         limit: int = typer.Option(20, "--limit", "-n", min=1, help="newest runs to list"),
         as_json: bool = typer.Option(False, "--json", help="print the runs as JSON")):
    """List recent tracked runs (MLflow): name, status, duration, key metrics; stages under their pipeline."""

    def go():
        from workflows.tracking.commands import format_runs, recent_runs

        found = recent_runs(_load(config, set), limit)
        typer.echo(json.dumps(found, indent=2) if as_json else format_runs(found) if found else "no tracked runs yet")

    _run(go)


@app.command()
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


@app.command()
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


data_app = typer.Typer(no_args_is_help=True, help="Data sets: make synthetic ones for tests and benchmarks.")
app.add_typer(data_app, name="data")


@data_app.command("synth-images")
def synth_images(
    out: str = typer.Option(..., "--out", help="where the shards go: s3://bucket/prefix (the configured endpoint), "
                            "file:// or a local path"),
    size: str = typer.Option("1GB", "--size", help="total size of the shards: 1GB, 500MB, 27GB, 20GiB"),
    classes: int = typer.Option(100, "--classes", min=1, help="number of classes (labels 0..N-1)"),
    seed: int = typer.Option(0, "--seed", help="the same seed writes the same images"),
    shard_bytes: str = typer.Option("128MB", "--shard-bytes", help="size of one tar shard"),
    workers: int | None = typer.Option(None, "--workers", min=1, help="processes painting images (default: CPUs)"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
):
    """Write an ImageNet-like set (about 400x350 photo-like JPEGs of 80-150 KB, N classes) as WebDataset
    tar shards plus index.json under OUT."""
    from workflows.preprocess.synth_images import SynthSpec, parse_size
    from workflows.preprocess.synth_images import synth_images as write_set

    def body(rt):
        spec = SynthSpec(classes=classes, seed=seed, shard_bytes=parse_size(shard_bytes, "--shard-bytes"))
        t0 = time.perf_counter()
        index = write_set(out, parse_size(size), rt.storage, spec, workers, say=console.echo)
        n, total = sum(s["samples"] for s in index["shards"]), sum(s["bytes"] for s in index["shards"])
        console.echo(f"synth-images: {n} images in {len(index['shards'])} shards, {total / 1e9:.2f} GB, "
                     f"{classes} classes, under {out.rstrip('/')}/ in {time.perf_counter() - t0:.1f}s")

    try:  # a bad size fails in one line before any store starts
        parse_size(size), parse_size(shard_bytes, "--shard-bytes")
    except UserError as e:
        console.echo(f"error: {e}")
        raise typer.Exit(2) from None
    _in_runtime("data", config, set, body, ray_needed=False)


@app.command()
def bench(
    name: str = typer.Argument(..., help="benchmark to run (see `workflows bench --help`)"),
    config: str | None = typer.Option(None, "--config", "-c", help="config (default: the benchmark's own)"),
    set: list[str] | None = SetOpt,
    tag: str | None = typer.Option(None, "--tag", help="a variant: results in NAME-TAG.json, its own doc section"),
    results_dir: str = typer.Option("benchmarks/results", "--results-dir", help="directory for the results JSON"),
    doc: str = typer.Option("docs/BENCHMARKS.md", "--doc", help="markdown file whose bench section is rewritten"),
    render_only: bool = typer.Option(False, "--render", help="run nothing: rewrite NAME's sections (NAME 'all': "
                                     "every one) of --doc from the results stored in --results-dir"),
):
    """Run benchmark NAME: writes RESULTS_DIR/NAME[-TAG].json and its section of the --doc file."""

    def go():
        from workflows.bench import render, run_benchmark

        if render_only:
            paths = render(name, results_dir, doc)
            print(f"{doc} rewritten from {len(paths)} result file(s) in {results_dir}")
        else:
            run_benchmark(name, config, set or [], sys.argv, tag=tag, results_dir=results_dir, doc=doc)

    _run(go)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
