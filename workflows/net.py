"""Free TCP ports on this machine: the one place the package (and its tests) asks the OS for one.

A port found free here is free only until someone else binds it; callers start their server at once
(and retry where a lost race matters, as workflows.storage.embedded does)."""

from __future__ import annotations

import socket

LOCALHOST = "127.0.0.1"


def port_free(host: str, port: int) -> bool:
    """Whether `port` can be bound on `host` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOCALHOST, preferred: int | None = None) -> int:
    """`preferred` if it can be bound on `host` now, else a port the OS picks."""
    return free_ports(1, host, preferred)[0]


def free_ports(n: int, host: str = LOCALHOST, preferred: int | None = None) -> list[int]:
    """`n` distinct ports that can be bound on `host` now: all held at once while they are picked, so
    none comes back twice. `preferred`, when it is free, is the first."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for i, s in enumerate(socks):
            if i == 0 and preferred is not None:
                try:
                    s.bind((host, preferred))
                    continue
                except OSError:
                    pass
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
