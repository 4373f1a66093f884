"""Serving commands: serve (Ray Serve, its drain on Ctrl-C/SIGTERM, --emit-config) and store (the
embedded S3 endpoint kept up)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from workflows import console, stop
from workflows.cli.common import ConfigOpt, SetOpt, VerboseOpt, _in_runtime, _load, _registered, _run
from workflows.storage.atomic import atomic_write


def serve(
    model: list[str] = typer.Option(
        ...,
        "--model",
        "-m",
        help="NAME[:VERSION] in the registry (latest by default), or NAME@ALIAS: the version the alias holds, "
        "rolled over (Serve's rolling update) whenever the alias moves; "
        "repeat to serve several side by side at /NAME, or /NAME/vN (/NAME/ALIAS) for versions of one name",
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
    from workflows.pipeline.stages import stage_serve
    from workflows.runtime import say

    if emit_config is not None:
        _run(lambda: _emit_config(config, set, model, emit_config))
        return

    def body(rt):
        from workflows.serve import drain
        from workflows.serve.deploy_config import app_name, route_prefixes

        # before the replicas start, so that each finds it (workflows.serve.drain)
        drainer = drain.create() if block else None
        from workflows.serve.follow import follow_aliases

        served = [
            {**stage_serve(rt, spec, route_prefix=prefix, app_name=app_name(spec)), "app_name": app_name(spec),
             "route_prefix": prefix}
            for spec, prefix in route_prefixes(model).items()
        ]

        def summary():
            rt.write_summary("serve", served[0] if len(served) == 1 else {"applications": served}, announce=False)

        rt.write_summary("serve", served[0] if len(served) == 1 else {"applications": served})
        if block:
            _quiet_control_plane(rt.cfg.serve.control_plane_niceness)
            follower = follow_aliases(rt, served, say, on_change=lambda: _rolled_over(served, follower, summary))
            say("serve: serving; Ctrl-C to stop (SIGTERM too)"
                + (f"; following {', '.join(f.spec for f in follower.served)}" if follower else ""))
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt as e:
                if follower is not None:
                    follower.stop()
                _stop_serving(drainer, e)

    def check(cfg, storage):
        _ready_to_serve(cfg)
        _registered(*model)(cfg, storage)

    _in_runtime("serve", config, set, body, before_ray=check, verbose=verbose)


def _emit_config(config: str, set: list[str] | None, model: list[str], path: Path) -> None:
    """Write the Ray Serve config YAML of `model` to `path` and say how to run it."""
    import yaml

    from workflows.serve.deploy_config import serve_config

    cfg = _load(config, set)
    doc = serve_config(cfg, config, set or [], model)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, yaml.safe_dump(doc, sort_keys=False))
    first = "`workflows store` (the embedded store it reads the model from), then " \
        if cfg.storage.embedded.enabled else ""
    typer.echo(f"Serve config for {', '.join(model)} written to {path}; run it with: {first}serve run {path}")
    if cfg.serve.haproxy is not False:  # a Serve config cannot set the cluster's environment
        typer.echo("serve.haproxy: for HAProxy ingress, start the cluster with RAY_SERVE_ENABLE_HA_PROXY=1 "
                   "in its environment (cluster/kuberay/rayservice.yaml does)")


def _rolled_over(served: list[dict], follower, summary) -> None:
    """serve.json again after a rollover: each followed application's version now and its rollovers."""
    for s, f in zip([s for s in served if s.get("served_as")], follower.served):
        s.update(model=f"{f.spec.split('@', 1)[0]}:{f.version}", rollovers=list(f.rollovers))
    summary()


def _quiet_control_plane(niceness: int | None) -> None:
    """The local cluster's own processes below the replicas (workflows.ray_start.quiet_control_plane)."""
    from workflows.ray_start import quiet_control_plane
    from workflows.runtime import say

    if niceness is not None and (quieted := quiet_control_plane(niceness)):
        say(f"serve: {len(quieted)} of Ray's own processes (GCS, dashboard, agents, monitors, Serve's controller) "
            f"at niceness {niceness}, below the replicas (serve.control_plane_niceness)")


def _ready_to_serve(cfg) -> None:
    """Before Ray starts: an open API beyond loopback refused (serve.guards.check_exposure), and serve.port
    free for a cluster this command starts: a stale HAProxy of ours stopped, or its holder named now rather
    than after Ray started (a cluster joined serves on its own port)."""
    from workflows.config.cluster import cluster_address
    from workflows.runtime import say
    from workflows.serve.guards import check_exposure
    from workflows.serve.stale_ingress import free_serve_port

    check_exposure(cfg.serve)
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


def store(config: str = ConfigOpt, set: list[str] | None = SetOpt):
    """Keep the config's embedded S3 endpoint up until Ctrl-C, for what runs outside a `workflows`
    command (`serve run` of an emitted config, a notebook); commands meanwhile use it."""

    from workflows.storage.embedded import check_store_enabled, keep_up

    _in_runtime("store", config, set, lambda rt: keep_up(rt, console.echo), ray_needed=False,
                on_load=check_store_enabled)

