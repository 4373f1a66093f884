"""serve_openapi_fuzz: a schema-driven fuzzer (schemathesis) against the Serve app's own
/openapi.json, for a text model and for an image model (its POST /predict takes JSON base64, a raw
image body and multipart files: one operation, three request bodies). It generates requests from the
declared contract (valid ones, and ones that break it: wrong types, missing fields, extra keys,
boundary sizes) to every operation, with and without the bearer token, for a fixed time
(`--max-time`: fuzzing repeats until it is spent), and runs every check schemathesis has
(`--checks all`): no 5xx, a status code the document declares, the declared content type and
response schema, no schema-valid request rejected (positive_data_acceptance), no schema-violating
one accepted or answered outside the statuses that mean "rejected" (negative_data_rejection: 413 is
not one of them), unsupported methods refused.

Each model is deployed as serve_hostile_inputs deploys it (an untrained model, 1 replica, bearer token
on): the packaged MiniLM with two text columns (title, description: the "not all blank" rule spans
fields), and a small untrained CNN (configs/digits.yaml's architecture). Accepted, and counted apart
(`accepted`), are only the answers the serve guide decides and no schema can state: 413 for a
schema-valid body over the byte limit, and for the image model 422 "not an image" for a schema-valid
body of random bytes (reliability/schemathesis_images.py gives the positive JSON cases' images real
pixels; raw and multipart bodies, and the coverage phase's base64, are sent as generated). Every other check
failure is a finding, and so is an app whose POST /predict got under a third of a run's requests
(the fuzzer not reaching the main route; with the token: without it, every POST /predict is a 401
before its body is read). `injected` = requests sent; `failed` = distinct findings;
`lost` = requests answered 2xx without the token.

The document itself is behind the token (workflows.serve.app.TokenGuard): it is read once with it
and fuzzed from the file. FastAPI's own routes (/openapi.json, /docs, /redoc) are no operations of
the document, so schemathesis never calls them: tests/test_serve_auth.py fuzzes every route of the
app, those included.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from reliability import make_row
from reliability.serve_common import AUTH, TOKEN, TOKEN_ENV, _register_untrained, _wait_healthy

CHECKS = "all"
# seconds of each run (--max-time), per app: with the token, where every check can fail, and without it
SECONDS = {"with token": 120, "without token": 25}
COLUMNS = ("title", "description")
IMAGE_MODEL, IMAGE_SIZE = "hostile-images", 32
# The share of a run's requests that must go to POST /predict (the route users call).
MIN_PREDICT_SHARE = 1 / 3
PREDICT = "POST /predict"
# What the server answers a schema-valid image body of random bytes (workflows.tasks.image.ImageContract)
NOT_AN_IMAGE = re.compile(r"instances\[\d+\]: not an image \(cannot identify image file\)")
# The statuses that mean "rejected" for a schema-violating request: schemathesis' defaults plus 413,
# the answer to a body over the server's byte limit, which no JSON schema can state: a
# schema-violating body (a string over maxLength) is often over it too. A body the schema rejects
# for its shape or its list length gets 422 (workflows.tasks.contract), never 413.
CONFIG = """[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
"""


def serve_openapi_fuzz(workdir: Path, seed: int = 0) -> dict:
    import ray
    import requests
    from ray import serve

    from reliability import ROOT
    from tests.helpers import tiny_overrides
    from workflows.config import load_config
    from workflows.runtime import runtime
    from workflows.serve.app import deploy
    from workflows.tasks.contract import MAX_BODY_BYTES
    from workflows.tasks.image import IMAGE_MAX_BODY_BYTES

    workdir = Path(workdir)
    t_start = time.time()
    os.environ[TOKEN_ENV] = TOKEN  # before Ray starts: replicas inherit the environment
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        *tiny_overrides(workdir), f"serve.auth_token_env={TOKEN_ENV}", "serve.num_replicas=1",
        "serve.max_batch_size=16", "ray.num_cpus=2"])
    runs, models = {}, {}
    with runtime(cfg) as rt:
        apps = (("text", _register_untrained(rt, workdir, COLUMNS), MAX_BODY_BYTES),
                ("image", _register_untrained_image(rt, workdir), IMAGE_MAX_BODY_BYTES))
        for app, spec, limit in apps:  # one at a time, each at the root the document's paths name
            url = deploy(rt.cfg, spec, name=f"reliability-openapi-{app}")
            _wait_healthy(rt.cfg.serve.host, rt.cfg.serve.port)
            models[app] = spec
            # the document is behind the token too: read once with it, then fuzzed with and without
            schema = workdir / f"{app}-openapi.json"
            schema.write_bytes(requests.get(f"{url}/openapi.json", headers=AUTH, timeout=30).content)
            for name, headers in (("with token", [f"Authorization: {AUTH['Authorization']}"]),
                                  ("without token", [])):
                runs[f"{app} {name}"] = _schemathesis(url, schema, headers,
                                                      workdir / f"{app}-{name.replace(' ', '-')}",
                                                      seed, SECONDS[name], limit, image=app == "image")
            serve.delete(f"reliability-openapi-{app}")
        serve.shutdown()
    ray.shutdown()

    sent = sum(r["requests"] for r in runs.values())
    failures = [f"{name}: {f}" for name, r in runs.items() for f in r["failures"]]
    unauthorized_2xx = sum(r["guarded_2xx"] for name, r in runs.items() if name.endswith("without token"))
    detail = (f"schemathesis {_version()} on {url}/openapi.json (text model {models['text']}, columns "
              f"{', '.join(COLUMNS)}; image model {models['image']}, {IMAGE_SIZE}px; bearer token on), --checks "
              f"{CHECKS}, seed {seed}: "
              + "; ".join(f"{name}: {r['seconds']:.0f}s (--max-time {r['max_time']}), {r['requests']} requests "
                          f"({r['predict_share']:.0%} to {PREDICT}), by operation {r['by_operation']}"
                          + (f", by body {r['by_media_type']}" if name.startswith("image") else "")
                          + f", answers {r['by_status']}, {len(r['failures'])} finding(s)"
                          + (f", accepted {r['accepted']}" if r["accepted"] else "")
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


def _register_untrained_image(rt, workdir: Path) -> str:
    """configs/digits.yaml's small CNN, untrained, exported and registered as ImageClassification.export does."""
    from transformers import AutoModelForImageClassification

    from workflows import registry
    from workflows.preprocess.images import IMAGENET_MEAN, IMAGENET_STD
    from workflows.tasks.image.models import ARCHITECTURES, _with_labels

    labels = ["0", "1", "2"]
    out = workdir / "image-artifact"
    out.mkdir(parents=True, exist_ok=True)
    config = _with_labels(ARCHITECTURES["small_cnn"](IMAGE_SIZE), labels)
    AutoModelForImageClassification.from_config(config).save_pretrained(str(out), safe_serialization=True)
    meta = {"task": "image_classification", "labels": labels, "label_column": "label", "image_size": IMAGE_SIZE,
            "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD),
            "lineage": {"note": "untrained, for reliability"}}
    (out / "workflows.json").write_text(json.dumps(meta))
    ref = registry.register(rt.cfg, rt.storage, str(out), IMAGE_MODEL, meta)
    rt.persist()
    return f"{ref.name}:{ref.version}"


def _version() -> str:
    from importlib.metadata import version

    return version("schemathesis")


def _schemathesis(url: str, schema: Path, headers: list[str], out: Path, seed: int, seconds: int, max_body_bytes: int,
                  image: bool = False) -> dict:
    """One `schemathesis run` of the document in `schema` against the server at `url` (in a new
    process, its CLI as a user runs it); its NDJSON events read back."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.ndjson"
    (out / "schemathesis.toml").write_text(CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(out / "schemathesis.toml"), "run",
           str(schema.resolve()), "--url", url, "--checks", CHECKS, "--max-time", str(seconds), "--seed", str(seed),
           "--phases", "examples,coverage,fuzzing", "--report", "ndjson", "--report-ndjson-path", str(events),
           # hypothesis' health check stops fuzzing an operation whose smallest example it finds
           # "too large" (POST /predict: a token and instances): fuzz it anyway; errors still count
           "--suppress-health-check", "data_too_large,too_slow,large_base_example",
           # on past a failing case: the accepted answers are told apart below, case by case
           "--continue-on-failure",
           "--no-color", *[a for h in headers for a in ("-H", h)]]
    env = {**os.environ, **({"SCHEMATHESIS_HOOKS": "reliability.schemathesis_images"} if image else {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 900, cwd=out, env=env)
    took = time.time() - t0
    statuses: dict[str, int] = {}
    guarded_2xx = 0  # 2xx answers from an operation that needs the token (all but /healthz)
    failures: set[str] = set()
    accepted: dict[str, int] = {}
    generation_errors: dict[str, int] = {}
    by_operation: dict[str, int] = {}
    by_media_type: dict[str, int] = {}  # POST /predict's requests by Content-Type
    examples: list[str] = []  # the first failing requests' bodies, cut short
    # read line by line, then removed: the events hold every request and answer (~1 GB a run)
    for line in _lines(events):
        event = json.loads(line)
        error = event.get("NonFatalError")
        if error:
            kind = (error.get("value") or {}).get("type", "")
            if kind == "FailedHealthCheck":
                # hypothesis gave up generating one round of an operation's cases: a generator limit,
                # not an answer of the server; counted and named (POST /predict's share shows its cost)
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
            if rec["label"] == PREDICT:
                media = _header(inter.get("request") or {}, "content-type").split(";")[0].strip() or "(none)"
                by_media_type[media] = by_media_type.get(media, 0) + 1
            guarded_2xx += 200 <= code < 300 and "/healthz" not in rec["label"]
        for case_id, checks in rec.get("checks", {}).items():
            for c in checks:
                if c.get("status") != "failure":
                    continue
                inter = rec.get("interactions", {}).get(case_id, {})
                code = (inter.get("response") or {}).get("status_code")
                why = _accepted(c["name"], code, inter, max_body_bytes, image)
                if why:
                    accepted[why] = accepted.get(why, 0) + 1
                    continue
                what = ((c.get("failure_info") or {}).get("failure") or {})
                failures.add(f"{rec['label']}: {c['name']} {what.get('code', '')} {what.get('title', '')} "
                             f"(status {code})")
                if len(examples) < 5:
                    examples.append(f"{rec['label']} {c['name']} -> {code}: {_body(inter)}")
    requests = sum(statuses.values())
    if res.returncode not in (0, 1) or not requests:  # 1: failures found (told apart above)
        failures.add(f"schemathesis exited {res.returncode}: {(res.stdout + res.stderr)[-500:]}")
    share = by_operation.get(PREDICT, 0) / requests if requests else 0.0
    # with the token only: without it every POST /predict is a 401 before its body is read
    if headers and share < MIN_PREDICT_SHARE:
        failures.add(f"{PREDICT} got {by_operation.get(PREDICT, 0)} of {requests} requests ({share:.0%}; "
                     f"at least {MIN_PREDICT_SHARE:.0%} wanted): the fuzzer barely reached the main route")
    return {"requests": requests, "seconds": round(took, 1), "max_time": seconds, "by_status": _by_class(statuses),
            "statuses": statuses, "guarded_2xx": guarded_2xx, "failures": sorted(failures), "accepted": accepted,
            "examples": examples, "by_operation": by_operation, "predict_share": round(share, 3),
            "by_media_type": by_media_type, "generation_errors": generation_errors,
            "exit_code": res.returncode, "summary": res.stdout[-1500:]}


def _accepted(check: str, status: int | None, interaction: dict, max_body_bytes: int, image: bool) -> str | None:
    """Why a failed check is a decided answer no schema can state (module docstring), or None."""
    if check != "positive_data_acceptance":
        return None
    if status == 413 and len(_raw_body(interaction.get("request") or {})) > max_body_bytes:
        return f"413 for a schema-valid body over {max_body_bytes} bytes"
    if image and status == 422 and NOT_AN_IMAGE.fullmatch(_error(interaction) or ""):
        return "422 not an image, for a schema-valid body of random bytes"
    return None


def _raw_body(message: dict, key: str = "body") -> bytes:
    body = message.get(key)  # a request's "body", a response's "content"
    if isinstance(body, dict) and "$base64" in body:
        return base64.b64decode(body["$base64"])
    return body.encode() if isinstance(body, str) else b""


def _error(interaction: dict) -> str | None:
    try:
        return json.loads(_raw_body(interaction.get("response") or {}, "content"))["error"]
    except (ValueError, KeyError, TypeError):
        return None


def _header(message: dict, name: str) -> str:
    for k, v in (message.get("headers") or {}).items():
        if k.lower() == name:
            return v[0] if isinstance(v, list) else str(v)
    return ""


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
