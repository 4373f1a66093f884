"""Every move of an alias is mirrored into MLflow's model registry the same way, whichever path moves
it: the promotion gate (pipeline.promote.carry_out, on the pipeline's tracking session),
`workflows models alias` (a command without a session: a promotion, a rollback, a removal) and the
bench's rollout (bench.serve_changes.rollout_versions). A real SQLite MLflow store and a registry on
local disk; no Ray."""

from __future__ import annotations

from pathlib import Path

import yaml

from workflows import registry, registry_aliases
from workflows.config import load_config
from workflows.runtime import Runtime
from workflows.storage.uri import StorageContext

CARD = {"task": "classification", "labels": ["a", "b"], "text_columns": ["text"], "label_column": "label",
        "max_length": 8}


def mirrored(store: str, name: str) -> dict[str, tuple[str, str]]:
    """{alias: (the bucket's version its MLflow model version mirrors, that model version's source)}
    of MLflow's registered model `name`."""
    from mlflow import MlflowClient

    from workflows.tracking.model_registry import VERSION_TAG

    client = MlflowClient(tracking_uri=store, registry_uri=store)
    out = {}
    for alias, number in client.get_registered_model(name).aliases.items():
        twin = client.get_model_version(name, number)
        out[alias] = (twin.tags[VERSION_TAG], twin.source)
    return out


def in_bucket(cfg, ctx, name: str) -> dict[str, tuple[str, str]]:
    """The same, as the registry's alias records have it."""
    return {alias: (str(v), registry.resolve(cfg, ctx, f"{name}:{v}").uri)
            for alias, v in registry_aliases.aliases(cfg, ctx, name).items()}


def test_the_gate_the_cli_and_the_bench_mirror_a_move_into_mlflow_alike(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from workflows.bench.serve_changes import rollout_versions
    from workflows.cli import app
    from workflows.pipeline.promote import carry_out
    from workflows.tracking.session import Tracking

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "name": "c", "output_dir": f"{tmp_path}/runs", "data": {"source": "x"},
        "storage": {"root": f"{tmp_path}/store", "embedded": {"enabled": False}}, "cache": {"dir": f"{tmp_path}/cache"},
        "tracking": {"enabled": True, "uri": store}}))
    cfg, ctx = load_config(config), StorageContext()
    refs = []
    for i in range(2):
        art = Path(tmp_path / f"art{i}")
        art.mkdir()
        (art / "model.safetensors").write_bytes(f"weights {i}".encode())
        refs.append(registry.register(cfg, ctx, str(art), "m", CARD))  # tracking off: no MLflow twin yet

    # the gate's move and the bench's, on a command's tracking session (as `workflows pipeline` and
    # `workflows bench serve` run them)
    rt = Runtime(cfg, ctx, tracking=Tracking(cfg, ctx))
    with rt.tracking.stage("promote") as run:
        decision = {"promoted": True, "alias": "production", "holder": None, "candidate": 1, "by": "the gate",
                    "reason": "the first version to take it", "metric": "f1", "mode": "max", "margin": 0.0,
                    "decided_on": "test", "scores": {"test": {"rows": 4, "candidate": 0.75}}}
        carry_out(rt, run, refs[0], decision)
    bench_cfg, old, _ = rollout_versions(rt, "m:1")
    assert rt.tracking.close()["complete"]
    assert mirrored(store, "m") == in_bucket(cfg, ctx, "m") == {"production": ("1", refs[0].uri)}
    assert mirrored(store, "rollout") == in_bucket(bench_cfg, ctx, "rollout") == {"production": ("1", old.uri)}

    # `workflows models alias`: a promotion, another alias, a rollback, a removal
    def cli(*args: str) -> None:
        out = CliRunner().invoke(app, ["models", "alias", *args, "--config", str(config)])
        assert out.exit_code == 0, out.output

    cli("m:2", "production")
    assert mirrored(store, "m") == in_bucket(cfg, ctx, "m") == {"production": ("2", refs[1].uri)}
    cli("m:2", "staging")
    cli("m:1", "production", "--reason", "rollback")
    assert mirrored(store, "m") == in_bucket(cfg, ctx, "m") == {"production": ("1", refs[0].uri),
                                                                 "staging": ("2", refs[1].uri)}
    cli("m", "staging", "--delete")
    assert mirrored(store, "m") == in_bucket(cfg, ctx, "m") == {"production": ("1", refs[0].uri)}
