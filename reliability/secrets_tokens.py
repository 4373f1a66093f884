"""secrets_hygiene, parts 4 and 5 (reliability.secrets runs them): who may call. The Serve app's
bearer-token check, and Ray token auth for job submission against a token-auth cluster."""

from __future__ import annotations

import os
from pathlib import Path


# -- 4. bearer token --------------------------------------------------------------------------
def token_checks() -> dict:
    from starlette.requests import Request

    from workflows.serve.guards import bearer_token, denied

    # the check every request of a replica with a token passes first (serve.guards.TokenGuard)
    token = "s3cret-Token_value"

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
            refused = denied(token, request(header))
        except Exception as e:  # noqa: BLE001
            errors.append(f"{header!r}: {type(e).__name__}: {e}")
            continue
        ok = refused is None
        if ok != allowed:
            wrong.append(f"{header!r} {'accepted' if ok else 'rejected'}")
            if ok:
                wrongly_accepted.append(wrong[-1])
        elif refused is not None and (refused.status_code != 401 or b"bearer" not in bytes(refused.body).lower()):
            wrong.append(f"{header!r}: status {refused.status_code}")
    checked += 1  # no token configured: open, by design
    if denied(None, request(None)) is not None:
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
