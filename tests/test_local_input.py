"""Every launcher trains on the same input: torchrun (workflows.train.standalone) and a one-worker
Tune trial (workflows.tune.trial) read, with train.loader=stream, the batches a Ray Train worker
reads (StreamInput), not the rows in memory in an order of their own. No Ray: the classification
example on a processed dataset written here, both launchers run in this process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tests.test_plugin_task import PLUGINS as EXAMPLES
from workflows.config import load_config
from workflows.dataset import ProcessedDataset
from workflows.storage.uri import StorageContext

LOCAL = StorageContext()
TASK = "tabular_classification:TabularClassification"
TRAIN_FILES = [20, 15, 25]  # rows per parquet file of the train split


def write_split(root: Path, split: str, sizes: list[int], first: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / f"split={split}").mkdir(parents=True)
    files, i = [], first
    for k, n in enumerate(sizes):
        ids = np.arange(i, i + n)
        path = root / f"split={split}" / f"part-{k}.parquet"
        # feature `a` is the row's id: a batch's ids are its rows
        pq.write_table(pa.table({"a": ids.astype(np.float64), "b": np.sin(ids), "label_id": ids % 3}), path)
        files.append(str(path))
        i += n
    return files


@pytest.fixture
def wine_like(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    root = tmp_path / "processed"
    files = {"train": write_split(root, "train", TRAIN_FILES, 0), "val": write_split(root, "val", [9], 1000),
             "test": []}
    data = ProcessedDataset(uri=str(root), version="v", labels=["x", "y", "z"], label_column="cultivar", files=files,
                            counts={"train": sum(TRAIN_FILES), "val": 9, "test": 0}, label_counts={},
                            source=str(tmp_path / "raw"), task=TASK,
                            info={"features": ["a", "b"], "label": "cultivar", "mean": [0.0, 0.0], "std": [1.0, 1.0]})

    def config(*sets: str):
        return load_config(None, [f"data.source={tmp_path}/raw", f"model.task={TASK}", "model.options.features=[a,b]",
                                  "model.options.label=cultivar", "train.epochs=2", "train.batch_size=8",
                                  "train.num_workers=1", f"cache.dir={tmp_path}/cache",
                                  f"output_dir={tmp_path}/runs", "tracking.enabled=false", *sets])

    return data, config


def row_ids(batch: dict) -> list[int]:
    return batch["features"][:, 0].long().tolist()


def trained_batches(monkeypatch, what=row_ids) -> list[list]:
    """Records `what` of every batch each epoch trains on (engine's train_epoch): by default the
    batch's row ids."""
    import workflows.train.engine as engine

    epochs: list[list] = []
    train_epoch = engine.train_epoch

    def recording(model, batches, *args, **kwargs):
        batches = list(batches)
        epochs.append([what(b) for b in batches])
        return train_epoch(model, batches, *args, **kwargs)

    monkeypatch.setattr(engine, "train_epoch", recording)
    return epochs


def ray_train_input(cfg, data) -> list[list[list[int]]]:
    """What a Ray Train worker trains on with this config (ray_worker.RayInput: StreamInput), one worker."""
    from workflows.tasks import get_task
    from workflows.train.stream_input import StreamInput

    stream = StreamInput(cfg, data, LOCAL, 0, 1, data.counts["train"], task=get_task(cfg))
    return [[row_ids(b) for b in stream.train_batches(epoch, 0)] for epoch in range(cfg.train.epochs)]


def test_torchrun_trains_on_the_stream_loaders_batches(wine_like, monkeypatch):
    from workflows.train.standalone import train

    data, config = wine_like
    cfg = config("train.loader=stream")
    epochs = trained_batches(monkeypatch)
    summary = train(cfg, LOCAL, data)
    assert summary["train_rows"] == 60 and len(summary["history"]) == 2
    assert epochs == ray_train_input(cfg, data)
    assert all(sorted(i for b in e for i in b) == list(range(60)) for e in epochs)


def test_a_one_worker_trial_trains_on_the_stream_loaders_batches(wine_like, monkeypatch):
    import ray.tune

    import workflows.storage.cache_stats
    from workflows.tune import trial

    data, config = wine_like
    cfg = config("train.loader=stream")
    epochs = trained_batches(monkeypatch)
    monkeypatch.setattr(ray.tune, "get_checkpoint", lambda: None)  # no Tune session here
    monkeypatch.setattr(trial.TrialTrainer, "end_of_epoch", lambda self, epoch, metrics: None)
    monkeypatch.setattr(workflows.storage.cache_stats, "report", lambda before, after: None)
    trial._run_local_trial(cfg, LOCAL, data, None)
    assert epochs == ray_train_input(cfg, data)


def test_without_the_stream_loader_torchrun_reads_the_rows(wine_like, monkeypatch):
    """loader=ray_data: torchrun's rows in memory, each once per epoch in an order of their own."""
    from workflows.train.standalone import train

    data, config = wine_like
    epochs = trained_batches(monkeypatch)
    train(config(), LOCAL, data)
    assert all(sorted(i for b in e for i in b) == list(range(60)) for e in epochs)
    assert epochs != ray_train_input(config("train.loader=stream"), data)


def test_a_copied_processed_dataset_is_read_where_it_is(wine_like, tmp_path):
    """`--data URI` (torchrun) of a copy: each listed file at its path under the copy, an attempt's folder
    included (preprocessing writes split folders inside one), not where the manifest says it was written."""
    import json
    import shutil

    from workflows.train.standalone import find_dataset

    data, config = wine_like
    attempt = tmp_path / "written" / "attempt-1"
    shutil.copytree(data.uri, attempt)
    files = {s: [str(attempt / Path(f).relative_to(data.uri)) for f in fs] for s, fs in data.files.items()}
    manifest = {**json.loads(json.dumps(data.__dict__, default=str)), "uri": str(tmp_path / "written"), "files": files}
    (tmp_path / "written" / "manifest.json").write_text(json.dumps(manifest))
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "written", copy)
    shutil.rmtree(tmp_path / "written")
    found = find_dataset(config(), StorageContext(), str(copy))
    assert found.uri == str(copy) and len(found.files["train"]) == len(TRAIN_FILES)
    assert all(Path(f).is_file() and f.startswith(str(copy / "attempt-1" / "split=")) for s in found.files
               for f in found.files[s])


def test_a_stream_runs_validation_reads_the_val_split_in_the_worker(wine_like):
    """loader=stream: a Ray Train worker's validation rows come from the loader too (no Ray Data in the
    run): the first train.max_val_rows rows of the split, every one once, whole on each rank or, in
    shares (val_positions' step), each row on exactly one rank."""
    from workflows.tasks import get_task
    from workflows.train.stream_input import StreamInput

    data, config = wine_like
    cfg = config("train.loader=stream", "evaluate.batch_size=4")
    val = [[row_ids(b) for b in StreamInput(cfg, data, LOCAL, rank, 2, 60, task=get_task(cfg)).val_batches(
        rows, share, get_task(cfg).collate(data, train=False))]
        for rows, share, rank in ((9, slice(None), 0), (7, slice(0, None, 2), 0), (7, slice(1, None, 2), 1))]
    whole, first, second = ([i for b in v for i in b] for v in val)
    assert sorted(whole) == list(range(1000, 1009)) and all(len(b) <= 4 for b in val[0])
    assert sorted(first + second) == list(range(1000, 1007)) and len(first) == 4 and len(second) == 3
    stream = StreamInput(cfg, data, LOCAL, 0, 1, 60, task=get_task(cfg))
    collate = get_task(cfg).collate(data, train=False)
    assert [row_ids(b) for b in stream.val_batches(9, slice(None), collate)] == \
        [row_ids(b) for b in stream.val_batches(9, slice(None), collate)]  # each validation the same


def test_the_loader_decodes_inline_unless_the_task_decodes_in_it(wine_like):
    """train.loader_workers' default: no process beside the training one for processed rows (nothing to
    decode; the collate runs in the trainer), the worker's CPUs minus one where the loader decodes."""
    _, config = wine_like
    tc = config("train.loader=stream", "train.cpus_per_worker=3").train
    assert tc.decode_workers(False) == 0 and tc.decode_workers(True) == 2
    assert config("train.loader_workers=1").train.decode_workers(False) == 1


def test_a_small_split_is_read_for_evaluation_here_unless_its_columns_are_tensors(wine_like, tmp_path):
    """Evaluation of a small processed split (SplitRows) reads the plain columns it scores in this
    process, every row in file order; a tensor column (Ray's extension type) is left to Ray Data."""
    import pyarrow.parquet as pq

    from workflows.dataset import SplitRows

    data, _ = wine_like
    rows = SplitRows(data, "train", LOCAL)
    assert rows.names() == {"a", "b", "label_id"} and rows.rows == 60
    assert rows.frame(["a", "label_id"])["a"].tolist() == list(range(60))
    tensor = pa.ExtensionArray.from_storage(Tensorish(), pa.array([[1, 2], [3, 4]]))
    pq.write_table(pa.table({"ids": tensor, "label_id": [0, 1]}), tmp_path / "t.parquet")
    data.files["val"] = [str(tmp_path / "t.parquet")]
    assert SplitRows(data, "val", LOCAL).frame(["ids", "label_id"]) is None
    assert SplitRows(data, "val", LOCAL).frame(["label_id"])["label_id"].tolist() == [0, 1]
    with pytest.raises(Exception, match="no rows in split 'test'"):
        SplitRows(data, "test", LOCAL).names()


class Tensorish(pa.ExtensionType):
    """An extension type as Ray Data's tensor columns are, unregistered (as a reader without ray.data sees one)."""

    def __init__(self):
        super().__init__(pa.list_(pa.int64()), "test.tensorish")

    def __arrow_ext_serialize__(self):
        return b""

    @classmethod
    def __arrow_ext_deserialize__(cls, storage_type, serialized):
        return cls()
