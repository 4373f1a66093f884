"""serve_hostile_images: hostile images sent to a served image classifier, each several times with
valid requests in between; every hostile one must get a 4xx with a one-line JSON {"error": ...},
every valid one a 200 with the right labels, and the same replica must keep serving.

The model is the digits classifier trained here, as the shipped configs/digits.yaml trains it with
the test suite's short settings (tests/conftest.py digits_overrides: 4 epochs) but no tuning, and
registered as `digits` (a text model cannot be used: the image contract is the model's task's). It
is deployed with workflows.serve.app.deploy (1 replica, bearer token on, every request carries it),
and requests go over raw HTTP (http.client), bodies exactly as written.

The hostile cases are those of tests/test_images_e2e.py (not an image, a truncated PNG, zero bytes, a
PNG declaring 50,000x50,000 pixels, wrong and missing Content-Type, invalid base64, 3,000 multipart
parts, a body over the 16 MiB limit) and the same faults in the other body shapes (a bomb, garbage or
a cut PNG as base64 JSON or as a multipart part), Pillow's own decompression-bomb zone, header-only
PNG and JPEG files, a data: URL, 257 instances, and broken multipart bodies. Each is sent REPEATS
times, in sequence, each followed by a valid request (JSON base64, raw image/png and multipart in
turn, scikit-learn's digits 0, 1, 2 -> labels "0", "1", "2") and a GET /healthz; then once more all at
once from 8 threads, mixed with valid requests.

`injected` = hostile requests; `survived` = those answered with their expected 4xx and a one-line
{"error": message}; `failed` = the others (5xx, dropped connection, another status, no or a multi-line
message), valid requests not answered 200, /healthz answers other than 200, and each change seen at a
check (before, after every round, after the threads, at the end): the replica replaced or restarted
(its actor id, PID and restart count from Ray's state API), another PID for Serve's controller, proxy
or haproxy process, or the application not RUNNING with 1 replica (serve.status()); `lost` = a hostile request answered
2xx (a prediction for something that is not a whole image) or a valid request answered 200 with
the wrong labels.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from reliability import make_row
from reliability.serve_common import (
    AUTH,
    TOKEN,
    TOKEN_ENV,
    _patch_frozen_globals,
    _request,
    _wait_healthy,
    frozen_missing_globals,
)
from reliability.serve_hostile_images_cases import hostile_cases, valid_requests

APP = "reliability-hostile-images"
MODEL = "digits"  # registry.name in configs/digits.yaml
REPEATS = 5
THREADS = 8
# Serve's own actors in front of the replica; with HAProxy, the haproxy process HAProxyManager runs too
SERVE_ACTORS = ("ServeController", "ProxyActor", "HAProxyManager")


def serve_hostile_images(workdir: Path, seed: int = 0) -> dict:
    import ray
    from ray import serve

    from reliability import ROOT
    from tests.helpers import free_port
    from workflows.config import load_config
    from workflows.pipeline.stages import stage_preprocess, stage_register, stage_train
    from workflows.runtime import runtime
    from workflows.serve import ingress
    from workflows.serve.app import deploy

    workdir = Path(workdir)
    t_start = time.time()
    os.environ[TOKEN_ENV] = TOKEN  # before Ray starts: replicas inherit the environment
    cfg = load_config(ROOT / "configs" / "digits.yaml", [
        # tests/conftest.py digits_overrides, without the search
        f"storage.embedded.data_dir={workdir}/s3", f"output_dir={workdir}/runs", f"cache.dir={workdir}/cache",
        "train.epochs=4", "tune.enabled=false", "preprocess.concurrency=1", f"serve.port={free_port()}",
        "tracking.enabled=false", f"train.seed={seed}", "ray.num_cpus=2",
        f"serve.auth_token_env={TOKEN_ENV}", "serve.num_replicas=1", "serve.demo_requests=0"])
    frozen = frozen_missing_globals()
    if frozen:  # as serve_hostile_inputs: make it deployable, and count it
        _patch_frozen_globals(frozen)
    valid = valid_requests()
    cases = hostile_cases()
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        ref = stage_register(rt, data, stage_train(rt, data))
        assert ref is not None
        spec = f"{ref.name}:{ref.version}"
        trained_s = time.time() - t_start
        url = deploy(rt.cfg, spec, name=APP)
        front = ingress.describe(rt.cfg)
        host, port = rt.cfg.serve.host, rt.cfg.serve.port
        _wait_healthy(host, port)
        deployed_s = time.time() - t_start - trained_s
        watch = _Watch(APP)
        watch.check("before")
        tally = _Tally(cases, valid)
        for _ in range(3):  # warm-up, and the labels the model gives before anything hostile
            for v in valid:
                tally.valid(v, _send(host, port, v), phase="before")
        k = 0
        for rnd in range(REPEATS):
            for case in cases:
                tally.hostile(case, _send(host, port, case))
                v = valid[k % len(valid)]
                k += 1
                tally.valid(v, _send(host, port, v))
                tally.health(_request(host, port, "GET", "/healthz", None, {})[0])
            watch.check(f"after round {rnd + 1}")
        mixed = [("hostile", c) for c in cases] + [("valid", v) for v in valid * 4]
        random.Random(seed).shuffle(mixed)
        with ThreadPoolExecutor(THREADS) as pool:
            answers = list(pool.map(lambda item: (item, _send(host, port, item[1])), mixed))
        for (kind, req), answer in answers:
            (tally.hostile if kind == "hostile" else tally.valid)(req, answer)
        tally.health(_request(host, port, "GET", "/healthz", None, {})[0])
        watch.check(f"after {len(mixed)} requests from {THREADS} threads")
        for v in valid:  # still the same answers after everything
            tally.valid(v, _send(host, port, v), phase="after")
        watch.check("after")
        serve.delete(APP)
        serve.shutdown()
    ray.shutdown()
    return _row(tally, watch, frozen, url, front, spec, trained_s, deployed_s, t_start)


def _row(tally, watch, frozen, url, front, spec, trained_s, deployed_s, t_start) -> dict:
    hostile_sent = sum(c["sent"] for c in tally.cases.values())
    survived = sum(c["ok"] for c in tally.cases.values())
    hostile_2xx = sum(c["2xx"] for c in tally.cases.values())
    valid_sent = sum(v["sent"] for v in tally.valids.values())
    valid_ok = sum(v["ok"] for v in tally.valids.values())
    valid_failed = sum(v["failed"] for v in tally.valids.values())
    wrong_labels = sum(v["wrong_labels"] for v in tally.valids.values())
    failures = [f"frozen globals: ModelServer.{m} uses {sorted(n)}, undefined in the replica"
                for m, n in frozen.items()]
    failures += tally.failures + watch.failures
    failed = ((hostile_sent - survived - hostile_2xx) + valid_failed + (tally.checks - tally.healthy)
              + watch.events + len(frozen))
    lost = hostile_2xx + wrong_labels
    per_case = "; ".join(f"{name} {c['ok']}/{c['sent']} {c['expect']}" for name, c in tally.cases.items())
    first = watch.first
    detail = (
        f"{hostile_sent} hostile requests ({len(tally.cases)} cases x {REPEATS} in sequence, then once more from "
        f"{THREADS} threads mixed with valid ones) to {url} behind {front} (model {spec}: configs/digits.yaml, "
        f"4 epochs, no search, trained and registered in {trained_s:.0f}s, deployed in {deployed_s:.0f}s; "
        f"1 replica, bearer token on): {survived} answered the expected 4xx with a one-line "
        f'{{"error": ...}}'
        + (f", {hostile_sent - survived} not" if hostile_sent != survived else "")
        + (f" ({hostile_2xx} answered 2xx)" if hostile_2xx else "")
        + f". Valid requests between them (JSON base64, raw image/png, multipart; digits 0, 1, 2): "
        f"{valid_ok}/{valid_sent} answered 200 with the right labels (0, 1, 2; 1 for the raw one; max score "
        f"change from the first answers "
        f"{tally.max_score_delta:.2g}), {wrong_labels} with wrong labels; /healthz {tally.healthy}/{tally.checks} "
        f"200. Replica: actor {first.get('actor_id', '?')[:12]}, PID {first.get('pid')}, "
        + ("the same at every check, 0 restarts, application RUNNING"
           if not watch.failures else f"CHANGED: {'; '.join(watch.failures[:3])}")
        + f" ({len(watch.checks)} checks); in front: {_front(first)}"
        + (", the same PIDs throughout. " if not watch.failures else ". ")
        + f"Per case (expected answers/sent, status): {per_case}"
    )
    if tally.failures:
        detail += "; e.g. " + " | ".join(tally.failures[:6])
    return make_row(
        "serve_hostile_images",
        injected=hostile_sent,
        survived=survived,
        failed=failed,
        allowed_failures=0,
        lost=lost,
        detail=detail,
        seconds=round(time.time() - t_start, 1),
        cases=tally.cases,
        valid=tally.valids,
        health={"checks": tally.checks, "ok": tally.healthy},
        replica={"first": watch.first, "checks": watch.checks},
        failures=failures,
    )


def _front(state: dict) -> str:
    return ", ".join(f"{k} {v if not isinstance(v, list) else '+'.join(map(str, v)) or 'none'}"
                     for k, v in sorted((state.get("front") or {}).items()))


# -- what the server must keep: one replica, the same process, the application running ----------
class _Watch:
    def __init__(self, app: str):
        self.app = app
        self.first: dict = {}
        self.checks: list[dict] = []
        self.failures: list[str] = []  # one entry per event: what changed since the check before
        self.events = 0
        self._seen: set[str] = set()

    def _state(self) -> dict:
        from ray import serve
        from ray.util.state import list_actors

        actors = list_actors(limit=10_000, detail=True, raise_on_missing_output=False)
        replicas = [a for a in actors if a.class_name.startswith(f"ServeReplica:{self.app}:")]
        front = {a.class_name: a.pid for a in actors if a.class_name in SERVE_ACTORS and a.state == "ALIVE"}
        if "HAProxyManager" in front:  # the process that answers HTTP is its haproxy child
            front["haproxy"] = _haproxy_pids(front["HAProxyManager"])
        status = serve.status().applications.get(self.app)
        alive = [a for a in replicas if a.state == "ALIVE"]
        one = alive[0] if len(alive) == 1 else None
        return {
            "replica_actors": len(replicas),  # a replaced replica leaves its dead actor behind
            "alive": len(alive),
            "actor_id": one.actor_id if one else None,
            "pid": one.pid if one else None,
            "restarts": one.num_restarts if one else None,
            "pid_exists": _pid_exists(one.pid) if one else False,
            "front": front,
            "app_status": str(status.status) if status else None,
            "replica_states": ({k: int(v) for k, v in status.deployments["ModelServer"].replica_states.items()}
                               if status and "ModelServer" in status.deployments else None),
        }

    def check(self, when: str) -> None:
        state: dict = {}
        for _ in range(20):  # the state API can lag on a busy machine
            state = self._state()
            if state["alive"] == 1 and "ServeController" in state["front"]:
                break
            time.sleep(1)
        if not self.first:  # the reference: once HAProxy has taken the new backend (it reloads for it)
            for _ in range(15):
                time.sleep(2)
                again = self._state()
                if again == state:
                    break
                state = again
        state["when"] = when
        self.checks.append(state)
        if not self.first:
            self.first = dict(state)
        problems = []
        if state["alive"] != 1 or state["replica_actors"] != 1:
            problems.append(f"{state['alive']} live of {state['replica_actors']} replica actors")
        for key in ("actor_id", "pid"):
            if state[key] != self.first.get(key):
                problems.append(f"replica {key} {self.first.get(key)} -> {state[key]}")
        for name in sorted({*self.first["front"], *state["front"]}):
            if state["front"].get(name) != self.first["front"].get(name):
                problems.append(f"{name} PID {self.first['front'].get(name)} -> {state['front'].get(name)}")
        if state["restarts"] not in (0, None) or not state["pid_exists"]:
            problems.append(f"restarts {state['restarts']}, process {'up' if state['pid_exists'] else 'gone'}")
        if state["app_status"] not in ("RUNNING", "ApplicationStatus.RUNNING") or state["replica_states"] != {
                "RUNNING": 1}:
            problems.append(f"application {state['app_status']}, replicas {state['replica_states']}")
        new = [p for p in problems if p not in self._seen]  # a replacement is one event, not one per check
        self._seen = set(problems)
        if new:
            self.events += 1
            self.failures.append(f"{when}: {'; '.join(new)}")


def _haproxy_pids(manager_pid: int) -> list[int]:
    import psutil

    try:
        return sorted(p.pid for p in psutil.Process(manager_pid).children(recursive=True)
                      if "haproxy" in p.name())
    except psutil.Error:
        return []


def _pid_exists(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# -- counting -----------------------------------------------------------------------------------
class _Tally:
    def __init__(self, cases: list[dict], valid: list[dict]):
        self.cases = {c["name"]: {"expect": c["status"], "sent": 0, "ok": 0, "2xx": 0, "statuses": {},
                                  "message": None} for c in cases}
        self.valids = {v["name"]: {"sent": 0, "ok": 0, "failed": 0, "wrong_labels": 0} for v in valid}
        self.baseline: dict[str, list[dict]] = {}
        self.max_score_delta = 0.0
        self.failures: list[str] = []
        self.checks = self.healthy = 0

    def hostile(self, case: dict, answer) -> None:
        status, body = answer
        c = self.cases[case["name"]]
        c["sent"] += 1
        c["statuses"][str(status)] = c["statuses"].get(str(status), 0) + 1
        why = _hostile_problem(case, status, body)
        if c["message"] is None and isinstance(status, int):
            c["message"] = body[:300].decode("utf-8", "replace")
        if why is None:
            c["ok"] += 1
            return
        if isinstance(status, int) and 200 <= status < 300:
            c["2xx"] += 1
        if len(self.failures) < 50:
            self.failures.append(f"{case['name']}: {why}")

    def valid(self, req: dict, answer, phase: str = "between") -> None:
        status, body = answer
        v = self.valids[req["name"]]
        v["sent"] += 1
        if status != 200:
            v["failed"] += 1
            if len(self.failures) < 50:
                self.failures.append(f"valid {req['name']} ({phase}): {status} {body[:150]!r}")
            return
        try:
            predictions = json.loads(body)["predictions"]
            labels = [p["label"] for p in predictions]
        except (ValueError, KeyError, TypeError):
            labels, predictions = None, []
        if labels != req["labels"]:
            v["wrong_labels"] += 1
            if len(self.failures) < 50:
                self.failures.append(f"valid {req['name']} ({phase}): labels {labels}, expected {req['labels']}")
            return
        v["ok"] += 1
        base = self.baseline.setdefault(req["name"], predictions)
        for p, b in zip(predictions, base):
            self.max_score_delta = max(self.max_score_delta, abs(float(p["score"]) - float(b["score"])))

    def health(self, status) -> None:
        self.checks += 1
        self.healthy += status == 200


def _hostile_problem(case: dict, status, body: bytes) -> str | None:
    """None for the expected 4xx with a one-line {"error": ...} naming what was wrong; else what was not."""
    if isinstance(status, str):
        return f"no answer ({status})"
    if not 400 <= status < 500:
        return f"{status} {body[:150]!r}"
    try:
        doc = json.loads(body)
    except ValueError:
        return f"{status} without a JSON body: {body[:150]!r}"
    message = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(message, str) or not message.strip() or set(doc) != {"error"}:
        return f"{status} without a lone {{\"error\": message}}: {body[:150]!r}"
    if "\n" in message or "\r" in message:
        return f"{status} with a multi-line message: {message[:150]!r}"
    if status != case["status"]:
        return f"{status} (expected {case['status']}): {message[:150]}"
    if case["says"].lower() not in message.lower():
        return f"{status} not saying {case['says']!r}: {message[:150]}"
    return None


def _send(host, port, req: dict):
    headers = {**AUTH, **({"Content-Type": req["content_type"]} if req.get("content_type") else {})}
    return _request(host, port, "POST", "/predict", req["body"], headers)
