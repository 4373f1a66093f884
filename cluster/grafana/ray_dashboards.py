"""Write Ray's own Grafana dashboards (what Ray generates for its dashboard's metrics page, from the
installed Ray's panel definitions) into cluster/grafana/ray-*.json, for a Grafana that has no Ray head
to read them from. Run it again after upgrading Ray: `python cluster/grafana/ray_dashboards.py`;
tests/test_dashboards.py checks the files equal what the installed Ray generates."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("default", "serve", "serve_deployment", "data", "train")  # ray.dashboard's generate_<kind>_...


def generate() -> dict[str, dict]:
    """{file name: dashboard} of the installed Ray."""
    from ray.dashboard.modules.metrics import grafana_dashboard_factory as factory

    return {f"ray-{kind.replace('_', '-')}.json":
            json.loads(getattr(factory, f"generate_{kind}_grafana_dashboard")()[0]) for kind in KINDS}


if __name__ == "__main__":
    for name, dashboard in generate().items():
        (HERE / name).write_text(json.dumps(dashboard, indent=2, sort_keys=True) + "\n")
        print(f"wrote {HERE / name}")
