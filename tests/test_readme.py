"""The README, executed: every shell block runs as written, so an edit that breaks a command fails.

A comment before each block says what it runs against (`<!-- readme-test: KIND -->`):
- `embedded`: the quickstart's embedded store, as the shared tiny pipeline (`quickstart_run`) left
  it (a hard-linked copy: the blocks register and write into it);
- `digits`: likewise the store the shared digits pipeline (`digits_run`) left, with a `digit.png`;
- `s3`: a separate moto S3 server on 127.0.0.1 with `storage.embedded.enabled=false`;
- `cluster`: a multi-node cluster from `cluster/local/start.sh`;
- `skip: WHY`: not run, for the reason given. A shell block without a comment fails the test.

What the test changes around the commands, and only this:
- `workflows` and `.venv/bin/workflows` are a shim that runs this checkout's CLI and appends the
  tiny settings (`--set`: store dir, output and cache dirs, a free serve port, small data and
  one short epoch on one worker, no tuning, joining the session's Ray cluster); `serve run` joins
  it too;
- `localhost:8000` becomes the free serve port, `http://minio.local:9000` the moto server;
- a command whose comment says "Ctrl-C to stop" runs in the background until it is ready (a
  `workflows` command prints "Ctrl-C to stop"; `serve run`: the serve port answers /healthz), and
  its process group gets SIGINT, as from Ctrl-C, when its block ends: it must exit 0 within 120 s
  (the README says Ctrl-C stops it cleanly; a clean stop takes seconds), or the block fails, as with
  any other command's non-zero exit (`set -e`), with the stacks of its Python processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, sets, shutdown_serve
from tests.helpers import free_port, tiny_overrides

README = ROOT / "README.md"
MARKED = re.compile(r"<!-- readme-test: (?P<kind>[^>]+?) -->\n```(?:bash|sh|shell)\n(?P<body>.*?)```", re.S)
SHELL = re.compile(r"^```(?:bash|sh|shell)$", re.M)
KINDS = {"embedded", "s3", "cluster", "digits"}
# what the README's pipelines skip here: tuning, 2-worker FSDP and the pipeline's own serving are
# tested elsewhere (test_tune, test_train, test_e2e); the commands are still the README's
CHEAP = ["tune.enabled=false", "serve.enabled=false", "train.num_workers=1"]


def tickets_settings(work: Path, port: int, *, embedded: bool) -> list[str]:
    """What the shim appends to the README's tickets pipelines, the own-data block's (embedded store)
    and the S3 block's alike: the tiny settings under `work`, the serve port, CHEAP; the S3 block's
    without the embedded store's."""
    drop = ("serve.port=",) if embedded else ("serve.port=", "storage.embedded")
    return [*(s for s in tiny_overrides(work) if not s.startswith(drop)), f"serve.port={port}", *CHEAP]
QUICKSTART_LABELS = ["dataframes", "deep-learning", "plotting", "scientific-computing"]

# Before each block's script: background commands in their own process groups (job control, so
# that SIGINT reaches them as Ctrl-C would), a readiness wait, and Ctrl-C to each at the end.
PRELUDE = r"""
set -m
export PYTHONUNBUFFERED=1  # a background command's log holds all it printed, even when it is killed
__pids=() __cmds=()
__ready() {  # $1: log, $2: pid, $3: what says it is ready (log: `workflows` prints it; http: /healthz)
  for _ in $(seq 600); do
    [ "$3" = log ] && grep -q "Ctrl-C to stop" "$1" && return 0
    [ "$3" = http ] && curl -sf "http://127.0.0.1:$WF_TEST_PORT/healthz" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "background command exited early:" >&2; cat "$1" >&2; return 1; }
    sleep 1
  done
  echo "background command not ready in 600 s:" >&2; cat "$1" >&2; return 1
}
__sigint() {  # why process $1 did not act on SIGINT: ignored, caught, pending (blocked in every thread)
  local st=/proc/$1/status ign cgt pnd t b cmd all=1
  ign=$(awk '/^SigIgn/{print $2}' "$st" 2>/dev/null || true) cgt=$(awk '/^SigCgt/{print $2}' "$st" 2>/dev/null || true)
  pnd=$(awk '/^ShdPnd/{print $2}' "$st" 2>/dev/null || true)
  [ -n "$ign" ] && [ -n "$cgt" ] && [ -n "$pnd" ] || return 0
  for t in /proc/$1/task/*/status; do
    b=$(awk '/^SigBlk/{print $2}' "$t" 2>/dev/null || true); [ -n "$b" ] && (( 0x$b & 2 )) || all=0
  done
  cmd=$(tr '\0\n' '  ' <"/proc/$1/cmdline" 2>/dev/null | cut -c1-160 || true)
  echo "README: pid $1 ($cmd): SIGINT ignored $(( (0x$ign >> 1) & 1 )), caught $(( (0x$cgt >> 1) & 1 )),"\
    "pending $(( (0x$pnd >> 1) & 1 )), blocked in every thread $all" >&2
}
__stop() {  # Ctrl-C to each background command, newest first; each must exit 0 within 120 s of it
  # (a clean stop, Serve's included, takes seconds; 120: with both cores held by other tests, TEST_WORKERS=2)
  local rc=$? bad=0 i p s
  for ((i=${#__pids[@]}-1; i>=0; i--)); do
    p=${__pids[i]}; kill -INT -- "-$p" 2>/dev/null || true  # as Ctrl-C: the job's process group
    for _ in $(seq 120); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
    if kill -0 "$p" 2>/dev/null; then
      # where it waits: the stacks of the job's Python processes ($p is the job's bash; those not Python fail)
      # and what each did with the signal
      for q in $(pgrep -g "$p" 2>/dev/null); do __sigint "$q"; py-spy dump --pid "$q" >&2 2>/dev/null || true; done
      kill -KILL -- "-$p" 2>/dev/null || true
      echo "README: still running 120 s after Ctrl-C: ${__cmds[i]}" >&2; bad=1
    fi
    s=0; wait "$p" || s=$?
    [ "$s" = 0 ] || { echo "README: exited $s after Ctrl-C: ${__cmds[i]}" >&2; bad=1; }
    kill -KILL -- "-$p" 2>/dev/null || true  # what the command left in its group
  done
  [ "$bad" = 0 ] || exit $(( rc ? rc : 1 ))
}
trap __stop EXIT
set -euo pipefail
"""


@dataclass
class Block:
    kind: str
    body: str
    line: int

    def script(self, substitutions: dict[str, str]) -> str:
        """The block as a bash script: backgrounded servers, then every other line as written."""
        lines = []
        for n, line in enumerate(self.body.splitlines()):
            for old, new in substitutions.items():
                line = line.replace(old, new)
            command, _, comment = line.partition("  #") if "  #" in line else line.partition(" # ")
            if "Ctrl-C to stop" in comment:
                log = f"background-{self.line}-{n}.log"
                ready = "log" if re.match(r"(\.venv/bin/)?workflows ", command.strip()) else "http"
                line = (f"{{ {command.strip()} ; }} >{log} 2>&1 &\n"
                        f"__pids+=($!) __cmds+=({shlex.quote(command.strip())})\n__ready {log} $! {ready}\n"
                        f"echo '[started in the background: {command.strip()}]'")
            lines.append(line)
        return PRELUDE + "\n".join(lines) + "\n"


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m["kind"].strip(), m["body"], text[: m.start()].count("\n") + 1) for m in MARKED.finditer(text)]


def test_every_shell_block_in_the_readme_says_what_it_runs_against():
    blocks = readme_blocks()
    assert len(blocks) == len(SHELL.findall(README.read_text())), "a README shell block lacks <!-- readme-test: -->"
    for b in blocks:
        assert b.kind in KINDS or re.fullmatch(r"skip: \S.*", b.kind), (b.line, b.kind)
    assert {b.kind for b in blocks} >= KINDS


FAKE_SERVER = """#!/usr/bin/env bash
# stands in for a `workflows` command that runs until Ctrl-C; exits $FAKE_RC on SIGINT ("hang": ignores it)
[ "$FAKE_RC" = hang ] && trap '' INT || trap 'echo stopping; exit $FAKE_RC' INT
echo "workflows: up; Ctrl-C to stop"
while true; do sleep 0.2; done
"""


@pytest.mark.parametrize("fake_rc, fails", [("0", False), ("3", True), ("130", True), ("hang", True)])
def test_the_runner_fails_a_block_whose_command_ctrl_c_does_not_stop_with_exit_0(tmp_path, fake_rc, fails):
    """The runner itself: a background command's exit code after Ctrl-C is checked like any other."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "workflows").write_text(FAKE_SERVER)
    (bin_dir / "workflows").chmod(0o755)
    block = Block("embedded", "workflows serve --model m   # Ctrl-C to stop\necho after\n", 1)
    if fake_rc == "hang":  # the 120 s wait for it, shortened
        script = block.script({}).replace("seq 120", "seq 2")
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_RC": "hang"}
        res = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
        assert res.returncode != 0 and "still running 120 s after Ctrl-C: workflows serve" in res.stderr, res.stderr
        # what it did with the signal is said: the fake's bash ignores SIGINT (trap '')
        assert re.search(r"README: pid \d+ \(bash .*workflows serve .*\): SIGINT ignored 1, caught 0, pending 0, "
                         r"blocked in every thread 0", res.stderr), res.stderr
        return
    if fails:
        with pytest.raises(AssertionError, match=f"exited {fake_rc} after Ctrl-C: workflows serve --model m"):
            run_block(block, tmp_path, bin_dir, {"FAKE_RC": fake_rc}, {}, timeout=60)
    else:
        out = run_block(block, tmp_path, bin_dir, {"FAKE_RC": fake_rc}, {}, timeout=60).stdout
        assert "after" in out and "stopping" in (tmp_path / "background-1-0.log").read_text()


def set_flags(overrides: list[str]) -> str:
    """The `--set` flags of `overrides` (conftest.sets), quoted for a shell script."""
    return " ".join(shlex.quote(a) for a in sets(overrides))


def shim(bin_dir: Path, overrides: list[str]) -> None:
    """`workflows` that runs this checkout's CLI with the test's settings appended."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    extra = set_flags(overrides)
    path = bin_dir / "workflows"
    path.write_text(f'#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} -m workflows "$@" {extra}\n')
    path.chmod(0o755)


@contextlib.contextmanager
def _as_from_a_terminal():
    """The block's shell gets Ctrl-C's default disposition, as from a user's terminal. A test process may
    ignore SIGINT (workflows.stop ignores it once a stop begins, in whatever process runs the command), and
    a shell started ignoring it cannot undo that: `serve run` would then ignore Ctrl-C too. Python's own
    handler, set here meanwhile, is reset by exec; a preexec_fn would fork this whole process (a Ray
    driver: gRPC's at-fork handlers are the suspects of its GCS requests lost for ever)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_block(block: Block, cwd: Path, bin_dir: Path, env: dict, substitutions: dict, timeout: float = 900):
    """Run the block with bash in `cwd`; `env` adds to this process's environment ("" unsets)."""
    if (bin_dir / "workflows").exists() and not (cwd / ".venv" / "bin" / "workflows").exists():
        (cwd / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(bin_dir / "workflows", cwd / ".venv" / "bin" / "workflows")
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        # this checkout's package, also in the Ray workers that `serve run` and jobs start
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        **env,
    }
    full_env = {k: v for k, v in full_env.items() if v != ""}
    with _as_from_a_terminal():
        res = subprocess.run(["bash", "-c", block.script(substitutions)], cwd=cwd, env=full_env, capture_output=True,
                             text=True, timeout=timeout)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob("background-*.log")))
    assert res.returncode == 0, (
        f"README block at line {block.line} ({block.kind}) failed, exit {res.returncode}:\n{block.body}\n"
        f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-6000:]}{logs}"
    )
    return res


def tickets(rows: int = 60) -> str:
    """A small tickets table, the 'own data' of the README: subject, body -> queue."""
    import csv
    import io

    topics = {
        "billing": ("Invoice {i} charged twice", "My card was charged twice for invoice {i}; please refund one."),
        "outage": ("Service {i} is down", "Since this morning service {i} returns errors and times out."),
        "access": ("Cannot log in to account {i}", "The password reset link for account {i} never arrives."),
    }
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["subject", "body", "queue"])
    for i in range(rows):
        queue = list(topics)[i % len(topics)]
        subject, body = topics[queue]
        w.writerow([subject.format(i=i), body.format(i=i), queue])
    return out.getvalue()


@pytest.fixture(scope="module")
def workdir(quickstart_run, ray_join, tmp_path_factory):
    """A user's directory after `make demo`: the shared run's store (hard links: the store writes
    each object to a new file), tickets.csv, and the `workflows` shim with the test's settings."""
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(quickstart_run.tmp / "s3", work / "s3", copy_function=os.link,
                    ignore=shutil.ignore_patterns("lock", "endpoint.json"))
    (work / "tickets.csv").write_text(tickets())
    port = free_port()
    shim(work / "bin", [*tickets_settings(work, port, embedded=True), *ray_join.overrides])
    env = {**ray_join.env, "WF_TEST_PORT": str(port), "RAY_ADDRESS": ray_join.address}
    yield work, env, {"localhost:8000": f"localhost:{port}"}
    shutdown_serve()


@pytest.mark.integration
def test_readme_blocks_on_the_embedded_store(quickstart_run, workdir):
    work, env, subs = workdir
    outputs = [run_block(b, work, work / "bin", env, subs) for b in readme_blocks() if b.kind == "embedded"]
    out = "".join(r.stdout + r.stderr for r in outputs)
    # one request to `workflows serve`, one to `serve run` of the emitted config
    assert out.count('{"predictions":[{"label":') == 2, out[-3000:]
    assert "quickstart: v1" in out and "registered tickets:v1" in out
    assert "recommended: " in out  # workflows plan
    # `evaluate --split test` scored the rows the pipeline held out, and wrote the confusion matrix
    ev = json.loads((work / "eval.json").read_text())
    held_out = quickstart_run.summary("pipeline")["evaluate"]
    assert ev["data"].endswith("/split=test/") and ev["rows"] == held_out["rows"], (ev["data"], ev["rows"])
    assert ev["weighted"]["f1"] == pytest.approx(held_out["weighted"]["f1"])
    cm = ev["confusion_matrix"]
    assert cm["labels"] == QUICKSTART_LABELS and sum(map(sum, cm["matrix"])) == ev["rows"]
    assert sum(cm["matrix"][i][i] for i in range(len(cm["labels"]))) == round(ev["accuracy"] * ev["rows"])
    runs = work / "runs" / "quickstart"
    assert (runs / "evaluate.json").exists() and (runs / "confusion_matrix.png").stat().st_size > 1000
    assert "confusion matrix (rows: true label" in out
    # Ctrl-C stopped `workflows store` cleanly: its store persisted (its moto server outlived the signal)
    store_log = next(p.read_text() for p in work.glob("background-*.log") if "store: embedded" in p.read_text())
    assert "store: stopped; data persisted" in store_log, store_log


@pytest.mark.integration
def test_readme_block_on_a_separate_s3_endpoint(tmp_path):
    """The 'Real S3 or MinIO' block against moto's server, the embedded store off: it trains on the
    bucket's tickets and registers them there, and builds nothing into the bucket. It starts a Ray
    of its own, as a user's command does: the credentials the block exports reach the workers
    through the environment of the cluster's processes, which the session's cluster cannot get."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        url = f"http://127.0.0.1:{server._server.server_port}"
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
        s3.create_bucket(Bucket="my-bucket")
        s3.put_object(Bucket="my-bucket", Key="tickets/tickets.csv", Body=tickets().encode())
        port = free_port()
        shim(tmp_path / "bin", tickets_settings(tmp_path, port, embedded=False))
        # a new local Ray even where another cluster on this machine would be joined by default
        env = {"WF_TEST_PORT": str(port), "RAY_ADDRESS": "local"}
        for b in (b for b in readme_blocks() if b.kind == "s3"):
            run_block(b, tmp_path, tmp_path / "bin", env, {"http://minio.local:9000": url})
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="my-bucket")["Contents"]]
        assert any(k.startswith("workflows/models/tickets/v1/") for k in keys), keys
        assert not any(k.startswith(("raw/", "workflows/raw/")) for k in keys), keys
        assert not (tmp_path / "s3").exists()  # no embedded store was started
    finally:
        server.stop()


@pytest.mark.integration
# make test-all: the block's parts run in the gate, its pipeline (the same tiny settings) as the
# quickstart fixture's run and its `ray job submit` to a start.sh cluster in tests/test_jobs.py
@pytest.mark.extended
def test_readme_block_on_a_local_cluster(tmp_path):
    """The cluster block: `cluster/local/start.sh` (on free ports, a token of its own), a pipeline
    as a Ray job, `stop.sh`. The nodes' `python` (start.sh puts the directory of `$RAY` first on
    their PATH) is a shim that appends the tiny settings to `python -m workflows`."""
    import secrets

    from reliability.local_cluster import _base_port

    state = ROOT / ".workflows" / "local-cluster"  # the block sources its default STATE_DIR's env file
    if (state / "pids").exists():
        pytest.skip(f"a local cluster started from {state} may be running (cluster/local/stop.sh stops it)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").symlink_to(Path(sys.executable).parent / "ray")
    overrides = [s for s in tiny_overrides(tmp_path) if not s.startswith("cache.dir=")]
    overrides += ["cache.dir=auto", *CHEAP]
    extra = set_flags(overrides)
    python = shlex.quote(sys.executable)
    (bin_dir / "python").write_text(
        f'#!/usr/bin/env bash\nif [ "${{1:-}} ${{2:-}}" = "-m workflows" ]; then exec {python} "$@" {extra}; fi\n'
        f'exec {python} "$@"\n'
    )
    (bin_dir / "python").chmod(0o755)
    env = {
        "RAY": str(bin_dir / "ray"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_PORT": str(free_port()), "DASHBOARD_PORT": str(free_port()), "CLIENT_PORT": str(free_port()),
        "BASE_PORT": str(_base_port(2)), "OBJECT_STORE_MB": "256", "RAY_ADDRESS": "",
        "RAY_API_SERVER_ADDRESS": "", "WF_TEST_PORT": str(free_port()),
        "START_TIMEOUT_S": "360",  # other tests may hold both cores (TEST_WORKERS=2)
    }
    try:
        blocks = [b for b in readme_blocks() if b.kind == "cluster"]
        out = "".join(r.stdout + r.stderr for r in (run_block(b, ROOT, bin_dir, env, {}) for b in blocks))
        assert "registered quickstart:v1" in out and "workflows pipeline: done" in out, out[-4000:]
        assert "succeeded" in out.lower()
        # cache.dir=auto: each node cached the shards it read in its own WORKFLOWS_CACHE_DIR (start.sh),
        # kept by the block's plain stop.sh
        cached = {node.name: len(list(node.glob("cache/shards/*.data"))) for node in state.iterdir() if node.is_dir()}
        assert sum(cached.values()) > 0, cached
    finally:  # a failed block leaves the cluster running; the per-node caches go too
        stop_env = {k: v for k, v in {**os.environ, **env}.items() if v != ""}
        subprocess.run(["bash", str(ROOT / "cluster" / "local" / "stop.sh"), "--purge"], cwd=ROOT, env=stop_env,
                       capture_output=True, timeout=300)


@pytest.mark.integration
def test_readme_image_blocks_on_the_digits_store(digits_run, ray_join, tmp_path_factory):
    """The Images section's commands on the store the shared digits pipeline left: evaluate, serve
    with the three request shapes, batch predictions over the raw tar shards. The block's `predict`
    is the suite's one run of it over the tar shards (test_images_e2e had the same command on the
    same store): every image scored, the key and scores written, no image bytes."""
    from tests.conftest import digits_overrides
    from tests.test_images_e2e import _digit_png

    work = tmp_path_factory.mktemp("readme-digits")
    shutil.copytree(digits_run.tmp / "s3", work / "s3", copy_function=os.link,
                    ignore=shutil.ignore_patterns("lock", "endpoint.json"))
    (work / "digit.png").write_bytes(_digit_png(3))
    port = free_port()
    overrides = [s for s in digits_overrides(work) if not s.startswith("serve.port=")]
    shim(work / "bin", [*overrides, f"serve.port={port}", *ray_join.overrides])
    env = {**ray_join.env, "WF_TEST_PORT": str(port), "RAY_ADDRESS": ray_join.address}
    try:
        outputs = [run_block(b, work, work / "bin", env, {"localhost:8000": f"localhost:{port}"})
                   for b in readme_blocks() if b.kind == "digits"]
    finally:
        shutdown_serve()
    out = "".join(r.stdout + r.stderr for r in outputs)
    decoder = json.JSONDecoder()  # curl prints no newline: answers may run into the next output
    answers = [decoder.raw_decode(out, m.start())[0] for m in re.finditer(r'\{"predictions":', out)]
    assert [len(a["predictions"]) for a in answers] == [1, 2, 1], out[-3000:]
    assert {p["label"] for a in answers for p in a["predictions"]} == {"3"}  # load_digits().images[3] is a 3
    assert "weighted" in out and "confusion matrix" in out
    summary = json.loads((work / "runs" / "digits" / "predict.json").read_text())
    assert summary["rows"] == 1797
    assert {"key", "label", "prediction", "score"} <= set(summary["columns"]) and "image" not in summary["columns"]
