"""The Grafana dashboards in cluster/grafana/ and the scrape configs in cluster/monitoring/, without a
cluster: every dashboard parses, and every panel's PromQL names only metrics that something on the
cluster exports:

- Ray: the metrics of the installed Ray's own dashboards (its panel definitions, the Ray version the
  project pins; cluster/grafana/ray-*.json must equal what it generates);
- NVIDIA's DCGM exporter: the fields of the counters file it runs with (cluster/monitoring/dcgm-exporter.yaml);
- the platform: the Ray metrics its code creates (each `@per_cluster` factory of a metric, run here
  with Ray's metric classes recording the names), as Ray exports them (`ray_` prefix, `_total` for a
  counter, `_bucket`/`_sum`/`_count` for a histogram).
The PodMonitors and scrape configs select the pods and ports the manifests give those exporters."""

from __future__ import annotations

import csv
import importlib
import io
import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "cluster" / "grafana"
MONITORING = ROOT / "cluster" / "monitoring"
DASHBOARDS = sorted(GRAFANA.rglob("*.json"))

# PromQL words that are not metric names
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "le", "atan2"}
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are neither functions nor keywords,
    outside label matchers, strings, ranges and grouping clauses; Grafana's $variables dropped."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # strings
    text = re.sub(r"\{[^{}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges, subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in PROMQL_WORDS:
            continue
        names.add(name)
    return names


def base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out += panels(p)  # a collapsed row holds its panels
    return out


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(p.get("title", "?"), t["expr"]) for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


@cache
def ray_generated() -> dict[str, dict]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_dashboards", GRAFANA / "ray_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate()


@cache
def ray_metrics() -> set[str]:
    return {base(n) for d in ray_generated().values() for _, e in exprs(d) for n in metric_names(e)}


@cache
def dcgm_metrics() -> set[str]:
    (counters,) = [d for d in yaml.safe_load_all((MONITORING / "dcgm-exporter.yaml").read_text())
                   if d["kind"] == "ConfigMap"]
    rows = csv.reader(io.StringIO(counters["data"]["counters.csv"]))
    return {r[0].strip() for r in rows if r and r[0].strip() and not r[0].startswith("#")}


@cache
def platform_metrics() -> set[str]:
    """The names the platform's metric factories create, as exported: every `@per_cluster` factory
    in the package is run with Ray's metric classes replaced by recorders (factories of anything else,
    an actor's handle, fail here and are skipped)."""
    import ray.serve.metrics
    import ray.util.metrics

    from workflows.cluster_scoped import PerCluster

    made: set[str] = set()

    def recorder(kind: str):
        class Made:
            def __init__(self, name, *args, **kwargs):
                made.add(f"ray_{name}" + {"Counter": "_total", "Histogram": "_bucket"}.get(kind, ""))

        return Made

    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "workflows").rglob("*.py")
               if "@per_cluster" in p.read_text()}
    saved = {(m, k): getattr(m, k) for m in (ray.util.metrics, ray.serve.metrics) for k in ("Counter", "Gauge",
                                                                                           "Histogram")}
    try:
        for (m, k) in saved:
            setattr(m, k, recorder(k))
        for name in sorted(modules):
            module = importlib.import_module(name)
            for obj in vars(module).values():
                if isinstance(obj, PerCluster):
                    try:
                        obj.factory()
                    except Exception:
                        pass
    finally:
        for (m, k), v in saved.items():
            setattr(m, k, v)
    return {base(n) for n in made}


def known() -> set[str]:
    return ray_metrics() | dcgm_metrics() | platform_metrics()


def test_the_metric_name_reader():
    expr = ('sum by (application, le) (rate(ray_x_bucket{endpoint="/predict", a=~"$A"}[$__rate_interval])) / on() '
            '(sum(autoscaler_y{resource=\'GPU\'}) or vector(0)) + histogram_quantile(0.5, z_total offset 5m)')
    assert metric_names(expr) == {"ray_x_bucket", "autoscaler_y", "z_total"}
    assert base("ray_x_bucket") == "ray_x" and base("ray_workflows_cache_hits_total") == "ray_workflows_cache_hits"


def test_the_known_metrics_come_from_each_exporter():
    assert {"ray_workflows_serve_requests", "ray_workflows_serve_request_latency_ms", "ray_workflows_cache_hits",
            "ray_workflows_train_samples_per_second"} <= platform_metrics()
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"} <= dcgm_metrics()
    assert {"ray_node_cpu_utilization", "ray_node_gpus_utilization", "ray_serve_num_http_requests"} <= ray_metrics()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: str(p.relative_to(GRAFANA)))
def test_every_panel_reads_metrics_that_are_exported(path):
    dashboard = json.loads(path.read_text())  # parses
    assert dashboard.get("title") and dashboard.get("uid") and panels(dashboard), path
    found = exprs(dashboard)
    assert found, f"{path}: no panel has a query"
    unknown = {(title, n) for title, e in found for n in metric_names(e) if base(n) not in known()}
    assert not unknown, f"{path.name}: panels read metrics nothing exports: {sorted(unknown)}"


def test_a_misspelt_metric_would_be_caught():
    expr = "sum(rate(ray_workflows_serve_requestz_total[5m]))"
    assert {base(n) for n in metric_names(expr)} - known() == {"ray_workflows_serve_requestz"}


def test_dashboard_uids_are_unique():
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids)), uids


def test_rays_dashboards_are_the_installed_rays():
    for name, generated in ray_generated().items():
        assert json.loads((GRAFANA / name).read_text()) == generated, \
            f"{name} differs from the installed Ray's: run `python cluster/grafana/ray_dashboards.py`"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((MONITORING / name).read_text()) if d]


def test_the_podmonitors_and_scrape_configs_find_the_exporters():
    from tests.test_cluster_configs import MANIFESTS, groups, ray_docs

    monitors = {d["metadata"]["name"]: d["spec"] for d in _docs("podmonitors.yaml")}
    assert all(d["apiVersion"] == "monitoring.coreos.com/v1" and d["kind"] == "PodMonitor"
               for d in _docs("podmonitors.yaml"))
    # Ray pods: KubeRay labels each ray.io/is-ray-node=yes; each Ray container names its :8080 port `metrics`
    assert monitors["ray-nodes"]["selector"]["matchLabels"] == {"ray.io/is-ray-node": "yes"}
    assert monitors["ray-nodes"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for path in MANIFESTS:
        for doc in ray_docs(path.name):
            for group, g in groups(doc):
                ports = {p.get("name"): p["containerPort"] for p in g["template"]["spec"]["containers"][0]["ports"]}
                assert ports.get("metrics") == 8080, f"{path.name} {group}: no `metrics` port 8080"
    # the DCGM exporter: its pods' labels and port, and the counters file it runs with is the ConfigMap's
    dcgm = {d["kind"]: d for d in _docs("dcgm-exporter.yaml")}
    pod = dcgm["DaemonSet"]["spec"]["template"]
    assert monitors["dcgm-exporter"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9400}
    counters = container["args"][container["args"].index("-f") + 1]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == counters)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == dcgm["ConfigMap"]["metadata"]["name"]
    assert mount["subPath"] in dcgm["ConfigMap"]["data"]
    # without the operator: the same two jobs
    scrape = yaml.safe_load((MONITORING / "prometheus-scrape.yaml").read_text())["scrape_configs"]
    assert {j["job_name"] for j in scrape} == {"ray-nodes", "dcgm-exporter"}
    keep = {j["job_name"]: [r for r in j["relabel_configs"] if r.get("action") == "keep"] for j in scrape}
    assert {"source_labels": ["__meta_kubernetes_pod_label_ray_io_is_ray_node"], "regex": "yes",
            "action": "keep"} in keep["ray-nodes"]
