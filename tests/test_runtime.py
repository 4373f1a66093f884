"""Which Ray cluster a command starts or joins (workflows.runtime.init_ray), decided from ray.address
and RAY_ADDRESS, without starting Ray: ray.init is replaced by one that records its arguments.
tests/test_jobs.py runs a command as a real Ray job."""

import os

import pytest

from tests.conftest import QUICKSTART
from workflows.config import load_config
from workflows.config.cluster import cluster_address
from workflows.runtime import init_ray
from workflows.serve import ingress

GCS = "127.0.0.1:6379"


@pytest.mark.parametrize(
    ("configured", "env", "joined"),
    [
        (None, None, None),  # a local cluster of the command's own
        (None, "", None),
        (None, "local", None),
        (None, GCS, GCS),  # `ray job submit` set it: join the job's cluster
        (None, "ray://10.0.0.5:10001", "ray://10.0.0.5:10001"),
        ("auto", GCS, "auto"),  # the config wins
        ("10.0.0.5:6379", GCS, "10.0.0.5:6379"),
        ("10.0.0.5:6379", None, "10.0.0.5:6379"),
        ("local", GCS, None),
        ("local", None, None),
    ],
)
def test_cluster_address_from_config_and_environment(monkeypatch, configured, env, joined):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    cfg = load_config(QUICKSTART, [f"ray.address={configured}" if configured else "ray.address=null"])
    assert cluster_address(cfg) == joined
    assert (ingress.describe(cfg) == "the cluster's ingress") == (joined is not None)


class _Called(Exception):
    pass


def _init_kwargs(monkeypatch, *overrides: str) -> dict:
    """What init_ray passes to ray.init (which is stopped there) for the quickstart and `overrides`."""
    import ray

    calls = []

    def fake_init(**kwargs):
        calls.append(kwargs)
        raise _Called

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    for var in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_API_SERVER_ADDRESS"):  # init_ray sets them for a local cluster
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(_Called):
        init_ray(load_config(QUICKSTART, ["ray.num_cpus=2", "serve.haproxy=false", *overrides]))
    return calls[0]


def test_ray_address_in_the_environment_is_joined_without_local_cluster_settings(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", GCS)  # as `ray job submit` sets it for the job's driver
    kwargs = _init_kwargs(monkeypatch)
    assert kwargs["address"] == GCS
    assert not {"num_cpus", "dashboard_port", "include_dashboard"} & kwargs.keys(), kwargs
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in os.environ


def test_the_dashboard_port_is_a_config_key_and_the_variable_still_works(monkeypatch):
    from workflows.net import free_ports

    monkeypatch.setenv("RAY_ADDRESS", "local")
    configured, from_env = free_ports(2)
    monkeypatch.delenv("WORKFLOWS_DASHBOARD_PORT", raising=False)
    assert _init_kwargs(monkeypatch, f"ray.dashboard_port={configured}")["dashboard_port"] == configured
    monkeypatch.setenv("WORKFLOWS_DASHBOARD_PORT", str(from_env))
    assert _init_kwargs(monkeypatch)["dashboard_port"] == from_env
    # the config wins
    assert _init_kwargs(monkeypatch, f"ray.dashboard_port={configured}")["dashboard_port"] == configured


def test_local_cluster_where_ray_address_is_local_or_overridden(monkeypatch):
    for env, overrides in (("local", ()), ("", ()), (GCS, ("ray.address=local",))):
        monkeypatch.setenv("RAY_ADDRESS", env)
        kwargs = _init_kwargs(monkeypatch, *overrides)
        assert kwargs["address"] == "local" and kwargs["num_cpus"] == 2 and "dashboard_port" in kwargs, (env, kwargs)
    monkeypatch.setenv("RAY_ADDRESS", GCS)
    assert _init_kwargs(monkeypatch, "ray.address=10.0.0.5:6379")["address"] == "10.0.0.5:6379"  # the config wins


def test_only_a_cluster_the_command_starts_quiets_the_token_note(monkeypatch):
    """console shows Ray's token-authentication line once per machine for a cluster of the command's
    own (started here) only; a joined cluster's line is shown every time."""
    from workflows import console

    monkeypatch.setattr(console, "_own_cluster", False)
    monkeypatch.setenv("RAY_ADDRESS", GCS)
    _init_kwargs(monkeypatch)
    assert not console._own_cluster
    monkeypatch.setenv("RAY_ADDRESS", "local")
    _init_kwargs(monkeypatch)
    assert console._own_cluster
