"""`workflows bench serve` while the deployment changes under load: a replica killed, a new model
version rolled out by an alias move, autoscaling from 1 to 2 replicas and back, and scale to zero
and back (the cold start)."""

from __future__ import annotations

import os
import signal
import threading
import time

from workflows.bench.serve_load import LOAD_REQUESTS, load


# -- a replica killed under load --------------------------------------------------------------
def replica_kill(deployed, rows: list[dict]) -> dict:
    from ray.util.state import list_actors

    url = deployed(32, replicas=2)
    load(url, rows, 64, 16)
    record: list = []
    result: dict = {}
    n = LOAD_REQUESTS // 2
    runner = threading.Thread(target=lambda: result.update(load(url, rows, n, 64, record=record)))
    runner.start()
    time.sleep(5)
    replicas: list = []
    deadline = time.time() + 120  # the state API can lag on a busy machine
    while len(replicas) < 2 and time.time() < deadline:
        replicas = [
            a
            for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.startswith("ServeReplica:bench")
        ]
        time.sleep(0.5)
    killed_at = time.perf_counter()
    os.kill(replicas[0].pid, signal.SIGKILL)
    recovery = None
    deadline = killed_at + 120
    while time.perf_counter() < deadline:
        alive = [
            a
            for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.startswith("ServeReplica:bench") and a.pid != replicas[0].pid
        ]
        if len(alive) >= 2:
            recovery = time.perf_counter() - killed_at
            break
        time.sleep(0.5)
    runner.join()
    failed_after = sum(1 for t, ok, _ in record if not ok and t >= killed_at)
    return {
        "requests": result["requests"],
        "failed": result["errors"],
        "failed_after_kill": failed_after,
        "failed_fraction": round(result["errors"] / max(result["requests"], 1), 4),
        "error_kinds": result["error_kinds"],
        "recovery_s": round(recovery, 1) if recovery else None,
        "rps": result["rps"],
    }


# -- a new version rolled out under load, by an alias move ------------------------------------
ROLLOVER_BOUND_S = 60.0  # the stated bound: answers only from the new version this long after the move
BENCH = "workflows bench serve"  # who moves the bench's alias, for its history


def rollout_versions(rt, spec: str) -> tuple:
    """(config, v1, v2): a registry of the bench's own (under <storage.root>/bench-rollout) holding
    `spec` twice as `rollout`, and `rollout@production` on v1, moved as every alias is
    (registry.move_alias: the record, and the alias in MLflow's registry where tracking is on)."""
    from workflows import registry
    from workflows.tracking.stages import session_tracker

    cfg = rt.cfg.model_copy(deep=True)
    cfg.storage.root = f"{rt.cfg.storage.root.rstrip('/')}/bench-rollout"
    cfg.serve.max_batch_size, cfg.serve.num_replicas, cfg.serve.autoscaling = 32, 2, None
    cfg.serve.auth_token_env = None
    local, card = registry.fetch(rt.cfg, rt.storage, spec)
    registered = {"name", "version", "artifact_id", "registered_at"}  # register sets them anew
    lineage = card.model_dump(exclude_unset=True, exclude=registered)
    old, new = (registry.register(cfg, rt.storage, local, "rollout", {**lineage, "copy_of": spec}) for _ in range(2))
    registry.move_alias(cfg, rt.storage, "rollout", "production", old.version, by=BENCH,
                        tracker=session_tracker(rt))
    return cfg, old, new


def rolling_update(rt, spec: str, rows: list[dict], concurrency: int = 32) -> dict:
    """2 replicas serve `rollout@production` (v1) under load at `concurrency`, as `workflows serve
    --model rollout@production` does (its alias follower); the alias is moved to v2 and the follower
    rolls the application over with Serve's rolling update. Measured from the move: the failed
    requests (goal 0), the first answer of v2 and the last of v1 (goal: within ROLLOVER_BOUND_S)."""
    from dataclasses import replace

    from workflows import registry
    from workflows.serve.app import deploy
    from workflows.serve.follow import AliasFollower, Followed
    from workflows.storage.uri import filesystem
    from workflows.tracking.stages import session_tracker

    cfg, old, new = rollout_versions(rt, spec)
    follower = None
    try:
        url = deploy(cfg, f"rollout:{old.version}", name="bench", served_as="rollout@production")
        follower = AliasFollower(replace(rt, cfg=cfg), [Followed("rollout@production", old.version, "bench", "/")],
                                 say=lambda _: None).start()
        load(url, rows, 64, concurrency)  # warm-up
        record: list = []
        result: dict = {}
        stop = threading.Event()
        runner = threading.Thread(target=lambda: result.update(load(url, rows, 10**9, concurrency, stop, record)))
        runner.start()
        time.sleep(5)
        moved = time.perf_counter()
        registry.move_alias(cfg, rt.storage, "rollout", "production", new.version, by=BENCH,
                            reason="the rolling-update measurement", tracker=session_tracker(rt))
        deadline = moved + ROLLOVER_BOUND_S + 60
        while time.perf_counter() < deadline:  # the load goes on until only v2 has answered for 5 s
            now = time.perf_counter()
            recent = [v for t, ok, v in list(record) if t > now - 5]
            if follower.served[0].rollovers and recent and all(v == new.version for v in recent):
                break
            time.sleep(0.5)
        stop.set()
        runner.join()
        rollover = (follower.served[0].rollovers or [{}])[0]
    finally:
        if follower is not None:
            follower.stop()
        fs, path = filesystem(cfg.uri("models"), rt.storage)
        fs.rm(path, recursive=True)
    during = [(t, ok, v) for t, ok, v in record if t >= moved]
    first_new = min((t for t, ok, v in during if v == new.version), default=None)
    last_old = max((t for t, ok, v in during if v == old.version), default=None)
    return {
        "moved_by": "alias rollout@production, followed every serve.alias_poll_s "
                    f"({cfg.serve.alias_poll_s:g} s) by the serving command",
        "requests": result["requests"],
        "failed": result["errors"],
        "error_kinds": result["error_kinds"],
        "failed_during_rollout": sum(1 for _, ok, _ in during if not ok),
        "concurrency": concurrency,
        "from_version": old.version,
        "to_version": new.version,
        "answered_by": {
            f"v{old.version}": sum(1 for *_, v in record if v == old.version),
            f"v{new.version}": sum(1 for *_, v in record if v == new.version),
        },
        "switched": first_new is not None,
        "deploy_s": rollover.get("deploy_seconds"),
        "first_new_version_s": round(first_new - moved, 1) if first_new else None,
        "last_old_version_s": round(last_old - moved, 1) if last_old else None,
        "bound_s": ROLLOVER_BOUND_S,
        "rps": result["rps"],
        "p99_ms": result["p99_ms"],
    }


# -- scale to zero and back -------------------------------------------------------------------
def scale_to_zero(rt, spec: str, rows: list[dict], cycles: int = 8, warm_requests: int = 20) -> dict:
    """`serve.autoscaling.min_replicas: 0`: the deployment goes to zero replicas when idle; each of
    `cycles` times, once it is at zero, one request is sent (it waits for a replica to start and load
    the model: the cold start), then `warm_requests` one after another (warm latency). Goal: every
    request answered 200."""
    import statistics

    import requests
    from ray import serve

    from workflows.config import AutoscalingConfig
    from workflows.serve.app import deploy

    cfg = rt.cfg.model_copy(deep=True)
    cfg.serve.max_batch_size, cfg.serve.auth_token_env = 32, None
    cfg.serve.autoscaling = AutoscalingConfig(min_replicas=0, max_replicas=1, target_ongoing_requests=2,
                                              upscale_delay_s=0, downscale_delay_s=2)

    def running() -> int:
        app = serve.status().applications.get("bench")
        return app.deployments["ModelServer"].replica_states.get("RUNNING", 0) if app else 0

    url = deploy(cfg, spec, name="bench")
    text_cols = [c for c in rows[0] if c != "label"]
    cold: list[float] = []
    warm: list[float] = []
    zero_s: list[float] = []
    failed = 0
    session = requests.Session()
    for i in range(cycles):
        t0 = time.perf_counter()
        while running() > 0 and time.perf_counter() - t0 < 180:
            time.sleep(0.25)
        zero_s.append(time.perf_counter() - t0)
        if running() > 0:
            raise RuntimeError("the deployment did not scale to zero replicas in 180 s")
        for n in range(1 + warm_requests):
            row = rows[(i * (warm_requests + 1) + n) % len(rows)]
            t = time.perf_counter()
            try:
                r = session.post(f"{url}/predict", json={"instances": [{c: row[c] for c in text_cols}]}, timeout=300)
                ok = r.status_code == 200
            except requests.RequestException:
                ok = False
            (cold if n == 0 else warm).append(time.perf_counter() - t)
            failed += not ok

    def pct(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return round(1000 * xs[min(len(xs) - 1, int(p * len(xs)))], 1)

    return {
        **cfg.serve.autoscaling.model_dump(),
        "cycles": cycles,
        "requests": len(cold) + len(warm),
        "failed": failed,
        "to_zero_s_median": round(statistics.median(zero_s[1:] or zero_s), 1),
        "cold_p50_ms": pct(cold, 0.5),
        "cold_p99_ms": pct(cold, 0.99),
        "warm_p50_ms": pct(warm, 0.5),
        "warm_p99_ms": pct(warm, 0.99),
    }


# -- autoscaling under load -------------------------------------------------------------------
def autoscaling(rt, spec: str, rows: list[dict], concurrency: int = 32) -> dict:
    from ray import serve

    from workflows.config import AutoscalingConfig
    from workflows.serve.app import deploy

    cfg = rt.cfg.model_copy(deep=True)
    cfg.serve.max_batch_size, cfg.serve.auth_token_env = 32, None
    cfg.serve.autoscaling = AutoscalingConfig(
        min_replicas=1, max_replicas=2, target_ongoing_requests=8, upscale_delay_s=5, downscale_delay_s=15
    )

    def running() -> int:
        app = serve.status().applications.get("bench")
        return app.deployments["ModelServer"].replica_states.get("RUNNING", 0) if app else 0

    url = deploy(cfg, spec, name="bench")
    load(url, rows, 16, 1)  # warm-up, below the target: still one replica
    record: list = []
    result: dict = {}
    stop = threading.Event()
    runner = threading.Thread(target=lambda: result.update(load(url, rows, 10**9, concurrency, stop, record)))
    started = time.perf_counter()
    runner.start()
    up = None
    while time.perf_counter() - started < 180:
        if running() >= 2:
            up = time.perf_counter() - started
            break
        time.sleep(1)

    def rps(t0: float, t1: float) -> float | None:
        return round(sum(1 for t, ok, _ in list(record) if ok and t0 <= t < t1) / (t1 - t0), 1) if t1 > t0 else None

    one = two = None
    if up is not None:  # one replica: from 3 s into the load until the second runs; two: 20 s after it warmed up
        one = rps(started + 3, started + up)
        time.sleep(25)
        two = rps(time.perf_counter() - 20, time.perf_counter())
    stop.set()
    runner.join()
    stopped = time.perf_counter()
    down = None
    while time.perf_counter() - stopped < 180:
        if running() <= 1:
            down = time.perf_counter() - stopped
            break
        time.sleep(1)
    return {
        **cfg.serve.autoscaling.model_dump(),
        "concurrency": concurrency,
        "requests": result["requests"],
        "errors": result["errors"],
        "error_kinds": result["error_kinds"],
        "scaled_up_s": round(up, 1) if up is not None else None,
        "scaled_down_s": round(down, 1) if down is not None else None,
        "rps_one_replica": one,
        "rps_two_replicas": two,
    }
