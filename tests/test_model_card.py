"""The model card (workflows.json) through the registry on a local store: the JSON keys on disk are
the ones given, unknown keys survive, and fetch/model_card/describe read them back."""

import contextlib
import json
from pathlib import Path

import pytest
import yaml

from workflows import registry
from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.model_card import CARD_FILE, ModelCard
from workflows.registry_signing import SIGNATURE_FILE
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
    stored = json.loads((tmp_path / "store" / "models" / "m" / "v1" / CARD_FILE).read_text())
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


def _store_with_model(tmp_path):
    cfg = WorkflowConfig.model_validate(
        {
            "data": {"source": str(tmp_path / "raw")},
            "storage": {"root": str(tmp_path / "store"), "embedded": {"enabled": False}},
            "cache": {"dir": str(tmp_path / "cache")},
        }
    )
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "store" / "models" / "m" / "v1").mkdir(parents=True)
    ref = registry.register(cfg, StorageContext(), str(art), "m", META)
    return cfg, Path(ref.uri) / CARD_FILE


def _files(root):
    return {p for p in root.rglob("*")}


# what someone who can write to the bucket could put in a card: each would make fetch write, or
# look for a cached model, outside the cache (an absolute path; `..` parts, also in mkdtemp's prefix)
HOSTILE_CARDS = [
    ("artifact_id", "/ABS/elsewhere"),
    ("artifact_id", "../escaped"),
    ("artifact_id", "./../../escaped"),
    ("artifact_id", "x/../../escaped"),
    ("artifact_id", ""),
    ("artifact_id", 7),
    ("name", "other"),
    ("version", 2),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE_CARDS)
def test_a_card_edited_in_the_store_cannot_choose_where_fetch_writes(tmp_path, field, value):
    cfg, card_file = _store_with_model(tmp_path)
    card = json.loads(card_file.read_text())
    card[field] = value.replace("/ABS", str(tmp_path)) if isinstance(value, str) else value
    card_file.write_text(json.dumps(card))
    before = _files(tmp_path)
    for read in (registry.fetch, registry.model_card):
        with pytest.raises(UserError) as e:
            read(cfg, StorageContext(), "m")
        assert len(str(e.value).splitlines()) == 1 and str(card_file) in str(e.value), str(e.value)
    written = _files(tmp_path) - before
    assert {p for p in written if (tmp_path / "cache") not in p.parents} == set(), written
    assert not (tmp_path / "elsewhere").exists()


def test_a_key_that_is_no_file_name_is_not_downloaded(tmp_path, monkeypatch):
    import workflows.storage.uri as uri

    class Listing:
        def ls(self, path, detail=False):
            return [{"name": f"{path}/{n}", "type": "file"} for n in ("model.safetensors", "..")]

        def get_file(self, remote, local):
            raise AssertionError(f"downloaded {remote} to {local}")

    monkeypatch.setattr(uri, "filesystem", lambda u, ctx: (Listing(), "bucket/models/m/v1"))
    with pytest.raises(UserError, match=r"an object named '\.\.'"):
        uri.download_dir("s3://bucket/models/m/v1", StorageContext(), str(tmp_path))


def test_serve_evaluate_and_predict_refuse_a_hostile_card_in_one_line_before_ray(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import workflows.runtime
    from workflows.cli import app

    def no_ray(cfg):
        raise AssertionError("Ray started before the card was checked")

    monkeypatch.setattr(workflows.runtime, "init_ray", no_ray)
    monkeypatch.chdir(tmp_path)
    cfg, card_file = _store_with_model(tmp_path)
    config = tmp_path / "user.yaml"
    config.write_text(yaml.safe_dump({"name": "hostile", "output_dir": f"{tmp_path}/runs",
                                      "storage": {"root": f"{tmp_path}/store", "embedded": {"enabled": False}},
                                      "cache": {"dir": f"{tmp_path}/cache"}, "tracking": {"enabled": False},
                                      "data": {"source": f"{tmp_path}/raw"}}))
    for artifact_id in (str(tmp_path / "elsewhere"), "../escaped"):
        card = json.loads(card_file.read_text())
        card["artifact_id"] = artifact_id
        card_file.write_text(json.dumps(card))
        for command in (["serve", "--model", "m"], ["evaluate", "--model", "m", "--split", "val"],
                        ["evaluate", "--model", "m", "--data", str(tmp_path)],
                        ["predict", "--model", "m", "--data", str(tmp_path), "--output", str(tmp_path / "out")]):
            out = CliRunner().invoke(app, [*command, "--config", str(config)])
            lines = [ln for ln in out.output.splitlines() if ln.strip()]
            assert out.exit_code == 2 and lines[-1].startswith("error: ") and "artifact_id" in lines[-1], \
                (command, out.output)
            assert "Traceback" not in out.output and not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize("store", ["s3", "local", "s3 ignoring If-None-Match"])
def test_concurrent_registrations_get_distinct_versions_each_with_its_own_weights_and_card(tmp_path, store,
                                                                                          monkeypatch, capsys):
    """Four registrations of one name at once, each having listed the same versions (a barrier after
    the listing makes the race certain): four versions, each with the weights and card of one. Also on
    a store that ignores If-None-Match (tests/s3_behaviour.py), where every conditional PUT of a
    version's claim succeeded and all four wrote into v1: the store is probed once, the registration
    says so in one line, and claims beside the object decide (two that collide may both move on, so
    a version number can go unused)."""
    import threading
    import uuid

    from tests.s3_behaviour import BehaviourStore
    from workflows.storage import create_only
    from workflows.storage.embedded import EmbeddedS3

    writers = 4
    create_only.forget_probes()
    with contextlib.ExitStack() as stack:
        stack.callback(create_only.forget_probes)
        if store == "s3":
            s3 = stack.enter_context(EmbeddedS3(str(tmp_path / "s3")))
            s3.ensure_bucket("race")
            root, ctx = "s3://race/store", StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1",
                                                          embedded=True)
        elif store != "local":
            behaving = stack.enter_context(BehaviourStore())
            behaving.behaviour.ignore_if_none_match = True
            bucket = f"race-{uuid.uuid4().hex[:12]}"  # moto's buckets are per process
            ctx = behaving.context()
            ctx.boto3_client().create_bucket(Bucket=bucket)
            root = f"s3://{bucket}/store"
        else:
            root, ctx = str(tmp_path / "store"), StorageContext()
        cfg = WorkflowConfig.model_validate({"data": {"source": str(tmp_path / "raw")},
                                             "storage": {"root": root, "embedded": {"enabled": False}},
                                             "cache": {"dir": str(tmp_path / "cache")}})
        listed = threading.Barrier(writers)
        real_versions = registry.versions

        def versions_then_wait(*args):
            found = real_versions(*args)
            listed.wait(timeout=60)
            return found

        monkeypatch.setattr(registry, "versions", versions_then_wait)
        errors: list[BaseException] = []

        def register(i: int) -> None:
            art = tmp_path / f"artifact{i}"
            art.mkdir()
            (art / "model.safetensors").write_bytes(f"weights of writer {i}".encode() * 1000)
            try:
                registry.register(cfg, ctx, str(art), "m", {**META, "writer": i})
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=register, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        monkeypatch.setattr(registry, "versions", real_versions)
        assert not errors, errors
        versions = registry.versions(cfg, ctx, "m")
        assert versions == [1, 2, 3, 4] if store in ("s3", "local") else len(versions) == writers, versions
        said = [ln for ln in capsys.readouterr().err.splitlines() if "If-None-Match" in ln]
        assert len(said) == (store not in ("s3", "local")), said
        seen = []
        for v in versions:
            local, card = registry.fetch(cfg, ctx, f"m:{v}")
            writer = card.model_extra["writer"]
            assert card.version == v and card.name == "m"
            assert (Path(local) / "model.safetensors").read_bytes() == f"weights of writer {writer}".encode() * 1000
            assert sorted(p.name for p in Path(local).iterdir()) == sorted(["model.safetensors", CARD_FILE,
                                                                           SIGNATURE_FILE])
            seen.append(writer)
        assert sorted(seen) == list(range(writers))

