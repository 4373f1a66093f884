"""serve_openapi_fuzz: a schema-driven fuzzer (schemathesis) against the Serve app's own
/openapi.json. It generates requests from the declared contract (valid ones, and ones that break
it: wrong types, missing fields, extra keys, boundary sizes) to every operation, with and without
the bearer token, for a fixed time (`--max-time`: fuzzing repeats until it is spent), and runs
every check schemathesis has (`--checks all`): no 5xx, a status code the document declares, the
declared content type and response schema, no schema-valid request rejected
(positive_data_acceptance), no schema-violating one accepted or answered outside the statuses that
mean "rejected" (negative_data_rejection: 413 is not one of them), unsupported methods refused.

The app is deployed as serve_hostile_inputs deploys it (an untrained head on the packaged MiniLM,
1 replica, bearer token on), with two text columns (title, description: the "not all blank" rule
spans fields). `injected` = requests sent; `failed` = distinct failures schemathesis reports;
`lost` = requests answered 2xx without the token.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from reliability import make_row
from reliability.serve_hostile import AUTH, TOKEN, TOKEN_ENV, _register_untrained, _wait_healthy

CHECKS = "all"
# seconds of each run (--max-time): with the token, where every check can fail, and without it
SECONDS = {"with token": 150, "without token": 30}
COLUMNS = ("title", "description")
# The statuses that mean "rejected" for a schema-violating request: schemathesis' defaults plus 413,
# the answer to a body over the server's byte limit (1 MiB), which no JSON schema can state: a
# schema-violating body (a string over maxLength) is often over it too. A body the schema rejects
# for its shape or its list length gets 422 (workflows.serve.contract), never 413.
CONFIG = """[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
"""


def serve_openapi_fuzz(workdir: Path, seed: int = 0) -> dict:
    import ray
    from ray import serve

    from reliability.secrets import ROOT
    from tests.helpers import tiny_overrides
    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.serve.app import deploy

    workdir = Path(workdir)
    t_start = time.time()
    os.environ[TOKEN_ENV] = TOKEN  # before Ray starts: replicas inherit the environment
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        *tiny_overrides(workdir), f"serve.auth_token_env={TOKEN_ENV}", "serve.num_replicas=1",
        "serve.max_batch_size=16", "ray.num_cpus=2"])
    runs = {}
    with runtime(cfg) as rt:
        spec = _register_untrained(rt, workdir, COLUMNS)
        url = deploy(rt.cfg, spec, name="reliability-openapi")
        _wait_healthy(rt.cfg.serve.host, rt.cfg.serve.port)
        for name, headers in (("with token", [f"Authorization: {AUTH['Authorization']}"]), ("without token", [])):
            runs[name] = _schemathesis(url, headers, workdir / name.replace(" ", "-"), seed, SECONDS[name])
        serve.delete("reliability-openapi")
        serve.shutdown()
    ray.shutdown()

    sent = sum(r["requests"] for r in runs.values())
    failures = [f"{name}: {f}" for name, r in runs.items() for f in r["failures"]]
    unauthorized_2xx = runs["without token"]["guarded_2xx"]
    detail = (f"schemathesis {_version()} on {url}/openapi.json (model {spec}, text columns {', '.join(COLUMNS)}, "
              f"bearer token on), --checks {CHECKS}, seed {seed}: "
              + "; ".join(f"{name}: {r['seconds']:.0f}s (--max-time {SECONDS[name]}), {r['requests']} requests, "
                          f"answers {r['by_status']}, {len(r['failures'])} failure(s), requests by operation "
                          f"{r['by_operation']}"
                          + (f", generation rounds hypothesis gave up (not server answers): {r['generation_errors']}"
                             if r["generation_errors"] else "")
                          for name, r in runs.items()))
    if failures:
        detail += "; e.g. " + " | ".join(failures[:5])
    return make_row(
        "serve_openapi_fuzz",
        injected=sent,
        survived=sent - len(failures),
        failed=len(failures),
        allowed_failures=0,
        lost=unauthorized_2xx,
        detail=detail,
        seconds=round(time.time() - t_start, 1),
        failures=failures,
        runs=runs,
    )


def _version() -> str:
    from importlib.metadata import version

    return version("schemathesis")


def _schemathesis(url: str, headers: list[str], out: Path, seed: int, seconds: int) -> dict:
    """One `schemathesis run` (in a new process, its CLI as a user runs it); its NDJSON events read back."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.ndjson"
    (out / "schemathesis.toml").write_text(CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(out / "schemathesis.toml"), "run",
           f"{url}/openapi.json", "--checks", CHECKS, "--max-time", str(seconds), "--seed", str(seed),
           "--phases", "examples,coverage,fuzzing", "--report", "ndjson", "--report-ndjson-path", str(events),
           # hypothesis' health check stops fuzzing an operation whose smallest example it finds
           # "too large" (POST /predict: a token and instances): fuzz it anyway; errors still count
           "--suppress-health-check", "data_too_large,too_slow,large_base_example",
           "--no-color", *[a for h in headers for a in ("-H", h)]]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 900, cwd=out)
    took = time.time() - t0
    statuses: dict[str, int] = {}
    guarded_2xx = 0  # 2xx answers from an operation that needs the token (all but /healthz)
    failures: set[str] = set()
    generation_errors: dict[str, int] = {}
    by_operation: dict[str, int] = {}
    examples: list[str] = []  # the first failing requests' bodies, cut short
    # read line by line, then removed: the events hold every request and answer (~1 GB a run)
    for line in _lines(events):
        event = json.loads(line)
        error = event.get("NonFatalError")
        if error:
            kind = (error.get("value") or {}).get("type", "")
            if kind == "FailedHealthCheck":
                # hypothesis gave up generating one round of an operation's cases (its smallest example
                # is "too large"): a generator limit, not an answer of the server; counted and named,
                # beside the operation's request count that shows it was fuzzed all the same
                key = f"{error.get('label', '?')}: {kind}"
                generation_errors[key] = generation_errors.get(key, 0) + 1
            else:  # an operation schemathesis could not test (a bad schema, a crash): not a pass
                failures.add(f"{error.get('label', '?')}: schemathesis error {kind}: {str(error)[:200]}")
        finished = event.get("ScenarioFinished")
        if not finished:
            continue
        rec = finished["recorder"]
        for inter in rec.get("interactions", {}).values():
            code = (inter.get("response") or {}).get("status_code")
            if code is None:  # no answer at all: a dropped connection or a timeout
                failures.add(f"{rec['label']}: no response")
                continue
            statuses[str(code)] = statuses.get(str(code), 0) + 1
            by_operation[rec["label"]] = by_operation.get(rec["label"], 0) + 1
            guarded_2xx += 200 <= code < 300 and "/healthz" not in rec["label"]
        for case_id, checks in rec.get("checks", {}).items():
            for c in checks:
                if c.get("status") == "failure":
                    inter = rec.get("interactions", {}).get(case_id, {})
                    code = (inter.get("response") or {}).get("status_code")
                    what = ((c.get("failure_info") or {}).get("failure") or {})
                    failures.add(f"{rec['label']}: {c['name']} {what.get('code', '')} {what.get('title', '')} "
                                 f"(status {code})")
                    if len(examples) < 5:
                        examples.append(f"{rec['label']} {c['name']} -> {code}: {_body(inter)}")
    requests = sum(statuses.values())
    if res.returncode not in (0, 1) or not requests:  # 1: failures found (reported above)
        failures.add(f"schemathesis exited {res.returncode}: {(res.stdout + res.stderr)[-500:]}")
    return {"requests": requests, "seconds": round(took, 1), "by_status": _by_class(statuses),
            "statuses": statuses, "guarded_2xx": guarded_2xx, "failures": sorted(failures), "examples": examples,
            "by_operation": by_operation, "generation_errors": generation_errors,
            "exit_code": res.returncode, "summary": res.stdout[-1500:]}


def _body(interaction: dict) -> str:
    import base64

    body = (interaction.get("request") or {}).get("body")
    if isinstance(body, dict) and "$base64" in body:
        body = base64.b64decode(body["$base64"]).decode("utf-8", "replace")
    text = str(body)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} chars)"


def _lines(path: Path):
    if not path.exists():
        return
    with open(path) as f:
        yield from f
    path.unlink()


def _by_class(statuses: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for code, n in statuses.items():
        k = f"{code[0]}xx"
        out[k] = out.get(k, 0) + n
    return out
