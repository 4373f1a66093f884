"""The evaluation report without a model: metrics, the confusion matrix in the JSON, printed, and
as a PNG."""

import json

from workflows.evaluate import plot_confusion
from workflows.tasks.classify import classification_metrics, format_report


def test_confusion_matrix_is_in_the_metrics_printed_and_drawn(tmp_path):
    y_true = ["cat", "cat", "dog", "dog", "dog", "eel"]
    y_pred = ["cat", "dog", "dog", "dog", "cat", "eel"]
    m = classification_metrics(y_true, y_pred, ["cat", "dog", "eel", "fox"])
    # rows: true label, columns: predicted; a label the model knows but the data lacks stays in
    assert m["confusion_matrix"] == {"labels": ["cat", "dog", "eel", "fox"],
                                     "matrix": [[1, 1, 0, 0], [1, 2, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]}
    json.dumps(m)  # the summary and --output JSON take it as is
    m["baseline"] = {"majority_label": "dog", **classification_metrics(y_true, ["dog"] * 6, ["cat", "dog"])["weighted"]}
    report = format_report(m).splitlines()
    at = report.index("confusion matrix (rows: true label, columns: predicted, in this order)")
    assert report[at + 1].split() == ["cat", "dog", "eel", "fox"]
    assert report[at + 3].split() == ["dog", "1", "2", "0", "0"]
    png = plot_confusion(m, tmp_path / "runs" / "confusion_matrix.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


# ------------------------------------------------- `evaluate --split`: checked before Ray starts
def _registry_with_models(tmp_path):
    """A local store with model m: v1 without a dataset in its lineage, v2 trained on a processed
    dataset that is gone, v3 on one that is there."""
    from tests.conftest import QUICKSTART
    from workflows import registry
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext

    sets = ["storage.embedded.enabled=false", f"storage.root={tmp_path}/store", f"output_dir={tmp_path}/runs",
            f"cache.dir={tmp_path}/cache", "tracking.enabled=false"]
    cfg, ctx = load_config(QUICKSTART, sets), StorageContext()
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"weights")
    card = {"task": "classification", "labels": ["a", "b"], "text_columns": ["text"], "label_column": "label"}
    data = tmp_path / "store" / "processed" / "d3"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text(json.dumps({
        "uri": str(data), "version": "d3", "labels": ["a", "b"], "label_column": "label",
        "files": {"test": [str(data / "test.parquet")]}, "counts": {"test": 2}, "label_counts": {}, "source": "x"}))
    for v, lineage in enumerate(({"run": "r1"}, {"dataset_uri": str(tmp_path / "store" / "processed" / "gone")},
                                 {"dataset_uri": str(data)}), 1):
        (tmp_path / "store" / "models" / "m" / f"v{v}").mkdir(parents=True)  # an object store needs none
        registry.register(cfg, ctx, str(art), "m", {**card, "lineage": lineage})
    return [f"--set={s}" for s in sets]


class _RayStarted(Exception):
    pass


def _evaluate(sets, *args):
    from typer.testing import CliRunner

    from tests.conftest import QUICKSTART
    from workflows.cli import app

    return CliRunner().invoke(app, ["evaluate", "--config", str(QUICKSTART), *sets, "--verbose", *args])


def test_evaluate_split_checks_the_split_and_lineage_before_ray(tmp_path, monkeypatch):
    import workflows.runtime

    def no_ray(cfg):
        raise _RayStarted

    monkeypatch.setattr(workflows.runtime, "init_ray", no_ray)
    sets = _registry_with_models(tmp_path)
    for args, message in [
        (["-m", "m", "--split", "dev"], "error: --split 'dev': expected one of train, val, test"),
        (["-m", "m:1", "--split", "test"],
         "error: model m:v1 records no processed dataset in its lineage; evaluate it with --data URI"),
        (["-m", "m:2", "--split", "test"],
         f"error: model m:v2 was trained on the processed dataset {tmp_path}/store/processed/gone, which is gone "
         "(no manifest.json there); evaluate it with --data URI"),
        (["-m", "nope", "--split", "test"], "error: model 'nope' not found in the registry at "),
    ]:
        res = _evaluate(sets, *args)
        assert res.exit_code == 2 and message in res.output, (args, res.output)
        assert not isinstance(res.exception, _RayStarted)
    res = _evaluate(sets, "-m", "m", "--split", "test")  # all good: on to Ray
    assert isinstance(res.exception, _RayStarted), res.output


def test_evaluate_split_reads_the_model_card_once_and_evaluates_that_version(tmp_path, monkeypatch):
    import workflows.evaluate
    import workflows.runtime
    from workflows import registry
    from workflows.dataset import SplitRows

    sets = _registry_with_models(tmp_path)
    reads, evaluated = [], []
    real_card = registry.model_card
    monkeypatch.setattr(registry, "model_card", lambda *a: reads.append(a[-1]) or real_card(*a))
    monkeypatch.setattr(workflows.runtime, "init_ray", lambda cfg: False)  # no Ray: the reads are replaced

    def evaluate_dataset(cfg, model_spec, card, ds, label_column=None):
        assert isinstance(ds, SplitRows)  # the split, read as evaluate_dataset chooses
        evaluated.append((model_spec, card.version, f"{ds.data.version}/{ds.split} rows"))
        metrics = classification_metrics(["a", "b"], ["a", "a"], ["a", "b"])
        return {"rows": 2, **metrics, "baseline": {"majority_label": "a", **metrics["weighted"]}}

    monkeypatch.setattr(workflows.evaluate, "evaluate_dataset", evaluate_dataset)
    res = _evaluate(sets, "-m", "m", "--split", "test")
    assert res.exit_code == 0, res.output
    assert reads == ["m"] and evaluated == [("m:3", 3, "d3/test rows")]
    summary = json.loads((tmp_path / "runs" / "quickstart" / "evaluate.json").read_text())
    assert summary["data"] == f"{tmp_path}/store/processed/d3/split=test/" and summary["rows"] == 2
