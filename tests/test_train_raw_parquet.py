"""model.options.image_input=raw over a parquet source (encoded images in
`model.options.image_column`, labels in `data.label_column`) under Ray Train: the training split's
rows read from the source's parquet files through the shard cache, each exactly once per epoch and
no val/test row, cropped from the original image the same way on 2 workers, on 1 and after a
resume mid-epoch.

Real parts: the session's 2-CPU Ray cluster, scikit-learn's digits written as parquet into the
embedded S3 endpoint and preprocessed on it, the small CNN under FSDP2."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from tests.stream_lineage import DIGITS, lineage, overrides
from tests.test_train_stream import crops, run
from workflows.config import load_config
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime

pytestmark = pytest.mark.integration
SOURCE = "s3://workflows/raw/digits-parquet/"
DATA = [f"data.source={SOURCE}", "data.builtin=null", "model.options.image_column=png",
        "data.label_column=digit"]


@pytest.fixture(scope="module")
def parquet_digits(ray_cluster, tmp_path_factory):
    """150 digits in two parquet files (row groups of 16), preprocessed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.preprocess.digits_data import build
    from workflows.storage.uri import join, write_bytes_atomic

    tmp = tmp_path_factory.mktemp("rawpq")
    cfg = load_config(DIGITS, overrides(tmp, *DATA))
    with runtime(cfg) as rt:
        rows = build()[:150]
        for k in range(2):
            part = rows[k * 75:(k + 1) * 75]
            buf = io.BytesIO()
            pq.write_table(pa.table({"key": [r["key"] for r in part], "png": [r["image"] for r in part],
                                     "digit": [r["label"] for r in part]}), buf, row_group_size=16)
            write_bytes_atomic(join(SOURCE, f"part-{k}.parquet"), buf.getvalue(), rt.storage)
        yield SimpleNamespace(tmp=tmp, rt=rt, data=stage_preprocess(rt))


def _split_keys(ns, split: str) -> list[str]:
    from workflows.storage.shards import read_parquet

    return [k for f in ns.data.files[split] for k in read_parquet(f, ns.rt.storage, ["key"]).column("key").to_pylist()]


def test_raw_parquet_trains_on_each_training_row_once_and_no_held_out_row(parquet_digits):
    from workflows.loader import DatasetIndex
    from workflows.preprocess.image_dataset import TRAIN_SAMPLES
    from workflows.storage.shards import read_parquet
    from workflows.storage.uri import exists, join, read_json

    ns = parquet_digits
    out = run(ns, "raw", 2, "model.options.image_input=raw", "train.loader_workers=1", *DATA)
    saved = join(ns.data.uri, TRAIN_SAMPLES)
    assert exists(saved, ns.rt.storage)  # beside the processed version: later runs read it back
    index = DatasetIndex.from_json("", read_json(saved, ns.rt.storage))
    assert index.format == "raw-parquet" and index.column == "png"
    key_of = []  # by global sample id: the source row's key
    for k, members in enumerate(index.members or []):
        keys = read_parquet(index.uri(k), ns.rt.storage, ["key"]).column("key").to_pylist()
        key_of += [keys[r] for r in members.rows]
    trained = [key_of[i] for i in lineage(ns.tmp / "raw")]
    train = _split_keys(ns, "train")
    assert len(trained) == len(set(trained)) == len(train) and set(trained) == set(train)
    assert not set(trained) & set(_split_keys(ns, "val") + _split_keys(ns, "test"))
    assert out.history[0]["val_f1"] >= 0


@pytest.mark.extended  # the gate checks crops across worker counts on the tar stream (test_train_stream)
def test_raw_parquet_crops_follow_the_sample_not_the_rank(parquet_digits):
    """2 workers against 1 resumed at position 32: the same samples get the same crops."""
    ns = parquet_digits
    raw = "model.options.image_input=raw"
    two, one = crops(ns, 2, 32, raw, *DATA), crops(ns, 1, 32, raw, *DATA)
    assert sorted(two) == sorted(one) and len(one) == ns.data.counts["train"] - 32
    assert all(two[i] == one[i] for i in one)
    other_seed = crops(ns, 1, 0, "model.options.image_input=raw", "train.seed=1", *DATA)
    assert sum(other_seed[i] != one[i] for i in one) > len(one) // 2  # the crops are drawn, not fixed
