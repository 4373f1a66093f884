"""Preprocessing on a real Ray cluster, reading from and writing to a real embedded S3 endpoint."""

import re
from pathlib import Path

import pytest

from workflows.errors import UserError, surface_user_errors
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime
from workflows.storage.uri import read_json


def test_materialized_once_and_reused(ray_cluster, tiny_cfg):
    cfg = tiny_cfg()
    with runtime(cfg) as rt:
        first = stage_preprocess(rt)
        summary = read_json(str(Path(cfg.output_dir) / cfg.name / "preprocess.json"), rt.storage)
        assert summary["shard_cache"]["misses"] == 4 and summary["shard_cache"]["bytes_from_store"] > 0
        assert not first.reused and first.labels == sorted(first.labels) and len(first.labels) == 4
        assert sum(first.counts.values()) == 160 and first.counts["train"] > first.counts["test"] > 0
        train = first.read("train", rt.storage, cache=cfg.cache).take_all()
        assert len(train) == first.counts["train"]
        assert {"input_ids", "label_id", "text", "label"} <= set(train[0])
        assert all(len(r["input_ids"]) <= 32 for r in train)
        assert all(first.labels[r["label_id"]] == r["label"] for r in train)
        second = stage_preprocess(rt)
        assert second.reused and second.version == first.version and second.files == first.files
    # raw and processed shards were read through this node's shard cache
    cached = list((Path(cfg.cache.dir) / "shards").glob("*.data"))
    assert len(cached) == 4 + len(first.files["train"])
    # a changed preprocessing config is a new dataset version; the raw shards come from the cache
    with runtime(tiny_cfg("preprocess.max_length=24")) as rt:
        third = stage_preprocess(rt)
        assert third.version != first.version and not third.reused
    summary = read_json(str(Path(cfg.output_dir) / cfg.name / "preprocess.json"), rt.storage)
    assert summary["shard_cache"]["misses"] == 0 and summary["shard_cache"]["hits"] >= 4
    assert summary["shard_cache"]["bytes_from_store"] == 0


def test_user_csv_with_multiline_fields_and_named_columns(ray_cluster, tiny_cfg, tmp_path):
    src = tmp_path / "mine.csv"
    rows = ["title,description,tag"]
    for i in range(40):
        tag = ["vision", "nlp"][i % 2]
        rows.append(f'"Title {i}","line one of {tag} {i}\nline two",{tag}')
    src.write_text("\n".join(rows) + "\n")
    cfg = tiny_cfg(f"data.source={src}", "data.builtin=null", "data.text_columns=[title, description]",
                   "data.label_column=tag")
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        assert data.labels == ["nlp", "vision"] and sum(data.counts.values()) == 40
        manifest = read_json(data.uri + "/manifest.json", rt.storage)
        assert manifest["format"] == "csv" and manifest["version"] == data.version


def test_missing_column_is_named(ray_cluster, tiny_cfg, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"body": "x", "label": "a"}\n{"body": "y", "label": "b"}\n')
    cfg = tiny_cfg(f"data.source={src}", "data.builtin=null")
    with runtime(cfg) as rt, pytest.raises(UserError, match=r"\['text'\] not found"):
        stage_preprocess(rt)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_schema_differing_between_shards_names_both(ray_cluster, tiny_cfg, tmp_path, fmt):
    import pandas as pd

    src = tmp_path / "raw"
    src.mkdir()
    good = pd.DataFrame({"text": [f"row {i}" for i in range(20)], "label": ["a", "b"] * 10})
    if fmt == "jsonl":
        good.to_json(src / "part-0.jsonl", orient="records", lines=True)
        good.rename(columns={"text": "body"}).to_json(src / "part-1.jsonl", orient="records", lines=True)
        expected = r"part-1\.jsonl has columns \['body', 'label'\] but .*part-0\.jsonl has \['label', 'text'\]"
    else:
        good.to_parquet(src / "part-0.parquet")
        good.assign(label=range(20)).to_parquet(src / "part-1.parquet")
        expected = r"column 'label' is int64 in .*part-1\.parquet but (large_)?string in .*part-0\.parquet"
    cfg = tiny_cfg(f"data.source={src}", "data.builtin=null")
    with runtime(cfg) as rt, pytest.raises(UserError, match=expected):
        stage_preprocess(rt)


def test_malformed_json_line_names_the_shard_and_row(ray_cluster, tiny_cfg, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "x", "label": "a"}\n{"text": "y", "label": "b"}\n{"text": oops}\n')
    cfg = tiny_cfg(f"data.source={src}", "data.builtin=null")
    with (
        runtime(cfg) as rt,
        pytest.raises(UserError, match=r"malformed jsonl shard .*bad\.jsonl: .*line 3 of the file"),
    ):
        stage_preprocess(rt)


def test_required_columns_are_checked_once_on_the_reference_shard(ray_cluster, tmp_path):
    """Several shards: the check runs on the first shard's columns as the dataset is set up, before
    any read task; one shard: its one read checks them. Either way the message names shard and columns."""
    import json

    from workflows.storage.shards import read_shards
    from workflows.storage.uri import StorageContext

    src = tmp_path / "raw"
    src.mkdir()
    for i in range(3):
        (src / f"part-{i}.jsonl").write_text(json.dumps({"body": f"row {i}", "label": "a"}) + "\n")
    shards = [str(src / f"part-{i}.jsonl") for i in range(3)]
    ctx = StorageContext()
    expected = (f"column(s) ['text'] not found in {shards[0]} (columns: ['body', 'label']); "
                "set data.text_columns / data.label_column")
    with pytest.raises(UserError) as err:
        read_shards(shards, "jsonl", ctx, required_columns=["text", "label"])  # nothing read yet
    assert str(err.value) == expected
    ds = read_shards(shards, "jsonl", ctx, required_columns=["body", "label"])
    assert sorted(r["body"] for r in ds.take_all()) == ["row 0", "row 1", "row 2"]
    one = read_shards(shards[:1], "jsonl", ctx, required_columns=["text", "label"])
    with pytest.raises(UserError, match=re.escape(expected)), surface_user_errors():  # raised in the read task
        one.materialize()
