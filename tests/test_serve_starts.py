"""`workflows serve` always starts (issue #39): HAProxy's ports come from outside the ephemeral range,
which a busy machine's outgoing connections keep drawing from, and a port taken all the same is
retried with new ones. Real: a cluster of its own with the bundled HAProxy, Serve started 20 times
through the path every `workflows serve` takes, a process churning connections meanwhile. The gate
starts Serve 3 times, which shows the mechanism (ports outside the range, the taken port retried);
`make test-all` starts it 20 times."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import free_port
from workflows.net import ephemeral_range
from workflows.serve.ingress import haproxy_binary

SCRIPT = ROOT / "tests" / "serve_starts.py"


def _lines(out: str, tag: str) -> list[dict]:
    return [json.loads(line[len(tag):]) for line in out.splitlines() if line.startswith(tag)]


@pytest.mark.integration
@pytest.mark.skipif(haproxy_binary() is None or ephemeral_range() is None, reason="no HAProxy binary, or not Linux")
@pytest.mark.parametrize("n_starts", [3, pytest.param(20, marks=pytest.mark.extended)])
def test_serve_starts_every_time_while_connections_churn_and_retries_a_taken_port(tmp_path, n_starts):
    churner = subprocess.Popen([sys.executable, str(SCRIPT), "churn", "1500", str(free_port())],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert churner.stdout.readline().strip() == "churning"
        env = {**os.environ, "RAY_ADDRESS": "", "WORKFLOWS_DASHBOARD_PORT": "0"}
        res = subprocess.run([sys.executable, str(SCRIPT), "starts", str(n_starts), str(tmp_path)], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=1500)
        assert churner.poll() is None, "the churn stopped: the starts ran without it"
    finally:
        churner.kill()
        churner.wait()
    starts = _lines(res.stdout, "start: ")
    assert res.returncode == 0 and len(starts) == n_starts, res.stdout[-3000:] + res.stderr[-3000:]
    low, high = ephemeral_range()
    assert all(s["stats_answered"] for s in starts), starts
    assert [p for s in starts for p in s["ports"] if low <= p <= high] == []
    # no port was lost to the churn (a start may be retried for a proxy that a loaded machine's
    # health checks killed: that is said too, but not as a bind failure)
    before_retries = res.stderr.split("phase: retries")[0]
    lost = [line for line in before_retries.splitlines() if "did not start (" in line]
    assert not [line for line in lost if "bind" in line or "in use" in line], lost
    assert sum(s["attempts"] for s in starts) == n_starts + len(lost), (starts, lost)
    (retry,) = _lines(res.stdout, "retry: ")
    assert retry["attempts"] == 2, retry  # the first try's stats port was taken: started again, new ports
    error = retry["error"]
    assert error and "\n" not in error and f"[127.0.0.1:{retry['taken']}]" in error and "2 attempts" in error, error
