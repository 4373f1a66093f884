import collections
import json

import pandas as pd
import pytest

from workflows.errors import UserError
from workflows.preprocess import quickstart_data
from workflows.preprocess.encoding import compose_text, compose_texts, pad_batch
from workflows.preprocess.sources import list_shards
from workflows.storage.uri import StorageContext


def test_quickstart_dataset_is_real_large_enough_and_deterministic():
    rows = quickstart_data.build(800)
    counts = collections.Counter(r["label"] for r in rows)
    assert len(rows) >= 3000 and len(counts) >= 4 and min(counts.values()) >= 700
    assert len({r["text"] for r in rows}) == len(rows)  # no duplicate texts
    assert all(len(r["text"]) >= quickstart_data.MIN_CHARS for r in rows)
    again = quickstart_data.build(800)
    assert [r["id"] for r in again] == [r["id"] for r in rows]


def test_compose_text_joins_fields_and_skips_empty():
    assert compose_text(["A title.", "  the   description "]) == "A title. the description"
    assert compose_text([None, "only text"]) == "only text"
    assert compose_text([float("nan"), ""]) == ""
    assert compose_texts(pd.DataFrame({"t": ["x"], "d": ["y"]}), ["t", "d"]) == ["x. y"]


def test_pad_batch_pads_to_the_longest_row():
    ids, mask = pad_batch([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_list_shards_directory_glob_and_errors(tmp_path):
    ctx = StorageContext()
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x", "label": "a"}) + "\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "y", "label": "b"}) + "\n")
    (tmp_path / "_SUCCESS").write_text("")
    shards, fmt = list_shards(str(tmp_path), ctx)
    assert fmt == "jsonl" and [s.uri.rsplit("/", 1)[-1] for s in shards] == ["a.jsonl", "b.jsonl"]
    assert all(s.size > 0 and s.version for s in shards)
    shards, _ = list_shards(str(tmp_path / "a*.jsonl"), ctx)
    assert len(shards) == 1
    with pytest.raises(UserError, match=r"no shard matched .*nothing.*pattern"):
        list_shards(str(tmp_path / "nothing"), ctx)
    (tmp_path / "c.csv").write_text("text,label\nz,a\n")
    with pytest.raises(UserError, match="cannot tell one format"):
        list_shards(str(tmp_path), ctx)


def test_read_path_names_a_missing_bucket(tmp_path):
    from workflows.storage.embedded import EmbeddedS3

    with EmbeddedS3(str(tmp_path / "s3")) as s3:
        with pytest.raises(UserError, match=r"bucket not found for s3://no-such-bucket/raw/"):
            list_shards("s3://no-such-bucket/raw/", StorageContext(s3.endpoint_url, "us-east-1", embedded=True))


def test_read_path_names_bad_credentials(tmp_path, monkeypatch):
    """A real fault at a real endpoint: with this setting moto checks every request's signature."""
    from workflows.storage.embedded import EmbeddedS3

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # read by the endpoint's child process
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    s3 = EmbeddedS3(str(tmp_path / "s3"))
    s3.start()
    try:
        with pytest.raises(UserError, match=r"access denied .*s3://raw/shards/.*credentials") as err:
            list_shards("s3://raw/shards/", StorageContext(s3.endpoint_url, "us-east-1", retries=0))
        assert "not-the-secret" not in str(err.value)
    finally:
        s3._release()  # not stop(): persisting would need credentials this endpoint now refuses


def test_builtin_dataset_is_not_written_outside_the_embedded_store(tmp_path):
    """An empty source in a user's own store is an error naming it, not a place to build demo data."""
    from tests.conftest import QUICKSTART
    from workflows.config import load_config
    from workflows.pipeline.stages import ensure_raw_data
    from workflows.runtime import Runtime

    source = f"{tmp_path}/raw/"
    cfg = load_config(QUICKSTART, ["storage.embedded.enabled=false", f"storage.root={tmp_path}/store",
                                   f"data.source={source}"])
    with pytest.raises(UserError) as err:
        ensure_raw_data(Runtime(cfg, StorageContext.from_config(cfg.storage)))
    assert "\n" not in str(err.value) and f"no shard matched {source}" in str(err.value), err.value
    assert "data.write_builtin=true" in str(err.value) and not (tmp_path / "raw").exists()


def test_quickstart_build_names_the_modules_it_skipped(tmp_path, monkeypatch):
    """A module that fails to import changes the rows (and the dataset's version): the build says which and why."""
    (tmp_path / "wf_broken_on_purpose.py").write_text('raise RuntimeError("broken\\n on purpose")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    libraries = {"a": ["json", "wf_no_such_module"], "b": ["csv", "wf_broken_on_purpose"]}
    built = quickstart_data.build_dataset(50, libraries)
    assert built.skipped == {
        "wf_no_such_module": "ModuleNotFoundError: No module named 'wf_no_such_module'",
        "wf_broken_on_purpose": "RuntimeError: broken on purpose",
    }
    assert built.rows and {r["label"] for r in built.rows} == {"a", "b"}
    assert quickstart_data.build_dataset(50, {"a": ["json"], "b": ["csv"]}).skipped == {}


def test_building_the_quickstart_data_reports_skipped_modules(tmp_path, monkeypatch, capsys):
    """The data line of `preprocess`/`pipeline` warns, and the summary (preprocess.json's raw_data) records them."""
    from tests.conftest import QUICKSTART
    from workflows.config import load_config
    from workflows.pipeline.stages import ensure_raw_data
    from workflows.runtime import Runtime

    monkeypatch.setattr(quickstart_data, "LIBRARIES", {"a": ["json", "wf_no_such_module"], "b": ["csv"]})
    cfg = load_config(QUICKSTART, ["storage.embedded.enabled=false", f"storage.root={tmp_path}/store",
                                   f"data.source={tmp_path}/raw/", "data.write_builtin=true"])
    built = ensure_raw_data(Runtime(cfg, StorageContext.from_config(cfg.storage)))
    why = "ModuleNotFoundError: No module named 'wf_no_such_module'"
    assert built["built"] and built["skipped_modules"] == {"wf_no_such_module": why}, built
    err = capsys.readouterr().err
    assert ("workflows warning: data: skipped 1 module(s) that failed to import, so these rows (and the dataset's "
            f"version) differ from a build where they import: wf_no_such_module ({why})") in err, err
    # nothing skipped: nothing said
    monkeypatch.setattr(quickstart_data, "LIBRARIES", {"a": ["json"], "b": ["csv"]})
    cfg = load_config(QUICKSTART, ["storage.embedded.enabled=false", f"storage.root={tmp_path}/store",
                                   f"data.source={tmp_path}/raw2/", "data.write_builtin=true"])
    built = ensure_raw_data(Runtime(cfg, StorageContext.from_config(cfg.storage)))
    assert built["built"] and built["skipped_modules"] == {}
    assert "skipped" not in capsys.readouterr().err


def _ensure_raw_data(*overrides: str):
    from tests.conftest import QUICKSTART
    from workflows.config import load_config
    from workflows.pipeline.stages import ensure_raw_data
    from workflows.runtime import Runtime

    cfg = load_config(QUICKSTART, list(overrides))
    return ensure_raw_data(Runtime(cfg, StorageContext.from_config(cfg.storage)))


def test_an_unreachable_store_is_not_taken_for_an_empty_one(monkeypatch):
    """The built-in-data hint (and the build) are for a source with no shards, not for a store that
    does not answer: its error is the whole message, and nothing is built."""
    from tests.helpers import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for embedded in ("false", "true"):  # a user's store; the embedded one (where the data would be built)
        with pytest.raises(UserError) as err:
            _ensure_raw_data(f"storage.embedded.enabled={embedded}", f"storage.endpoint_url={endpoint}",
                             "storage.retries=0", "storage.root=s3://workflows", "data.source=s3://raw/shards/")
        assert str(err.value) == (
            f"cannot reach s3://raw/shards/ (endpoint {endpoint}): EndpointConnectionError: Could not connect to "
            f'the endpoint URL: "{endpoint}/raw?list-type=2&prefix=shards%2F&delimiter=%2F&encoding-type=url"'
        ), embedded


def test_access_denied_is_not_taken_for_an_empty_source(tmp_path, monkeypatch):
    from workflows.storage.embedded import EmbeddedS3

    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")  # read by the endpoint's child process
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    s3 = EmbeddedS3(str(tmp_path / "s3"))
    s3.start()
    try:
        with pytest.raises(UserError) as err:
            _ensure_raw_data("storage.embedded.enabled=false", f"storage.endpoint_url={s3.endpoint_url}",
                             "storage.retries=0", "storage.root=s3://workflows", "data.source=s3://raw/shards/")
        assert str(err.value) == "access denied to s3://raw/shards/: check the AWS credentials"
    finally:
        s3._release()


def test_shards_of_two_formats_are_an_error_as_they_are(tmp_path):
    source = tmp_path / "raw"
    source.mkdir()
    (source / "a.jsonl").write_text(json.dumps({"text": "x", "label": "a"}) + "\n")
    (source / "b.csv").write_text("text,label\nz,a\n")
    with pytest.raises(UserError) as err:
        _ensure_raw_data("storage.embedded.enabled=false", f"storage.root={tmp_path}/store",
                         f"data.source={source}/", "data.write_builtin=true")
    assert str(err.value) == (f"cannot tell one format for the shards at {source}/ (found ['csv', 'jsonl']); "
                              "set data.format")
    assert sorted(p.name for p in source.iterdir()) == ["a.jsonl", "b.csv"]  # nothing built beside them


def test_text_encoder_gives_transformers_ids_without_importing_it():
    """The encoder reads tokenizer.json with `tokenizers` (no transformers, no torch import in a
    preprocessing worker) and must give exactly the ids and pad id of transformers' tokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from workflows.preprocess.encoding import TextEncoder, packaged_minilm

    texts = [r["text"] for r in quickstart_data.build(10)][:40] + [
        "", "Café naïve RÉSUMÉ", "中文 測試", "word " * 300, "tabs\tand\nnewlines", "ＦＵＬＬ ｗｉｄｔｈ", "don't!!"]
    enc = TextEncoder(packaged_minilm(), 16, ["text"])
    ref = AutoTokenizer.from_pretrained(packaged_minilm())
    assert enc.encode_texts(texts) == ref(texts, truncation=True, max_length=16)["input_ids"]
    assert enc.pad_id == ref.pad_token_id
    code = ("import sys; from workflows.preprocess.encoding import TextEncoder, packaged_minilm; "
            "TextEncoder(packaged_minilm(), 16, ['text']).encode_texts(['hi']); "
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
