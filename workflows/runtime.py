"""What every command runs inside: the object store (embedded endpoint if asked), Ray, summaries."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflows import console, stop
from workflows.cluster_state import cluster_resources
from workflows.config import WorkflowConfig, dump_config
from workflows.config.cluster import cluster_address
from workflows.console import say, warn  # noqa: F401  (say is imported from here by the stages)
from workflows.net import free_port
from workflows.ray_start import shutdown_local, start_local
from workflows.serve import ingress
from workflows.storage import cache_stats
from workflows.storage.atomic import atomic_write
from workflows.storage.embedded import EmbeddedS3
from workflows.storage.uri import StorageContext, bucket_of, check_bucket
from workflows.tasks import check_task, plugin_source

log = logging.getLogger("workflows")


@dataclass
class Runtime:
    cfg: WorkflowConfig
    storage: StorageContext
    embedded: EmbeddedS3 | None = None
    started: float = field(default_factory=time.time)
    tracking: Any = None  # workflows.tracking.session.Tracking of a command that runs stages

    def persist(self) -> None:
        """Stage boundary: make what was produced durable (the embedded store lives in memory)."""
        if self.embedded is not None:
            self.embedded.persist()

    @contextmanager
    def cache_counts(self) -> Iterator[dict]:
        """Shard-cache counters of every read task on the cluster while the block runs
        (hits, misses, bytes from the object store / from cache, evictions)."""
        counts: dict[str, int] = {}
        before = cache_stats.snapshot()
        try:
            yield counts
        finally:
            counts.update(cache_stats.delta(before, cache_stats.snapshot()))
            if counts.get("misses") or counts.get("hits"):
                say(
                    f"shard cache: {counts['hits']} hit(s), {counts['misses']} miss(es), "
                    f"{counts['bytes_from_store']:,} bytes from the object store, "
                    f"{counts['bytes_from_cache']:,} from cache"
                )

    def write_summary(self, stage: str, summary: dict[str, Any], announce: bool = True) -> Path:
        """<output_dir>/<name>/<stage>.json; `announce`: say where (once per summary: a stage that
        adds to one written already, as register to train's, rewrites it quietly)."""
        out_dir = Path(self.cfg.output_dir) / self.cfg.name
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{stage}.json"
        body = {
            "stage": stage,
            "name": self.cfg.name,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **summary,
            "config": dump_config(self.cfg),
        }
        atomic_write(path, json.dumps(body, indent=2, sort_keys=True, default=str))
        if announce:
            say(f"{stage} summary written to {path}")
        return path


def buckets(cfg: WorkflowConfig) -> set[str]:
    """The buckets the embedded store creates: storage.root's, the one it serves; any other bucket (a
    user's data.source) is read from the store it is in (StorageContext.for_uri). With a root on a
    local disk it serves every bucket, as data.source's."""
    root = bucket_of(cfg.storage.root)
    return {root} if root else {b for b in [bucket_of(cfg.data.source)] if b}


def plugin_runtime_env(cfg: WorkflowConfig) -> dict | None:
    """A cluster this process joins has workers that import what their own environment has, not this
    process's PYTHONPATH: a plug-in task's module (model.task) found here goes to them as a runtime
    env's py_modules. Not in a Ray job that brings its own code (`--working-dir`, py_modules: its
    workers have the job's files), nor for a built-in or installed module (workflows.tasks.plugin_source)."""
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("runtime_env") or {}
    if job.get("working_dir") or job.get("py_modules"):
        return None
    source = plugin_source(cfg.model.task)
    return {"py_modules": [source]} if source else None


def init_ray(cfg: WorkflowConfig) -> bool:
    """Start or join Ray; False if this process had already (then it is not ours to shut down)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # Train V2 gives a worker group 60 s to start; on a busy 2-core machine importing torch in
    # each worker can take longer. Workers of a local cluster inherit this from the driver.
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "300")
    # The dashboard stays on unless ray.dashboard=false: Ray Train V2 queries actor state through it.
    kwargs: dict[str, Any] = {"log_to_driver": True, "logging_level": logging.WARNING}
    cluster_env: dict[str, str] = {}
    address = cluster_address(cfg)
    if address:
        kwargs["address"] = address
        if cfg.serve.haproxy is True:
            warn(f"serve.haproxy: the cluster at {address} uses HAProxy only if it was started with "
                 "RAY_SERVE_ENABLE_HA_PROXY=1 in its environment")
    else:
        # "local": a cluster of this command's own. Without it ray.init() would join RAY_ADDRESS's
        # cluster (unset, empty or "local" here, or overridden by ray.address=local) or the one that
        # the last `ray start` on this machine recorded (anyone's), while saying nothing.
        kwargs["address"] = "local"
        # Ray Train ends a run whose workers finished at its controller's next poll of them, every 2 s by
        # default; on one machine a poll costs next to nothing, so each run (the final training, every tune
        # trial) ends sooner. Ray Train hands the driver's value on to its controller.
        os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        console.own_local_cluster()  # Ray's token-authentication line: once per machine, not per command
        # Read by Serve's processes as they start (the cluster's environment) and by serve.run here.
        haproxy = ingress.use_haproxy(cfg.serve)
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1" if haproxy else "0"
        cluster_env = ingress.cluster_env(haproxy)
        if not cfg.ray.dashboard:
            kwargs["include_dashboard"] = False
        if cfg.ray.num_cpus:
            kwargs["num_cpus"] = cfg.ray.num_cpus
    if address and (shipped := plugin_runtime_env(cfg)) is not None:
        kwargs["runtime_env"] = shipped
        say(f"ray: shipping the plug-in task's module {shipped['py_modules'][0]} to the cluster's workers")

    def start() -> Any:
        if not address and cfg.ray.dashboard:
            # A second local cluster on this machine (a test suite, another command) must not lose
            # its dashboard to a port conflict: Ray Train V2 needs the state API it serves.
            kwargs["dashboard_port"] = _port_or_free(dashboard_port(cfg))
            # Ray's state API (Train V2's placement-group cleaner asks it whether a controller is
            # alive) finds the dashboard by auto-detection, which fails once a machine runs two
            # clusters: the cleaner then never frees a dead trial's resources. Workers inherit this.
            os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{kwargs['dashboard_port']}"
        with ingress.scoped_env(cluster_env):
            return ray.init(**kwargs)

    info = start() if address else start_local(start)
    stop.install()  # ray.init replaced the SIGTERM handler with one that exits wherever it lands
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    resources = cluster_resources()
    where = f"joined {address}" if address else "started a local cluster"
    say(
        f"ray: {where}, {resources.get('CPU', 0):g} CPU(s), {resources.get('GPU', 0):g} GPU(s); "
        f"dashboard {_http(info.dashboard_url) if info.dashboard_url else 'off'}"
    )
    _warn_missing_gpus(cfg, resources.get("GPU", 0))
    return True


def _http(url: str) -> str:
    return url if "://" in url else f"http://{url}"  # Ray gives host:port; a terminal links a URL


def _warn_missing_gpus(cfg: WorkflowConfig, gpus: float) -> None:
    """A GPU asked for and absent makes Ray wait for it (an autoscaler may add one): say so at once."""
    asked = [
        k
        for k, on in (("train.use_gpu", cfg.train.use_gpu), ("serve.gpus_per_replica", cfg.serve.gpus_per_replica))
        if on
    ]
    if asked and not gpus:
        warn(f"{' and '.join(asked)} {'asks' if len(asked) == 1 else 'ask'} for GPUs, but the Ray cluster has none")


def dashboard_port(cfg: WorkflowConfig | None = None) -> int:
    """The port a local cluster's dashboard prefers: ray.dashboard_port, else $WORKFLOWS_DASHBOARD_PORT,
    else Ray's 8265 (0: any free port; the test suite's parallel workers set the variable, so that two
    commands starting Ray at once never both pick 8265, one of them then starting without the
    dashboard that Ray Train needs)."""
    if cfg is not None and cfg.ray.dashboard_port is not None:
        return cfg.ray.dashboard_port
    return int(os.environ.get("WORKFLOWS_DASHBOARD_PORT") or 8265)


def _port_or_free(port: int) -> int:
    """`port` if it is free on 127.0.0.1, else one the OS picks (tests/conftest.py imports this name)."""
    return free_port(preferred=port)


@contextmanager
def runtime(
    cfg: WorkflowConfig, ray_needed: bool = True, before_ray: Callable[[StorageContext], object] | None = None
) -> Iterator[Runtime]:
    """The object store (embedded endpoint if configured), then Ray. `before_ray(storage)` runs in
    between: checks that need only the store (a model that is not registered, an output that is
    not empty) fail in a second instead of after Ray has started."""
    check_task(cfg)  # a plug-in that does not import stops here, before the store or Ray starts
    embedded, started_ray, outside = None, False, None
    if cfg.storage.embedded.enabled:
        e = cfg.storage.embedded
        embedded = EmbeddedS3(e.data_dir, e.host, e.port)
        outside = cfg.storage.endpoint_url  # where buckets other than the embedded store's are
        # a new config that points at the endpoint (Runtime.cfg): the caller's stays as it was loaded
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"endpoint_url": embedded.start()})})
        for bucket in sorted(buckets(cfg)):
            embedded.ensure_bucket(bucket)
        say(f"embedded S3 endpoint {cfg.storage.endpoint_url} (persisted in {embedded.data_dir})")
    tracking = None
    try:
        storage = StorageContext.from_config(cfg.storage)
        if embedded is not None:
            storage = storage.outside(outside)
        check_bucket(cfg.storage.root, storage)
        if before_ray is not None:
            before_ray(storage)
        if ray_needed and cfg.tracking.enabled:
            from workflows.tracking.session import Tracking

            tracking = Tracking(cfg, storage, warn)  # opens the store while Ray starts
        if ray_needed:
            started_ray = init_ray(cfg)
        yield Runtime(cfg, storage, embedded, tracking=tracking)
    finally:
        if tracking is not None:
            tracking.close()  # before the embedded endpoint stops: artifacts may still be uploading
        if started_ray:  # now, not at interpreter exit: a stopped command's Ray is gone when it exits
            shutdown_local()  # and what of a local cluster outlives ray.shutdown (workflows.ray_start)
        if embedded is not None:
            embedded.stop()
