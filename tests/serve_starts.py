"""Run by test_serve_starts.py, in a process of its own (a cluster of its own, with HAProxy in front).

`serve_starts.py starts N DIR`: starts Ray as `workflows serve` does (workflows.runtime.init_ray,
serve.haproxy=true), then N times starts Serve through workflows.serve.ingress.start_serve (the
start of every `workflows serve`) and shuts it down again, printing a `start: {json}` line each:
the attempts it took, the ports HAProxy was given, whether its stats port answered.

`serve_starts.py churn POOL PORT`: what a busy Ray node does to the ephemeral range: keeps POOL
outgoing connections open and replaces them as fast as it can, each from a port the kernel draws
from the range as for a bind to port 0 (source_address), closed with a reset (no TIME_WAIT left
for the rest of the machine)."""

import json
import socket
import struct
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def churn(pool: int, port: int) -> None:
    server = socket.create_server(("127.0.0.1", port), backlog=4096)
    server.setblocking(False)
    held: list[socket.socket] = []
    print("churning", flush=True)
    while True:
        conn = socket.create_connection(server.getsockname(), source_address=("127.0.0.1", 0))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset: no TIME_WAIT
        held.append(conn)
        try:
            while True:
                server.accept()[0].close()
        except BlockingIOError:
            pass
        if len(held) > pool:
            held.pop(0).close()
            time.sleep(0.005)  # about 200 new connections a second: busy, not a CPU hog on 2 cores


def starts(n: int, tmp: str) -> None:
    from ray import serve

    from workflows.config import load_config
    from workflows.net import listen_ports
    from workflows.runtime import init_ray
    from workflows.serve import ingress

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        "storage.embedded.enabled=false", f"storage.root={tmp}/store", f"output_dir={tmp}/runs",
        f"cache.dir={tmp}/cache", "tracking.enabled=false", "serve.haproxy=true", "ray.dashboard=false",
        "ray.num_cpus=1"])
    init_ray(cfg)
    for i in range(n):
        picks: list[dict] = []

        def pick():
            picks.append(ingress.port_env())
            return picks[-1]

        t0 = time.time()
        # serve.port as a user sets it (8000): not a port the churn could take meanwhile
        attempts = ingress.start_serve(cfg, {"host": "127.0.0.1", "port": listen_ports(1)[0]}, {}, pick=pick)
        stats = int(picks[-1]["RAY_SERVE_HAPROXY_STATS_PORT"])
        with socket.socket() as s:
            answered = s.connect_ex(("127.0.0.1", stats)) == 0
        print("start: " + json.dumps({"i": i, "attempts": attempts, "seconds": round(time.time() - t0, 1),
                                      "ports": [int(p) for p in picks[-1].values()], "stats_answered": answered}),
              flush=True)
        serve.shutdown()
    print("phase: retries", file=sys.stderr, flush=True)  # what start_serve says (stderr) after this is theirs
    retries(cfg)


def retries(cfg) -> None:
    """A port HAProxy cannot bind (held here on 0.0.0.0, as anyone's socket would be): the start is
    tried again with new ports; where every try gets it, the command fails with one line."""
    from ray import serve

    from workflows.errors import UserError
    from workflows.net import listen_ports
    from workflows.serve import ingress

    held = socket.create_server(("0.0.0.0", listen_ports(1)[0]))
    taken = str(held.getsockname()[1])
    tries = [ingress.port_env(), {**ingress.port_env(), "RAY_SERVE_HAPROXY_STATS_PORT": taken}]  # popped from the end
    attempts = ingress.start_serve(cfg, {"host": "127.0.0.1", "port": listen_ports(1)[0]}, {}, pick=tries.pop)
    serve.shutdown()
    try:
        ingress.start_serve(cfg, {"host": "127.0.0.1", "port": listen_ports(1)[0]}, {}, attempts=2,
                            pick=lambda: {**ingress.port_env(), "RAY_SERVE_HAPROXY_STATS_PORT": taken})
        error = None
    except UserError as e:
        error = str(e)
    print("retry: " + json.dumps({"attempts": attempts, "taken": taken, "error": error}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "churn":
        churn(int(sys.argv[2]), int(sys.argv[3]))
    else:
        starts(int(sys.argv[2]), sys.argv[3])
