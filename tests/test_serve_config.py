"""Serve config files and deployment options (no cluster needed): Ray Serve's own schema."""

import pytest
import yaml

from tests.conftest import QUICKSTART, ROOT, run_cli
from workflows.config import load_config
from workflows.errors import UserError
from workflows.serve.deploy_config import route_prefixes, serve_config


def test_emitted_config_is_a_valid_serve_config_with_side_by_side_versions(tmp_path):
    out = tmp_path / "serve.yaml"
    res = run_cli("serve", "--model", "quickstart:1", "--model", "quickstart:2", "--emit-config", str(out),
                  "--config", str(QUICKSTART), "--set", "serve.autoscaling.max_replicas=3", timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = yaml.safe_load(out.read_text())
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(doc)
    apps = {a["name"]: a for a in doc["applications"]}
    assert set(apps) == {"model-quickstart-v1", "model-quickstart-v2"}
    assert [a["route_prefix"] for a in doc["applications"]] == ["/quickstart/v1", "/quickstart/v2"]
    app = apps["model-quickstart-v2"]
    assert app["import_path"] == "workflows.serve.app:build_app"
    # paths made absolute: `serve run` builds the application in a worker with another working dir
    assert app["args"] == {
        "config": str(QUICKSTART),
        "model": "quickstart:2",
        "set": ["serve.autoscaling.max_replicas=3", f"storage.embedded.data_dir={ROOT / '.workflows' / 's3'}"],
    }
    assert "workflows store" in res.stdout  # what `serve run` of an embedded-store config needs first
    dep = app["deployments"][0]
    assert dep["name"] == "ModelServer" and "num_replicas" not in dep
    assert dep["autoscaling_config"]["max_replicas"] == 3 and dep["max_ongoing_requests"] >= 32
    assert doc["http_options"]["host"] == "127.0.0.1"


def test_build_app_takes_the_emitted_args_and_the_running_store(tmp_path):
    """An embedded-store config: without a running store, one line says what to start; with one,
    the application's replicas get its endpoint."""
    from ray.serve import Application

    from workflows.serve.app import build_app
    from workflows.storage.embedded import EmbeddedS3

    sets = ["serve.num_replicas=2", f"storage.embedded.data_dir={tmp_path}/s3"]
    doc = serve_config(load_config("quickstart", sets), "quickstart", sets, ["quickstart"])
    args = doc["applications"][0]["args"]
    assert args["config"] == "quickstart"  # a shipped config's name resolves on any node
    with pytest.raises(UserError, match=r"no process runs: start `workflows store`"):
        build_app(args)
    with EmbeddedS3(f"{tmp_path}/s3") as s3:
        app = build_app(args)
    assert isinstance(app, Application)
    assert app._bound_deployment.init_args[0]["storage"]["endpoint_url"] == s3.endpoint_url
    assert (
        doc["applications"][0]["route_prefix"] == "/" and doc["applications"][0]["deployments"][0]["num_replicas"] == 2
    )


def test_routes_and_bad_settings_are_clear():
    assert route_prefixes(["a", "b"]) == {"a": "/a", "b": "/b"}
    with pytest.raises(UserError, match="share a route"):
        route_prefixes(["a", "a:latest"])
    with pytest.raises(UserError, match="invalid model name"):
        route_prefixes(["../x"])
    with pytest.raises(UserError, match="max_replicas"):
        load_config(QUICKSTART, ["serve.autoscaling.min_replicas=5", "serve.autoscaling.max_replicas=2"])
    with pytest.raises(UserError, match="serve.precision"):
        load_config(QUICKSTART, ["serve.precision=fp8"])


def test_haproxy_auto_follows_the_binary_and_true_insists(tmp_path, monkeypatch):
    from workflows.serve import ingress

    fake = tmp_path / "haproxy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    auto, on, off = (load_config(QUICKSTART, [f"serve.haproxy={v}"]).serve for v in ("auto", "true", "false"))
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(fake))
    assert ingress.use_haproxy(auto) and ingress.use_haproxy(on) and not ingress.use_haproxy(off)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(tmp_path / "missing"))
    assert not ingress.use_haproxy(auto) and not ingress.use_haproxy(off)
    with pytest.raises(UserError, match="serve.haproxy=true, but no HAProxy binary"):
        ingress.use_haproxy(on)
    with pytest.raises(UserError, match="serve.haproxy"):
        load_config(QUICKSTART, ["serve.haproxy=sometimes"])


def test_each_cluster_gets_its_own_haproxy_ports_and_the_env_is_scoped(monkeypatch):
    import os

    from workflows.serve import ingress

    assert ingress.cluster_env(False) == {}
    a, b = ingress.cluster_env(True), ingress.cluster_env(True)
    ports = [a[f"RAY_SERVE_{k}_PORT"] for k in ("HAPROXY_STATS", "HAPROXY_METRICS", "FALLBACK_PROXY_HTTP",
                                                  "FALLBACK_PROXY_GRPC")]
    assert len(set(ports)) == 4 and "8500" not in ports  # Serve's proxy: not the port every cluster shares
    assert a["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    files = os.path.dirname(a["RAY_SERVE_HAPROXY_SOCKET_PATH"])  # the admin socket: this user's only
    assert os.stat(files).st_mode & 0o777 == 0o700 and files != os.path.dirname(b["RAY_SERVE_HAPROXY_SOCKET_PATH"])
    assert len(a["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"]) + 57 <= 97  # Ray adds "/<node id>"; HAProxy's limit
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # the user's own choice stays
    monkeypatch.delenv("RAY_SERVE_HAPROXY_METRICS_PORT", raising=False)
    with ingress.scoped_env(b):
        assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
        assert os.environ["RAY_SERVE_HAPROXY_METRICS_PORT"] == b["RAY_SERVE_HAPROXY_METRICS_PORT"]
    assert "RAY_SERVE_HAPROXY_METRICS_PORT" not in os.environ  # later commands choose their own
    assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"


def test_the_private_directories_of_killed_commands_are_swept(tmp_path):
    """A SIGKILLed command leaves its `wfh-` directory (atexit never ran): the next cluster's start
    removes it once its owner is gone, and keeps a live owner's and an unmarked one."""
    import os
    import subprocess
    import sys

    from workflows.serve import ingress
    from workflows.serve.haproxy_guard import start_time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mark = f"{child.pid}:{start_time(child.pid)}"
    dead, alive, unmarked = (tmp_path / f"{ingress.TEMP_PREFIX}{n}" for n in ("dead", "alive", "unmarked"))
    for d in (dead, alive, unmarked):
        (d / "node").mkdir(parents=True)
    (dead / ingress.OWNER_FILE).write_text(mark)
    (alive / ingress.OWNER_FILE).write_text(ingress.owner_env()[ingress.OWNER_ENV])
    ingress.sweep_stale_dirs(str(tmp_path))
    assert dead.exists()  # its owner still runs
    child.kill()
    child.wait()
    ingress.sweep_stale_dirs(str(tmp_path))
    assert not dead.exists() and alive.exists() and unmarked.exists()
    env = ingress.cluster_env(True)  # marks its own directory
    files = os.path.dirname(env["RAY_SERVE_HAPROXY_SOCKET_PATH"])
    assert open(os.path.join(files, ingress.OWNER_FILE)).read() == ingress.owner_env()[ingress.OWNER_ENV]


def _ray_haproxy_config(host: str) -> str:
    """The HAProxy configuration Ray Serve 2.60 writes (its own template, rendered as its
    HAProxyManager renders it) for an app on `host`:8123, stats page on 8124, Prometheus on 8125."""
    from jinja2 import Environment
    from ray.serve._private import haproxy as hp
    from ray.serve._private.haproxy_templates import HAPROXY_CONFIG_TEMPLATE, HAPROXY_HEALTHZ_RULES_TEMPLATE
    from ray.serve.config import HTTPOptions

    cfg = hp.HAProxyConfig(http_options=HTTPOptions(host=host, port=8123), stats_port=8124, metrics_port=8125)
    env = Environment()
    env.filters["haproxy_fmt"] = hp._haproxy_fmt_literal
    info = cfg.build_health_route_info([])
    rules = env.from_string(HAPROXY_HEALTHZ_RULES_TEMPLATE).render(config=cfg, backends=[], health_info=info)
    return env.from_string(HAPROXY_CONFIG_TEMPLATE).render(
        config=cfg, backends=[], grpc_backends=[], backends_with_health_config=[],
        grpc_backends_with_health_config=[], healthz_rules=rules, grpc_healthz_rules="", route_info=info)


@pytest.mark.parametrize(("host", "frontend"), [("127.0.0.1", "127.0.0.1:8123"), ("0.0.0.0", "*:8123")])
def test_haproxys_stats_and_metrics_pages_listen_on_127_0_0_1_only(tmp_path, host, frontend):
    """Ray's template binds HAProxy's stats and Prometheus pages (no bearer token there) on every
    interface, whatever serve.host says. The guard HAProxy runs through rewrites them to 127.0.0.1
    and keeps the model's frontend where serve.host put it (tests/test_e2e.py: the HAProxy of a served
    model listens on 127.0.0.1 only)."""
    import re

    from workflows.serve.haproxy_guard import _local_config, local_pages

    config = _ray_haproxy_config(host)
    assert re.search(r"^\s*bind \*?:8124$", config, re.M) and re.search(r"^\s*bind \*?:8125$", config, re.M)
    local = local_pages(config)
    binds = {port: addr for addr, port in re.findall(r"^\s*bind (\S+):(\d+)", local, re.M)}
    assert binds == {"8123": frontend.split(":")[0], "8124": "127.0.0.1", "8125": "127.0.0.1"}, binds
    assert local_pages(local) == local
    given = tmp_path / "haproxy.cfg"
    given.write_text(config)
    args = _local_config(["-db", "-f", str(given), "-sf", "1"])
    assert args[:2] == ["-db", "-f"] and args[3:] == ["-sf", "1"] and open(args[2]).read() == local
    assert given.read_text() == config  # Serve's own file stays as Serve wrote it
