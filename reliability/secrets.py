"""secrets_hygiene: credentials never leave the environment; unsafe loading, unsafe names and a
missing/wrong bearer token are rejected.

1. Leaks (`lost` = files or streams holding a secret): `workflows preprocess` (the quickstart
   shrunk to seconds) runs in a new process the way a user runs it against real S3/MinIO: the
   embedded endpoint off, `storage.endpoint_url` pointing at an S3 endpoint (moto, started here),
   and recognizable fake AWS credentials in the environment, so that they are really used to sign
   every request. Then every byte it wrote is searched for them: its stdout/stderr, its JSON
   summaries (output_dir), the shard cache, the object store's persisted objects and manifest,
   and the Ray session directory (all Ray and worker logs; RAY_TMPDIR points at a fresh one).
2. Static (each violation is a failure): no torch.load without weights_only=True, no pickle /
   joblib / numpy allow_pickle loads in workflows/, and model weights loaded with
   `use_safetensors=True` (the serving path) — found by parsing the source (ast), not by grep.
3. Names: registry specs and config names with '..', '/', '%2F', leading dots, control
   characters... are rejected before they become paths (registry.parse_spec, config.check_name,
   load_config, registry.register).
4. Bearer token: the Serve app's check (ModelServer._denied) rejects a missing, wrong, truncated,
   extended or differently-schemed token and accepts the right one; bearer_token() refuses to
   start when the configured variable is unset. A wrongly accepted request counts as lost.
5. Ray token auth for job submission (full run only: it starts a cluster): on a head node
   started by cluster/local/start.sh with RAY_AUTH_MODE=token, the Jobs API answers 401 without a
   token and 403 with another one, `ray job submit` without the token or with another one is
   refused and its entrypoint never runs, and with the token the job runs. A refused client's
   output never holds the cluster's token. A wrongly accepted submission counts as lost.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reliability import make_row
from tests.helpers import tiny_overrides

FAKE_KEY_ID = "AKIAFAKERELIABILITY7"
FAKE_SECRET = "fAkE/Reliability+Secret0123456789abcdefgh"
FAKE_SESSION = "FaKeSeSsIoNtOkEnReliabilityHygieneCheck000"
SECRETS = {"AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_SESSION_TOKEN": FAKE_SESSION}
ROOT = Path(__file__).resolve().parents[1]


def secrets_hygiene(workdir: Path, seed: int = 0, run_stage: bool = True, full: bool = False) -> dict:
    workdir = Path(workdir)
    t_start = time.time()
    failures: list[str] = []  # ids of failed checks
    notes: list[str] = []
    lost = 0
    survived = 0
    injected = 0

    # 1. leaks
    if run_stage:
        leak = _stage_leaks(workdir)
        injected += 1
        lost += len(leak["hits"])
        if leak["error"]:
            failures.append("stage:" + leak["error"])
        else:
            survived += 1
        notes.append(
            f"`workflows preprocess` ({leak['seconds']:.0f}s, exit {leak['rc']}) with fake AWS_ACCESS_KEY_ID/"
            f"AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN in its environment ({leak['signed']} requests signed with the "
            f"fake key id{', others with ' + str(leak['other_keys']) if leak['other_keys'] else ''}): "
            f"{leak['files']} files ({leak['bytes'] / 1e6:.1f} MB) scanned in {', '.join(leak['scanned'])}: "
            f"{len(leak['hits'])} hold a secret" + (f" ({'; '.join(leak['hits'][:4])})" if leak["hits"] else "")
        )

    # 2. static
    static = static_checks(ROOT / "workflows")
    injected += static["checked"]
    survived += static["checked"] - len(static["violations"])
    failures += [f"static:{v}" for v in static["violations"]]
    notes.append(
        f"static: {static['checked']} load/from_pretrained call sites in {static['files']} files, "
        f"{len(static['violations'])} violations"
        + (f" ({'; '.join(static['violations'])})" if static["violations"] else "")
    )

    # 3. names
    names = name_checks()
    injected += names["checked"]
    survived += names["checked"] - len(names["accepted"]) - len(names["errors"])
    lost += len(names["accepted"])  # an unsafe name taken as a path: a write outside its place
    failures += [f"names:{e}" for e in names["errors"]]
    notes.append(
        f"names: {names['checked']} hostile names through parse_spec/check_name/load_config/register: "
        f"{names['checked'] - len(names['accepted'])} rejected"
        + (f"; ACCEPTED: {names['accepted']}" if names["accepted"] else "")
        + (f"; errors: {names['errors'][:3]}" if names["errors"] else "")
    )

    # 4. bearer token
    auth = token_checks()
    injected += auth["checked"]
    survived += auth["checked"] - len(auth["wrong"]) - len(auth["errors"])
    lost += len(auth["wrongly_accepted"])
    failures += [f"auth:{w}" for w in auth["wrong"] if w not in auth["wrongly_accepted"]] + [
        f"auth:{e}" for e in auth["errors"]
    ]
    notes.append(
        f"bearer token: {auth['checked']} cases of ModelServer._denied / bearer_token, "
        f"{auth['checked'] - len(auth['wrong']) - len(auth['errors'])} decided right"
        + (f"; wrong: {auth['wrong']}" if auth["wrong"] else "")
        + (f"; errors: {auth['errors']}" if auth["errors"] else "")
    )

    # 5. Ray token auth for job submission
    if full:
        from reliability.local_cluster import local_cluster

        with local_cluster(workdir / "cluster", workers=0, head_cpus=1) as cluster:
            ray_auth = ray_token_auth_checks(cluster, workdir / "ray-auth")
        injected += ray_auth["checked"]
        survived += ray_auth["checked"] - len(ray_auth["wrong"]) - len(ray_auth["errors"])
        lost += len(ray_auth["wrongly_accepted"])
        failures += [f"ray-auth:{w}" for w in ray_auth["wrong"] if w not in ray_auth["wrongly_accepted"]]
        failures += [f"ray-auth:{e}" for e in ray_auth["errors"]]
        notes.append(
            f"Ray token auth (a head node with RAY_AUTH_MODE=token): {ray_auth['checked']} Jobs API / "
            f"`ray job submit` cases, {ray_auth['checked'] - len(ray_auth['wrong']) - len(ray_auth['errors'])} "
            "decided right"
            + (f"; wrong: {ray_auth['wrong']}" if ray_auth["wrong"] else "")
            + (f"; errors: {ray_auth['errors']}" if ray_auth["errors"] else "")
        )
    notes += static["notes"]
    return make_row(
        "secrets_hygiene",
        injected=injected,
        survived=survived,
        failed=len(failures),
        allowed_failures=0,
        lost=lost,
        detail="; ".join(notes),
        failures=failures,
        seconds=round(time.time() - t_start, 1),
    )


# -- 1. leaks ---------------------------------------------------------------------------------
def _stage_leaks(workdir: Path) -> dict:
    from reliability.fault_proxy import FaultProxy
    from workflows.storage.embedded import EmbeddedS3

    tmp = workdir / "stage"
    ray_tmp = Path(tempfile.mkdtemp(prefix="wfrel-", dir="/tmp"))  # short: Ray's AF_UNIX socket paths
    s3_dir = tmp / "store"
    overrides = [*tiny_overrides(tmp), "storage.embedded.enabled=false", "data.write_builtin=true"]
    t0 = time.time()
    # a proxy without faults in front of the endpoint: it records which access key signed each
    # request, proof that the fake credentials were really used (else finding none proves nothing)
    with EmbeddedS3(str(s3_dir)) as s3, FaultProxy(s3.url) as proxy:
        s3.ensure_bucket("workflows")
        args = [
            sys.executable,
            "-m",
            "workflows",
            "preprocess",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--set",
            f"storage.endpoint_url={proxy.url}",
        ]
        for o in overrides:
            args += ["--set", o]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(SECRETS, RAY_TMPDIR=str(ray_tmp), AWS_REGION="us-east-1")
        try:
            res = subprocess.run(args, capture_output=True, timeout=900, cwd=ROOT, env=env)
            rc, out, err = res.returncode, res.stdout, res.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = -1, e.stdout or b"", e.stderr or b""
        s3.persist()
        signed = dict(proxy.access_keys)
    seconds = time.time() - t0
    (tmp / "captured").mkdir(parents=True, exist_ok=True)
    (tmp / "captured" / "stdout.log").write_bytes(out)
    (tmp / "captured" / "stderr.log").write_bytes(err)
    places = {
        "stdout/stderr": tmp / "captured",
        "summaries": tmp / "runs",
        "shard cache": tmp / "cache",
        "object store (persisted objects + manifest)": s3_dir,
        "Ray session logs": ray_tmp,
    }
    hits, files, nbytes = [], 0, 0
    per_place = {}
    needles = [s.encode() for s in SECRETS.values()]
    for label, place in places.items():
        per_place[label] = 0
        for path in _files(place):
            files += 1
            per_place[label] += 1
            try:
                data = path.read_bytes()
            except OSError:
                continue
            nbytes += len(data)
            for needle in needles:
                if needle in data:
                    hits.append(f"{label}: {path.relative_to(place)} holds {needle[:6].decode()}...")
    error = None
    if rc != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        error = f"preprocess exited {rc}: {last[:200]}"
    elif not (tmp / "runs" / "quickstart" / "preprocess.json").exists():
        error = "preprocess wrote no summary"
    elif not signed.get(FAKE_KEY_ID):
        error = f"the fake credentials signed no request (keys seen: {sorted(signed)})"
    _rmtree(ray_tmp)
    return {
        "hits": hits,
        "files": files,
        "bytes": nbytes,
        "rc": rc,
        "seconds": seconds,
        "error": error,
        "scanned": [f"{label} ({n})" for label, n in per_place.items()],
        "signed": signed.get(FAKE_KEY_ID, 0),
        "other_keys": sorted(k for k in signed if k != FAKE_KEY_ID),
    }


def _files(root: Path):
    if not root.exists():
        return
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink():
                yield p


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# -- 2. static --------------------------------------------------------------------------------
def static_checks(package: Path) -> dict:
    """Parse every module; flag unsafe deserialization and weights not loaded via safetensors."""
    violations, notes, checked, files = [], [], 0, 0
    for path in sorted(package.rglob("*.py")):
        files += 1
        rel = path.relative_to(package.parent)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            where = f"{rel}:{node.lineno}"
            if name.endswith("torch.load") or name == "load" and _imported_from(tree, "load", "torch"):
                checked += 1
                if not _is_true(kw.get("weights_only")):
                    violations.append(f"torch.load without weights_only=True at {where}")
            elif name in (
                "pickle.load",
                "pickle.loads",
                "cPickle.load",
                "joblib.load",
                "dill.load",
                "dill.loads",
                "cloudpickle.load",
                "cloudpickle.loads",
            ):
                checked += 1
                violations.append(f"{name} at {where}")
            elif name.endswith(("np.load", "numpy.load")):
                checked += 1
                if _is_true(kw.get("allow_pickle")):
                    violations.append(f"{name}(allow_pickle=True) at {where}")
            elif name.endswith(".from_pretrained") and "Model" in name.rsplit(".", 1)[0]:
                checked += 1  # model weights (tokenizers and configs hold none)
                if not _is_true(kw.get("use_safetensors")):
                    violations.append(f"{name} without use_safetensors=True at {where}")
    # Outside workflows/: torch.distributed.checkpoint, which the trainer uses for sharded
    # checkpoints, unpickles the checkpoint's `.metadata` (and torch.load(weights_only=False)s any
    # non-tensor entries) when resuming or exporting. Reported, not counted: it is the only DCP format.
    notes.append(
        "note: torch.distributed.checkpoint unpickles a checkpoint's .metadata on resume/export "
        "(workflows/train/checkpoint.py dcp.load, dcp_to_torch_save): checkpoints under runs/ must be "
        "as trusted as the code"
    )
    return {"violations": violations, "notes": notes, "checked": checked, "files": files}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _imported_from(tree, name: str, module: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and n.module == module and any(a.name == name for a in n.names)
        for n in ast.walk(tree)
    )


# -- 3. names ---------------------------------------------------------------------------------
HOSTILE_NAMES = [
    "..",
    "../etc",
    "../../etc/passwd",
    "a/../../b",
    "a/b",
    "/abs",
    ".hidden",
    "...",
    "a..b",
    "..%2F..%2Fetc",
    "%2e%2e",
    "a\\b",
    "..\\..\\win",
    "a\x00b",
    "a\nb",
    "a b",
    "",
    " ",
    "-rf",
    "x" * 65,
    "ünïcode",
    "a:b:c",
    "s3://bucket/key",
    "~root",
    "$HOME",
    "a;rm -rf /",
]


def name_checks() -> dict:
    from workflows import registry
    from workflows.config import check_name, load_config
    from workflows.errors import UserError

    accepted, errors, checked = [], [], 0
    for bad in HOSTILE_NAMES:
        checked += 1
        try:
            name, _ = registry.parse_spec(bad)
            accepted.append(f"parse_spec({bad!r}) -> {name!r}")
        except UserError:
            pass
        except Exception as e:  # noqa: BLE001
            errors.append(f"parse_spec({bad!r}): {type(e).__name__}")
        checked += 1
        try:
            check_name(bad)
            accepted.append(f"check_name({bad!r})")
        except ValueError:
            pass
        for key in ("name", "registry.name"):
            checked += 1
            try:
                load_config(ROOT / "configs" / "quickstart.yaml", [f"{key}={bad}"])
                accepted.append(f"load_config({key}={bad!r})")
            except UserError:
                pass
            except Exception as e:  # noqa: BLE001
                errors.append(f"load_config({key}={bad!r}): {type(e).__name__}")
    # register() validates again before writing anything (it has no store here: must fail first)
    from workflows.config import load_config as _load
    from workflows.storage.uri import StorageContext

    cfg = _load(
        ROOT / "configs" / "quickstart.yaml",
        ["storage.embedded.enabled=false", "storage.root=/nonexistent-reliability"],
    )
    for bad in ("../evil", "a/b", ".."):
        checked += 1
        try:
            registry.register(cfg, StorageContext(), "/nonexistent-reliability-src", bad, {})
            accepted.append(f"register({bad!r})")
        except (ValueError, UserError):
            pass
        except Exception as e:  # noqa: BLE001 - e.g. it touched the filesystem before checking
            errors.append(f"register({bad!r}): {type(e).__name__}: {e}")
    return {"checked": checked, "accepted": accepted, "errors": errors}


# -- 4. bearer token --------------------------------------------------------------------------
def token_checks() -> dict:
    from starlette.requests import Request

    from workflows.serve.app import ModelServer, bearer_token

    # the class as written (Serve's ingress wrapper around it has an async __del__)
    deployment: Any = ModelServer  # a serve.Deployment (@serve.deployment), which mypy sees as the plain class
    cls = next(c for c in deployment.func_or_class.__mro__ if "_denied" in c.__dict__)
    server = object.__new__(cls)
    token = "s3cret-Token_value"
    server.token = token

    def request(value: bytes | None) -> Request:
        headers = [] if value is None else [(b"authorization", value)]
        return Request({"type": "http", "method": "POST", "path": "/predict", "headers": headers})

    cases = [  # (header, should be allowed)
        (None, False),
        (b"", False),
        (b"Bearer", False),
        (b"Bearer ", False),
        (b"Bearer wrong", False),
        (b"Bearer " + token.encode()[:-1], False),
        (b"Bearer " + token.encode() + b"x", False),
        (b"Basic " + token.encode(), False),
        (token.encode(), False),
        (b"Bearer  " + token.encode(), False),
        (b"Bearer " + token.upper().encode(), False),
        (b"Bearer s3cret-T\xf6ken_value", False),
        (b"Bearer " + token.encode() + b"\x00", False),
        (b"Bearer " + token.encode(), True),
        (b"bearer " + token.encode(), True),
    ]
    wrong, wrongly_accepted, errors, checked = [], [], [], 0
    for header, allowed in cases:
        checked += 1
        try:
            denied = server._denied(request(header))
        except Exception as e:  # noqa: BLE001
            errors.append(f"{header!r}: {type(e).__name__}: {e}")
            continue
        ok = denied is None
        if ok != allowed:
            wrong.append(f"{header!r} {'accepted' if ok else 'rejected'}")
            if ok:
                wrongly_accepted.append(wrong[-1])
        elif not ok and (denied.status_code != 401 or b"bearer" not in denied.body.lower()):
            wrong.append(f"{header!r}: status {denied.status_code}")
    server.token = None  # no token configured: open, by design
    checked += 1
    if server._denied(request(None)) is not None:
        wrong.append("no token configured, yet denied")

    class SC:  # the serve config's one field bearer_token reads
        auth_token_env = "WORKFLOWS_RELIABILITY_UNSET_TOKEN"

    os.environ.pop(SC.auth_token_env, None)
    checked += 1
    try:
        bearer_token(SC)
        wrong.append("bearer_token() started without its token variable")
        wrongly_accepted.append(wrong[-1])
    except RuntimeError:
        pass
    return {"checked": checked, "wrong": wrong, "wrongly_accepted": wrongly_accepted, "errors": errors}


# -- 5. Ray token auth for job submission -----------------------------------------------------
def ray_token_auth_checks(cluster, workdir: Path) -> dict:
    """Against a running token-auth cluster (reliability.local_cluster): who may use the Jobs API.
    The clients run with HOME in `workdir`, so no ~/.ray/auth_token can stand in for the token."""
    import secrets as pysecrets

    import requests

    from reliability.local_cluster import ray_cli

    workdir = Path(workdir)
    (workdir / "home").mkdir(parents=True, exist_ok=True)
    token = cluster.env["RAY_AUTH_TOKEN"]
    other = pysecrets.token_hex(32)
    api = f"{cluster.dashboard}/api/jobs/"
    checked, wrong, wrongly_accepted, errors = 0, [], [], []

    def decide(case: str, accepted: bool, should_accept: bool, leaked: bool = False) -> None:
        nonlocal checked
        checked += 1
        if accepted != should_accept:
            wrong.append(case)
            if accepted:
                wrongly_accepted.append(case)
        if leaked:
            wrong.append(f"{case}: the token in its output")

    for case, headers, status in (
        ("HTTP, no token", {}, 401),
        ("HTTP, another token", {"Authorization": f"Bearer {other}"}, 403),
        ("HTTP, the token", {"Authorization": f"Bearer {token}"}, 200),
    ):
        try:
            got = requests.get(api, headers=headers, timeout=30).status_code
        except requests.RequestException as e:
            errors.append(f"{case}: {type(e).__name__}")
            continue
        decide(f"{case} -> {got}", got == 200, status == 200)
        if got not in (status, 200):
            wrong.append(f"{case}: {got}, expected {status}")

    no_token = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")}
    refused_markers: dict[str, str | None] = {}
    for case, env, should_accept in (
        ("ray job submit, no token", no_token, False),
        ("ray job submit, another token", {**cluster.env, "RAY_AUTH_TOKEN": other}, False),
        ("ray job submit, the token", cluster.env, True),
    ):
        marker = f"entrypoint-ran-{pysecrets.token_hex(4)}"
        try:
            res = ray_cli(
                ["job", "submit", "--address", cluster.dashboard, "--", "python", "-c", f"print('{marker}')"],
                {**env, "HOME": str(workdir / "home")},
                timeout=300,
            )
        except Exception as e:  # noqa: BLE001 - a hung or crashed client is an error, reported
            errors.append(f"{case}: {type(e).__name__}")
            continue
        out = res.stdout + res.stderr
        ran = res.returncode == 0 and marker in out
        decide(case, ran, should_accept, leaked=not should_accept and token in out)
        if not should_accept and not ran and "auth" not in out.lower():
            wrong.append(f"{case}: refused without saying why ({out.strip().splitlines()[-1:]})")
        refused_markers[marker] = case if not should_accept else None
    # and no refused submission left a job behind (one that ran without streaming its output)
    try:
        jobs = requests.get(api, headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
        for job in jobs:
            for marker, refused in refused_markers.items():
                if refused and marker in job.get("entrypoint", ""):
                    wrong.append(f"{refused}: a job was created")
                    wrongly_accepted.append(f"{refused}: a job was created")
    except (requests.RequestException, ValueError) as e:
        errors.append(f"listing jobs: {type(e).__name__}")
    return {"checked": checked, "wrong": wrong, "wrongly_accepted": wrongly_accepted, "errors": errors}
