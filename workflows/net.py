"""Free TCP ports on this machine: the one place the package (and its tests) asks the OS for one.

A port found free here is free only until someone else binds it; callers start their server at once
(and retry where a lost race matters, as workflows.storage.embedded and workflows.serve.ingress do).

Port 0 draws from the ephemeral range (ip_local_port_range), which every outgoing connection on the
machine draws from too, Ray's many among them: a port picked that way may be some connection's by
the time a server that starts seconds later binds it. So every pick here (free_port, free_ports,
listen_ports) is from outside that range, where it is known; port 0 (os_ports) only as a fallback.
"""

from __future__ import annotations

import random
import socket

LOCALHOST = "127.0.0.1"
ANY = "0.0.0.0"
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# Where listen_ports looks, outside the ephemeral range: above Ray's worker ports (its default
# min/max_worker_port, 10002-19999, bound as workers start) and well-known services' ports below.
LISTEN_FLOOR = 20000
_pick = random.SystemRandom()  # not the `random` a test or a library seeds: two processes must not draw alike


def port_free(host: str, port: int) -> bool:
    """Whether a server can bind `port` on `host` now. With SO_REUSEADDR, as servers bind (HAProxy,
    uvicorn, Ray's): connections the last server closed, waiting out their close (TIME_WAIT, a
    minute), do not hold the port; a listener does."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOCALHOST, preferred: int | None = None) -> int:
    """`preferred` if it can be bound on `host` now, else a free port outside the ephemeral range
    where it is known (listen_ports)."""
    return free_ports(1, host, preferred)[0]


def free_ports(n: int, host: str = LOCALHOST, preferred: int | None = None) -> list[int]:
    """`n` distinct ports that can be bound on `host` now, `preferred` first when it is free; the
    others from outside the ephemeral range (listen_ports): a server, the embedded endpoint, Ray's
    dashboard or a test's Serve port, binds its port a while after the pick."""
    first = [preferred] if preferred and port_free(host, preferred) else []  # 0: no preference (any port)
    if len(first) == n:
        return first
    for _ in range(8):  # listen_ports draws at random: redraw the rare pick of `preferred` itself
        rest = listen_ports(n - len(first), hosts=(host,))
        if not set(rest) & set(first):
            return first + rest
    raise OSError(f"no {n} distinct free ports on {host}")


def os_ports(n: int, host: str = LOCALHOST) -> list[int]:
    """`n` distinct ports the OS picks (port 0: the ephemeral range), all held at once while they are
    picked, so none comes back twice: only where the ephemeral range is unknown or full."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's (low, high) range for port 0 and outgoing connections; None where unknown (not Linux)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def listen_ports(n: int, hosts: tuple[str, ...] = (ANY, LOCALHOST), path: str = EPHEMERAL_RANGE_FILE) -> list[int]:
    """`n` distinct ports for servers that start a while later (HAProxy's): outside the ephemeral
    range, so that no outgoing connection takes one meanwhile, and free now on each of `hosts`
    (0.0.0.0 and 127.0.0.1: a server may bind either). Drawn at random, so that two commands
    picking at once rarely draw alike. Where the range is unknown or leaves fewer than `n` above
    LISTEN_FLOOR, ports the OS picks (os_ports), on the first host."""
    span = ephemeral_range(path)
    if span is None:
        return os_ports(n, hosts[0])
    low, high = span
    outside = [*range(LISTEN_FLOOR, low), *range(max(high + 1, LISTEN_FLOOR), 65536)]
    if len(outside) < n:  # a range that leaves (almost) nothing: the OS's pick, and the callers' retry
        return os_ports(n, hosts[0])
    picked: list[int] = []
    for _ in range(max(1000, 8 * len(outside))):  # a bound on the draws
        port = _pick.choice(outside)
        if port not in picked and all(port_free(h, port) for h in hosts):
            picked.append(port)
            if len(picked) == n:
                return picked
    raise OSError(f"no {n} free ports outside the ephemeral range {low}-{high} on {', '.join(hosts)}")
