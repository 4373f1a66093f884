"""Run HAProxy so that it cannot outlive the command whose cluster started it.

Ray Serve's HAProxyManager actor starts `haproxy -db -f CFG` as a plain child and kills it only in
its own orderly shutdown. When the command is killed (SIGKILL to its process group), Ray's raylet
dies with it and the actor process exits without that shutdown: HAProxy stayed, reparented to
init, holding the serve port. Ray cannot be told to start HAProxy differently, but it runs the
executable named by RAY_SERVE_HAPROXY_BINARY_PATH; workflows.serve.ingress points it at a wrapper
that runs this file, which, in the same process (Serve waits for the pid it started to answer on
the admin socket, so exec, never a child):

1. asks the kernel for SIGKILL when the parent (the manager actor) dies (PR_SET_PDEATHSIG), and
   exits if the parent died before that took effect;
2. leaves a watchdog that kills this HAProxy once the command (WORKFLOWS_INGRESS_OWNER=pid:start
   time) is gone, for where the actor outlives it (stuck in its exit); the watchdog exits with
   HAProxy;
3. execs the real binary with Serve's arguments, its configuration (`-f`) first given its pages'
   own address (`local_pages`): Ray's template binds HAProxy's stats and Prometheus pages, which
   answer without the bearer token, on every interface; here they listen on 127.0.0.1 only, and
   the frontends that serve the model keep the address serve.host gave them.

Run by path with `python -S -E` (stdlib only: no site-packages, no workflows import), so that
every HAProxy start or reload costs a few milliseconds, not a package import.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import sys

PR_SET_PDEATHSIG = 1
OWNER_ENV = "WORKFLOWS_INGRESS_OWNER"


def start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): a pid and it name one process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()


def owner_alive(owner: str) -> bool:
    pid, _, started = owner.partition(":")
    return start_time(int(pid)) == started


def _die_with_parent() -> None:
    ppid = os.getppid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:  # Linux; elsewhere (or where it fails) the watchdog alone
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if ppid == 1 or os.getppid() != ppid:  # the manager died before the signal was armed
        sys.exit(1)


def _leave_watchdog(owner: str) -> None:
    """A grandchild (reparented, so not a child HAProxy would have to reap) that execs this file
    with `--watch`: a new command line, so that nothing counts it as a HAProxy of this config."""
    try:
        me = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):  # no pidfds (not Linux 5.3+): the parent-death signal alone
        return
    try:
        boss = os.pidfd_open(int(owner.split(":")[0]))
    except ProcessLookupError:  # the command is gone already
        sys.exit(1)
    except OSError:
        os.close(me)
        return
    if not owner_alive(owner):
        sys.exit(1)
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        os.close(me)
        os.close(boss)
        return
    try:
        if os.fork():
            os._exit(0)
        os.setsid()  # out of the manager's process group: a signal to it is not meant for us
        for fd in (me, boss):
            os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-S", "-E", __file__, "--watch", str(me), str(boss), owner])
    finally:
        os._exit(1)


def watch(me: int, boss: int, owner: str) -> None:
    """Until HAProxy (pidfd `me`) exits: if the command (pidfd `boss`) exits, kill HAProxy."""
    while True:
        ready, _, _ = select.select([me, boss], [], [], 60)
        if me in ready:
            return
        if boss in ready or not owner_alive(owner):
            signal.pidfd_send_signal(me, signal.SIGKILL)
            return


SERVING = ("http_frontend", "grpc_frontend")  # Ray's frontends of the model: bound where serve.host says
_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|resolvers|peers|userlist|program|cache)\b\s*(\S*)")
_ANY_ADDRESS = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)\b")


def local_pages(config: str) -> str:
    """`config` with every `bind` on all interfaces (`:PORT`, `*:PORT`, `0.0.0.0:PORT`) outside the
    serving frontends bound to 127.0.0.1: the stats and Prometheus pages are for this machine."""
    out, section = [], ""
    for line in config.splitlines(keepends=True):
        if m := _SECTION.match(line):
            section = m.group(2)
        elif section not in SERVING:
            line = _ANY_ADDRESS.sub(r"\g<1>127.0.0.1:\2", line)
        out.append(line)
    return "".join(out)


def _local_config(args: list[str]) -> list[str]:
    """Serve's arguments, `-f CFG` replaced by CFG rewritten by `local_pages`, written beside it under
    this process's pid (HAProxy's once exec'd: Serve writes CFG again for each reload, while this
    HAProxy keeps running); the files of HAProxies that are gone are removed."""
    if "-f" not in args or args.index("-f") + 1 >= len(args):
        return args
    i = args.index("-f") + 1
    with open(args[i]) as f:
        config = f.read()
    rewritten = local_pages(config)
    if rewritten == config:
        return args
    folder = os.path.dirname(os.path.abspath(args[i]))
    for name in os.listdir(folder):
        if (m := re.fullmatch(r"haproxy-local-(\d+)\.cfg", name)) and not _alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
    path = os.path.join(folder, f"haproxy-local-{os.getpid()}.cfg")
    with open(f"{path}.tmp", "w") as f:
        f.write(rewritten)
    os.replace(f"{path}.tmp", path)
    return [*args[:i], path, *args[i + 1:]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> None:
    if argv[1] == "--watch":
        watch(int(argv[2]), int(argv[3]), argv[4])
        return
    real, args = argv[1], argv[2:]
    _die_with_parent()
    owner = os.environ.get(OWNER_ENV)
    if owner:
        _leave_watchdog(owner)
    os.execv(real, [real, *_local_config(args)])


if __name__ == "__main__":
    main(sys.argv)
