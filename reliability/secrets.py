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
4. Bearer token: the Serve app's check (serve.guards.denied) rejects a missing, wrong, truncated,
   extended or differently-schemed token and accepts the right one; bearer_token() refuses to
   start when the configured variable is unset. A wrongly accepted request counts as lost.
5. Ray token auth for job submission (full run only: it starts a cluster): on a head node
   started by cluster/local/start.sh with RAY_AUTH_MODE=token, the Jobs API answers 401 without a
   token and 403 with another one, `ray job submit` without the token or with another one is
   refused and its entrypoint never runs, and with the token the job runs. A refused client's
   output never holds the cluster's token. A wrongly accepted submission counts as lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reliability import ROOT, make_row
from reliability.secrets_code import name_checks, static_checks
from reliability.secrets_tokens import ray_token_auth_checks, token_checks
from tests.helpers import tiny_overrides

FAKE_KEY_ID = "AKIAFAKERELIABILITY7"
FAKE_SECRET = "fAkE/Reliability+Secret0123456789abcdefgh"
FAKE_SESSION = "FaKeSeSsIoNtOkEnReliabilityHygieneCheck000"
SECRETS = {"AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET, "AWS_SESSION_TOKEN": FAKE_SESSION}


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
        f"bearer token: {auth['checked']} cases of serve.guards.denied / bearer_token, "
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
