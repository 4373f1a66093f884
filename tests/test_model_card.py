"""The model card (workflows.json) through the registry on a local store: the JSON keys on disk are
the ones given, unknown keys survive, and fetch/model_card/describe read them back."""

import json

from workflows import registry
from workflows.config import WorkflowConfig
from workflows.model_card import ModelCard
from workflows.storage.uri import StorageContext

META = {
    "task": "sequence-classification",
    "labels": ["a", "b"],
    "text_columns": ["title", "description"],
    "label_column": "tag",
    "max_length": 32,
    "lineage": {"dataset_version": "d1", "run": "r1"},
    "majority_label": "a",
    "val_metrics": {"val_f1": 0.5, "epoch": 1},
    "copy_of": "quickstart:1",  # a key the card does not name
}


def test_card_round_trips_only_the_given_keys():
    assert ModelCard.model_validate(META).to_dict() == META
    partial = {"labels": ["a", "b"], "text_columns": ["text"]}
    assert ModelCard.model_validate(partial).to_dict() == partial


def test_registry_writes_and_reads_cards(tmp_path):
    cfg = WorkflowConfig.model_validate(
        {
            "data": {"source": str(tmp_path / "raw")},
            "storage": {"root": str(tmp_path / "store"), "embedded": {"enabled": False}},
            "cache": {"dir": str(tmp_path / "c")},
        }
    )
    ctx = StorageContext()
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "store" / "models" / "m" / "v1").mkdir(parents=True)  # an object store needs no directories
    ref = registry.register(cfg, ctx, str(art), "m", META)
    stored = json.loads((tmp_path / "store" / "models" / "m" / "v1" / registry.META_FILE).read_text())
    assert set(stored) == {*META, "name", "version", "artifact_id", "registered_at"}
    assert {k: stored[k] for k in META} == META and (stored["name"], stored["version"]) == ("m", 1)

    local, card = registry.fetch(cfg, ctx, "m")
    assert card.labels == ["a", "b"] and card.version == ref.version == 1 and card.artifact_id == stored["artifact_id"]
    assert ModelCard.load(local).to_dict() == stored and (tmp_path / "c" / "models" / card.artifact_id).is_dir()
    registry.write_evaluation(cfg, ctx, ref, {"weighted": {"f1": 0.9}})
    assert registry.model_card(cfg, ctx, "m:1").metrics == {"weighted": {"f1": 0.9}}
    assert registry.describe(cfg, ctx, "m") == {**stored, "metrics": {"weighted": {"f1": 0.9}}}


def test_metrics_are_written_as_json_dumps_writes_them():
    card = ModelCard.model_validate({**META, "val_metrics": {"val_loss": float("nan")}})
    assert json.dumps(card.to_dict()) == json.dumps({**META, "val_metrics": {"val_loss": float("nan")}})
