"""What a processed dataset's manifest and a model's card name is resolved under the place the config
chose, or refused in one line naming the file and the key (issue #63, finding 1). Unit tests on a
local store: no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workflows import registry
from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset
from workflows.errors import UserError
from workflows.model_card import CARD_FILE
from workflows.storage.uri import StorageContext

CTX = StorageContext()


def _cfg(tmp_path: Path, *, tokenizer: str = "minilm") -> WorkflowConfig:
    return WorkflowConfig.model_validate({"data": {"source": str(tmp_path / "raw")},
                                         "storage": {"root": str(tmp_path / "store"), "embedded": {"enabled": False}},
                                         "cache": {"dir": str(tmp_path / "cache")},
                                         "preprocess": {"tokenizer": tokenizer}})


def _dataset(tmp_path: Path, **changes) -> tuple[str, Path]:
    """A processed dataset written as preprocessing writes it (absolute file URIs), its manifest edited
    by `changes`; (its URI, the manifest's path)."""
    uri = tmp_path / "store" / "processed" / "d1"
    files = {}
    for split in ("train", "val", "test"):
        (uri / f"split={split}").mkdir(parents=True)
        f = uri / f"split={split}" / "part-0.parquet"
        pq.write_table(pa.table({"label_id": [0, 1]}), f)
        files[split] = [str(f)]
    manifest = {"uri": str(uri), "version": "d1", "labels": ["a", "b"], "label_column": "label", "files": files,
                "counts": {"train": 2, "val": 2, "test": 2}, "label_counts": {}, "source": str(tmp_path / "raw"),
                "task": "classification", "text_columns": ["text"], "tokenizer": "minilm", "max_length": 32}
    manifest.update(changes)
    (uri / "manifest.json").write_text(json.dumps(manifest))
    return str(uri), uri / "manifest.json"


def _outside(tmp_path: Path) -> Path:
    """A parquet file outside the store, as a bucket writer would point a manifest at."""
    secret = tmp_path / "secret.parquet"
    pq.write_table(pa.table({"label_id": [7]}), secret)
    return secret


def _one_line(e: pytest.ExceptionInfo, *names: str) -> str:
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.mark.parametrize("entry", ["{secret}", "file://{secret}", "{uri}/../../secret.parquet",
                                   "{uri}/split=test/../../../secret.parquet", "s3://another-bucket/x.parquet",
                                   "http://127.0.0.1:9/x.parquet", "{uri}/split=test/" + "a" * 300 + ".parquet",
                                   "{uri}//split=test/part-0.parquet", 7, None])
def test_a_manifest_names_files_only_under_the_folder_it_was_read_from(tmp_path, entry):
    secret = _outside(tmp_path)
    uri, manifest = _dataset(tmp_path)
    doc = json.loads(manifest.read_text())
    doc["files"]["test"] = [entry.format(secret=secret, uri=uri) if isinstance(entry, str) else entry]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(UserError) as e:
        ProcessedDataset.load(uri, CTX)
    _one_line(e, str(manifest), "files.test")


@pytest.mark.parametrize(("key", "value"), [("files", "split=test"), ("files", {"elsewhere": []}),
                                            ("labels", "a"), ("max_length", "x" * 10), ("max_length", 10**30),
                                            ("counts", {"train": -1}), ("tokenizer", 5), ("labels", ["x" * 10**6])])
def test_a_manifest_field_of_the_wrong_type_or_size_is_refused_in_one_line(tmp_path, key, value):
    uri, manifest = _dataset(tmp_path, **{key: value})
    with pytest.raises(UserError) as e:
        ProcessedDataset.load(uri, CTX)
    _one_line(e, str(manifest), key)


def test_a_manifests_files_are_found_where_it_was_read_from(tmp_path):
    """Its own `uri` is not followed: a copied dataset's files are the copy's, and relative names are
    read below the folder too."""
    import shutil

    uri, manifest = _dataset(tmp_path)
    copy = tmp_path / "store" / "processed" / "copy"
    shutil.copytree(uri, copy)
    data = ProcessedDataset.load(str(copy), CTX)
    assert data.uri == str(copy) and data.files["test"] == [f"{copy}/split=test/part-0.parquet"]
    doc = json.loads(manifest.read_text())
    doc["files"]["test"] = ["split=test/part-0.parquet"]
    manifest.write_text(json.dumps(doc))
    assert ProcessedDataset.load(uri, CTX).files["test"] == [f"{uri}/split=test/part-0.parquet"]


def _registered(tmp_path: Path, cfg: WorkflowConfig, dataset_uri) -> Path:
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"w")
    ref = registry.register(cfg, CTX, str(art), "m", {"task": "classification", "labels": ["a", "b"],
                                                     "lineage": {"dataset_uri": dataset_uri}})
    return Path(ref.uri) / CARD_FILE


@pytest.mark.parametrize("where", ["{tmp}/elsewhere", "{root}/../elsewhere", "s3://another-bucket/processed/d1",
                                   "http://127.0.0.1:9/d1", "{root}/processed/../../elsewhere", "x" * 5000, 5])
def test_a_cards_dataset_uri_must_lie_under_storage_root(tmp_path, where):
    """`evaluate --split` follows the card's lineage.dataset_uri: a card naming a dataset outside
    storage.root made it score that dataset's rows (read with the platform's credentials)."""
    from workflows.pipeline.stages import model_split

    cfg = _cfg(tmp_path)
    _dataset(tmp_path / "elsewhere-parent")
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "elsewhere-parent" / "store" / "processed" / "d1").rename(elsewhere)
    target = where.format(tmp=tmp_path, root=cfg.storage.root) if isinstance(where, str) else where
    card = _registered(tmp_path, cfg, target)
    with pytest.raises(UserError) as e:
        model_split(cfg, CTX, "m", "test")
    _one_line(e, str(card), "lineage.dataset_uri")


def test_a_cards_dataset_under_storage_root_is_evaluated(tmp_path):
    from workflows.pipeline.stages import model_split

    cfg = _cfg(tmp_path)
    uri, _ = _dataset(tmp_path)
    _registered(tmp_path, cfg, uri)
    card, split_uri, data = model_split(cfg, CTX, "m", "test")
    assert split_uri == f"{uri}/split=test/" and data.uri == uri


def test_the_tokenizer_a_manifest_names_must_be_the_configs(tmp_path):
    """A text dataset's manifest names its tokenizer, which training (the pad id), export (copied into
    the registered artifact) and Workflow.tokenizer() loaded: a bucket writer chose a local directory."""
    from workflows.tasks.text import TextClassification

    elsewhere = tmp_path / "elsewhere-tokenizer"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    uri, manifest = _dataset(tmp_path, tokenizer=str(elsewhere))
    cfg = _cfg(tmp_path)
    data = ProcessedDataset.load(uri, CTX)
    with pytest.raises(UserError) as e:
        TextClassification(cfg).collate(data, train=True)
    _one_line(e, str(manifest), "tokenizer", "preprocess.tokenizer")
    data.tokenizer = "minilm"
    assert TextClassification(cfg).dataset.tokenizer_of(data) == "minilm"


@pytest.mark.parametrize("entry", [("vocab_file", "/etc/hostname"), ("tokenizer_file", "../../tokenizer.json"),
                                   ("merges_file", "sub/merges.txt"), ("spm_file", "absent.model"),
                                   ("vocab_file", 5), ("tokenizer_file", "x" * 5000),
                                   ("vocab_files", ["vocab.txt", "/etc/hostname"])])
def test_a_registered_tokenizers_file_keys_name_files_inside_its_folder(tmp_path, entry):
    """A registered version's tokenizer_config.json is the bucket's: keys such as vocab_file or
    tokenizer_file naming a local path made the tokenizer read it (transformers versions before 5
    opened them as given). registry.fetch refuses them in one line naming the file and key, and
    caches nothing."""
    key, value = entry
    cfg = _cfg(tmp_path)
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"w")
    (art / "vocab.txt").write_text("a\n")
    (art / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", key: value}))
    registry.register(cfg, CTX, str(art), "m", {"task": "classification", "labels": ["a", "b"]})
    with pytest.raises(UserError) as e:
        registry.fetch(cfg, CTX, "m")
    _one_line(e, "tokenizer_config.json", key)
    cached = tmp_path / "cache" / "models"
    assert not cached.exists() or not any(cached.iterdir())


def test_a_registered_tokenizers_own_file_names_are_kept(tmp_path):
    cfg = _cfg(tmp_path)
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"w")
    (art / "vocab.txt").write_text("a\n")
    (art / "tokenizer_config.json").write_text(json.dumps({"vocab_file": "vocab.txt", "tokenizer_file": None}))
    registry.register(cfg, CTX, str(art), "m", {"task": "classification", "labels": ["a", "b"]})
    local, _ = registry.fetch(cfg, CTX, "m")
    assert (Path(local) / "vocab.txt").read_text() == "a\n"


def test_the_template_engine_has_a_floor_without_its_known_sandbox_escapes():
    """Chat templates from the store render in transformers' Jinja sandbox; Jinja2 before 3.1.6 has
    sandbox escapes (CVE-2024-56201, CVE-2024-56326, CVE-2025-27516): the package declares the floor."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    from tests.conftest import ROOT

    declared = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    jinja = [r for r in declared if r.name.lower() == "jinja2"]
    assert jinja and not jinja[0].specifier.contains("3.1.5") and jinja[0].specifier.contains("3.1.6")
    assert Version(importlib.metadata.version("jinja2")) >= Version("3.1.6")
    pinned = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln.lower().startswith("jinja2==")]
    assert pinned and Version(pinned[0].split("==")[1]) >= Version("3.1.6")
