"""What a person sees on the terminal: the real CLI in new processes, each starting a local Ray.
Ray's own output goes to the run's log file; `-v` brings it back; a failure shows the log's tail."""

import json
import re
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, run_cli
from tests.helpers import tiny_overrides, wait_until

RAY_NOISE = re.compile(r"\(\S*\s?pid=\d+|\x1b\[[0-9;?]*[A-HJKSTf]|\r|INFO |WARNING |streaming_executor")


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def preprocess(tmp_path: Path, *extra_sets: str, flags=()):
    """`workflows preprocess` on a few local rows (building the quickstart data would take longer)."""
    rows = tmp_path / "raw" / "rows.jsonl"
    rows.parent.mkdir(exist_ok=True)
    rows.write_text("".join(json.dumps({"text": f"row {i} about {label}", "label": label}) + "\n"
                            for i in range(12) for label in ("a", "b", "c")))
    overrides = [*tiny_overrides(tmp_path), "data.builtin=null", f"data.source={rows.parent}/", *extra_sets]
    return run_cli("preprocess", *flags, "--config", str(QUICKSTART), *sets(overrides), timeout=300)


def log_path(stderr: str) -> Path:
    match = re.search(r"^workflows logs: Ray's output goes to (\S+\.log)", stderr, re.M)
    assert match, stderr[-3000:]
    return Path(match.group(1))


@pytest.mark.integration
def test_ray_output_goes_to_the_log_file_and_the_terminal_stays_short(tmp_path):
    res = preprocess(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    log = log_path(res.stderr)
    assert log.parent == tmp_path / "runs" / "quickstart" / "logs" and log.name.startswith("preprocess-")
    text = log.read_text()
    assert "streaming_executor" in text and "Dataset" in text  # Ray Data's own lines
    assert "workflows preprocess:" in text  # the platform's lines too, for context
    terminal = (res.stdout + res.stderr).splitlines()
    assert len(terminal) <= 15, res.stdout + res.stderr
    noise = [ln for ln in terminal if RAY_NOISE.search(ln)]
    assert not noise, noise
    # every line is the platform's own
    assert all(ln.startswith("workflows ") for ln in res.stderr.splitlines()), res.stderr
    assert "workflows preprocess summary written to" in res.stderr


@pytest.mark.integration
def test_a_failure_prints_the_error_then_the_log_tail(tmp_path):
    """An exception raised in a Ray actor (not a user error): one error line, the end of the log
    (where the actor's traceback is), and the log's path; exit status 1."""
    tok = tmp_path / "broken-tokenizer"
    tok.mkdir()
    (tok / "config.json").write_text("{")
    res = preprocess(tmp_path, f"preprocess.tokenizer={tok}")
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    errors = [i for i, ln in enumerate(lines) if ln.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    tail = lines[errors[0] + 1:]
    assert re.match(r"the last \d+ lines of Ray's output:", tail[0]), res.stderr
    assert any("not a valid JSON file" in ln for ln in tail[1:-1]), res.stderr
    assert tail[-1] == f"workflows full log: {log_path(res.stderr)}"
    assert "\x1b[" not in res.stderr and "Traceback (most recent call last)" in log_path(res.stderr).read_text()


@pytest.mark.integration
def test_a_user_error_after_ray_started_keeps_its_one_line(tmp_path):
    res = preprocess(tmp_path, "data.builtin=null", f"data.source={tmp_path}/nothing/")
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"error: no shard matched {tmp_path}/nothing/" in res.stderr and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1] == f"workflows full log: {log_path(res.stderr)}"


@pytest.mark.integration
def test_verbose_brings_ray_output_back(tmp_path):
    tok = tmp_path / "broken-tokenizer"
    tok.mkdir()
    (tok / "config.json").write_text("{")
    res = preprocess(tmp_path, f"preprocess.tokenizer={tok}", flags=["-v"])
    assert res.returncode == 1
    assert "Ray's output goes to" not in res.stderr and not (tmp_path / "runs" / "quickstart" / "logs").exists()
    # the Ray task's traceback as Ray hands it back (tokenizing runs in Ray Data tasks: fused into the
    # map side of the stored rows' shuffle, so the task is named ray::map()), with the tokenizing
    # frame, and the driver's own traceback, as before
    assert re.search(r"ray::\w+(\(\w+\))?\(\)(\x1b\[\d+m)? \(pid=\d+", res.stderr), res.stderr[-3000:]
    assert re.search(r"materialize\.py\", line \d+, in tokenize_batch", res.stderr), res.stderr[-3000:]
    assert "Traceback (most recent call last)" in res.stderr


SIGNAL_IN_DEL = """
import os, signal, threading, time
from workflows import stop
stop.install()
class Slow:
    def __del__(self):  # the signal comes while this runs, as in Ray Data's iterators' shutdown
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t = time.time()
        while time.time() - t < 0.5:
            pass
try:
    Slow()
    t = time.time()
    while time.time() - t < 10:
        pass
    print("ran on")
except stop.Stopped as e:
    print("stopped", e.name)
"""


def test_a_signal_that_lands_in_a_destructor_still_stops_the_command():
    """Python only prints an exception raised in a __del__: the Stopped it would lose comes again."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    res = subprocess.run([sys.executable, "-c", SIGNAL_IN_DEL], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "stopped SIGTERM", res.stdout + res.stderr[-2000:]
    assert "Exception ignored" not in res.stderr, res.stderr


EXIT_WITHOUT_TEARDOWN = """
import atexit, concurrent.futures, sys, threading, time
from workflows.cli import exit_without_teardown
out = sys.argv[1]
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
concurrent.futures.ThreadPoolExecutor(2).submit(int).result()  # an idle worker, as Ray Data's leave
threading.Thread(target=lambda: (time.sleep(0.5), open(out + ".thread", "w").write("done"))).start()
sys.stdout.write("the last line, unflushed")
exit_without_teardown(3)
"""


def test_a_command_s_end_skips_teardown_but_not_its_threads_atexit_or_output(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = str(tmp_path / "out")
    res = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_TEARDOWN, out], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert (res.returncode, res.stdout) == (3, "the last line, unflushed"), res.stderr[-2000:]
    assert Path(out + ".atexit").read_text() == "ran" and Path(out + ".thread").read_text() == "done"


@pytest.mark.integration
def test_sigterm_stops_a_long_command_in_one_line_and_leaves_no_ray(tmp_path):
    """SIGTERM to a command mid-run (preprocess, once Ray is up): Ray shut down, one line, exit 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import ROOT

    rows = tmp_path / "raw" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text("".join(json.dumps({"text": f"row {i} " + "word " * 40, "label": "ab"[i % 2]}) + "\n"
                            for i in range(40_000)))  # enough to still be tokenizing when the signal comes
    overrides = [*tiny_overrides(tmp_path), "data.builtin=null", f"data.source={rows.parent}/"]
    err = tmp_path / "stderr"
    with open(err, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "workflows", "preprocess", "--config", str(QUICKSTART),
                                 *sets(overrides)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink,
                                start_new_session=True)
    try:
        def ray_workers() -> list[psutil.Process] | None:
            """The command's processes once it is preprocessing on Ray's workers (None before)."""
            assert proc.poll() is None, err.read_text()
            if "shard(s) from" not in err.read_text():  # Ray up, the stage's work under way
                return None
            procs = psutil.Process(proc.pid).children(recursive=True)
            try:
                return procs if any(p.name().startswith("ray::") for p in procs) else None
            except psutil.NoSuchProcess:
                return None

        ray_procs = wait_until(ray_workers, 240, "the command to preprocess on Ray's workers", every=0.2)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.read_text()
    assert rc == 143 and took < 30, (rc, took, text[-3000:])
    lines = text.splitlines()
    assert lines[-1].startswith("stopped by SIGTERM; Ray's output is in "), text
    assert not lines[-2].startswith("stopped"), text  # one line
    assert "Traceback" not in text
    def left() -> list[str]:
        out = []
        for p in ray_procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(" ".join(p.cmdline()[:2]))
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.time() + 2  # gone within 2 s of the exit, as before; no wait once they are gone
    while (still := left()) and time.time() < deadline:
        time.sleep(0.1)
    assert not still, still


def test_epoch_progress_prints_epoch_ends_not_step_checkpoints(monkeypatch):
    """train.checkpoint_every_steps reports mid-epoch checkpoints (score NaN, step_checkpoint set):
    they are not an epoch's end, so the progress line must not say "epoch 0 done: loss nan"."""
    from workflows import progress

    said: list[str] = []
    monkeypatch.setattr(progress, "say", said.append)
    callback = progress.EpochProgress(epochs=1, metric="val_f1")
    callback.after_report(None, [{"epoch": 0, "global_step": 3, "consumed": 96, "step_checkpoint": True,
                                  "val_f1": float("nan")}], None)
    assert said == []
    callback.after_report(None, [{"epoch": 0, "train_loss": 1.303, "val_f1": 0.8515}], None)
    assert len(said) == 1 and said[0].startswith("train: epoch 0 (1 of 1) done: loss 1.3030, val_f1 0.8515"), said


def test_the_token_note_is_shown_once_per_machine_for_a_cluster_the_command_starts(tmp_path, monkeypatch, capsys):
    """Ray's token-authentication line, as a command's log file gets it from ray.init: for a cluster
    the command starts itself, on the terminal the first time on this machine only; for a cluster
    it joins, every time (the user's state directory keeps the marker)."""
    from workflows import console

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    ray_line = ("2026-11-26 13:00:00,000\tWARNING authentication_token_setup.py:86 -- Token authentication is "
                "enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.\n")

    def command(own_cluster: bool) -> str:
        """What one command's relay puts on the terminal."""
        monkeypatch.setattr(console, "_own_cluster", own_cluster)
        log = tmp_path / f"command-{len(list(tmp_path.glob('command-*')))}.log"
        log.touch()
        relay = console.Relay(log)
        log.write_text(ray_line)
        relay.poll()
        return capsys.readouterr().err

    note = "Ray token authentication is on"
    assert note in command(own_cluster=True)
    assert note not in command(own_cluster=True)
    assert note in command(own_cluster=False) and note in command(own_cluster=False)
    assert (tmp_path / "state" / "workflows" / "shown" / "ray-token-auth-on").exists()
