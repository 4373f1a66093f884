"""The evaluation report without a model: metrics, the confusion matrix in the JSON, printed, and
as a PNG."""

import json

from workflows.evaluate import classification_metrics, format_report, plot_confusion


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
