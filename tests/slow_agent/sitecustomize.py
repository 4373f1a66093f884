"""Put on PYTHONPATH by tests/test_ray_start.py: makes the first Ray dashboard agent that starts while
$SLOW_AGENT_MARKER holds "armed" wait 25 s before its imports, as a busy machine's can (Ray's raylet
gives it 15 s), and writes that agent's command line into the marker so that it fires once."""

import os
import sys
import time

_marker = os.environ.get("SLOW_AGENT_MARKER")
if _marker and sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    try:
        with open(_marker) as f:
            _armed = f.read() == "armed"
    except FileNotFoundError:
        _armed = False
    if _armed:
        with open(_marker, "w") as f:
            f.write("\n".join(sys.argv))
        time.sleep(25)
