"""workflows/net.py: the one free-port helper, and no copy of it elsewhere in the repository."""

from __future__ import annotations

import ast
import socket
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workflows.net import free_port, free_ports


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_free_preferred_port_is_kept_and_a_taken_one_replaced():
    from workflows.runtime import _port_or_free  # tests/conftest.py's name for it

    taken = free_port()
    with socket.socket() as s:  # a port free a moment ago, held now
        s.bind(("127.0.0.1", taken))
        s.listen()
        other = free_port(preferred=taken)
        assert other != taken
        assert _port_or_free(taken) != taken
    assert free_port(preferred=taken) == taken
    assert _port_or_free(taken) == taken


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(p > 0 for p in ports)


def _binds_port_zero(call: ast.Call) -> bool:
    """`x.bind((host, 0))`: the OS picks the port, i.e. a free-port finder."""
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "bind" and len(call.args) == 1
            and isinstance(call.args[0], ast.Tuple) and len(call.args[0].elts) == 2
            and isinstance(call.args[0].elts[1], ast.Constant) and call.args[0].elts[1].value == 0)


def test_no_other_module_finds_free_ports_itself():
    found = []
    for folder in ("workflows", "tests", "reliability", "benchmarks", "notebooks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "workflows" / "net.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree)
                      if isinstance(n, ast.Call) and _binds_port_zero(n)]
    assert not found, f"bind((host, 0)) outside workflows/net.py (use workflows.net.free_port): {found}"


def test_the_helper_itself_is_seen_by_the_scan():
    tree = ast.parse(Path(ROOT / "workflows" / "net.py").read_text())
    assert any(isinstance(n, ast.Call) and _binds_port_zero(n) for n in ast.walk(tree))


def test_listen_ports_come_from_outside_the_ephemeral_range_and_are_free_on_every_address(tmp_path):
    from workflows.net import ephemeral_range, listen_ports

    low, high = ephemeral_range() or (32768, 60999)
    assert all(not low <= p <= high and p >= 20000 for p in listen_ports(8))
    narrow = tmp_path / "range"
    narrow.write_text("20000\t65529\n")  # leaves 65530-65535 above it, nothing below (the floor)
    assert ephemeral_range(str(narrow)) == (20000, 65529)
    with socket.socket() as elsewhere, socket.socket() as on_loopback:
        # taken on another local address: free on 127.0.0.1, yet HAProxy's bind to 0.0.0.0 would fail
        elsewhere.bind(("127.0.0.2", 65530))
        on_loopback.bind(("127.0.0.1", 65531))
        assert sorted(listen_ports(4, path=str(narrow))) == [65532, 65533, 65534, 65535]
        with pytest.raises(OSError, match="no 5 free ports outside the ephemeral range 20000-65529"):
            listen_ports(5, path=str(narrow))  # 65530 is no fifth one


def test_free_ports_come_from_outside_the_ephemeral_range():
    """free_port serves servers that bind a while later (the embedded endpoint, Ray's dashboard, the
    tests' Serve ports): from the ephemeral range an outgoing connection could take one meanwhile."""
    from workflows.net import ephemeral_range

    span = ephemeral_range()
    if span is None:
        pytest.skip("no ip_local_port_range here")
    for port in [free_port(), *free_ports(8)]:
        assert not span[0] <= port <= span[1], (port, span)


def test_a_preferred_port_of_zero_means_any_free_port():
    """WORKFLOWS_DASHBOARD_PORT=0 (the tests', and two commands starting at once) asks for any port:
    returned as 0 it became the state API's address http://127.0.0.1:0."""
    port = free_port(preferred=0)
    assert port > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_whose_closed_connections_wait_out_their_close_is_free():
    """A server that closed its connections first leaves them in TIME_WAIT for a minute; the port is free for
    the next server, which binds it with SO_REUSEADDR as servers do (HAProxy, uvicorn): a second `workflows
    pipeline` right after the first is not refused serve.port."""
    from workflows.net import port_free

    port = free_port()
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            conn.close()  # the server's end closes first: it waits in TIME_WAIT
            assert client.recv(1) == b""
    assert port_free("127.0.0.1", port)
    with socket.socket() as again:  # and a server binds it
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()
