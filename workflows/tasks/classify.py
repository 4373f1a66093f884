"""What every classification task shares: validation F1/accuracy (a confusion matrix per batch,
summed over the ranks by the platform), the held-out report (weighted and per-class P/R/F1 against a
majority-class baseline, confusion matrix) and the prediction a served classifier answers (label,
score, every label's probability)."""

from __future__ import annotations

import numpy as np

from workflows.tasks.base import Task
from workflows.tasks.contract import classification_prediction
from workflows.tasks.seams import EvaluationSeam, ServingSeam, TrainingSeam


class ClassificationTraining(TrainingSeam):
    pad_label = -100  # Hugging Face's classification losses and F.cross_entropy ignore it


class ClassificationEvaluation(EvaluationSeam):
    """The per-class report, headed by weighted F1 against the majority label."""

    def report(self, metrics: dict) -> str:
        return format_report(metrics)

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        return "weighted F1", metrics["weighted"]["f1"], f"majority baseline {metrics['baseline']['f1']:.4f}"

    def comparable_metrics(self) -> dict[str, str]:
        """Weighted F1 (the headline), precision and recall, and accuracy."""
        return {"f1": "max", "precision": "max", "recall": "max", "accuracy": "max"}

    def metric_value(self, metrics: dict, name: str) -> float:
        return float(metrics["accuracy"] if name == "accuracy" else metrics["weighted"][name])


class ClassificationServing(ServingSeam):
    """Answers {"label", "score", "probabilities"}."""

    prediction_key = "label"

    def prediction_model(self, card):
        return classification_prediction(card.labels)

    def describe_prediction(self, prediction) -> str:
        return f"{prediction['label']} ({prediction['score']:.2f})"


class Classification(Task):
    """Base of a task whose model maps an input to one of `data.labels`.

    The model's forward returns `.logits` (rows x labels) and, given `labels` (label ids, the
    index in `data.labels`), `.loss`. This class then provides the validation metrics (`val_f1`,
    weighted as scikit-learn weights it, the checkpoint ranking; `val_accuracy`; `val_loss`), the
    held-out report (`evaluate_rows`: per-class precision, recall and F1 against the majority label)
    and serving's answers, {"label", "score", "probabilities"} (softmax of the logits). A subclass
    writes `preprocess`, `collate`, `build_model` and, with the default predictor, `inputs`."""

    score = ("val_f1", "max")
    Training = ClassificationTraining
    Evaluation = ClassificationEvaluation
    Serving = ClassificationServing

    def metric_states(self, model, batch) -> dict:
        import torch

        out = model(**batch)
        n = out.logits.shape[-1]
        pred, gold = out.logits.argmax(-1), batch["labels"]
        # on the batch's device: validation sums the states there and reads them once
        return {"loss": out.loss.detach() * gold.shape[0],
                "confusion": torch.bincount(gold * n + pred, minlength=n * n).reshape(n, n)}

    def compute_metrics(self, states, data) -> dict:
        confusion = np.asarray(states["confusion"], dtype=np.float64)
        val = scores_from_confusion(confusion)
        return {"val_f1": val["f1"], "val_accuracy": val["accuracy"],
                "val_loss": float(states["loss"] / max(confusion.sum(), 1))}

    def predict_batch(self, model, batch, data) -> list[dict]:
        import torch

        probs = torch.softmax(model(**batch).logits.float(), dim=-1).numpy()
        return [prediction(data.labels, p) for p in probs]

    def evaluate_rows(self, y_true: list, y_pred: list, card) -> dict:
        import pandas as pd

        y_true, y_pred = [str(y) for y in y_true], [str(y) for y in y_pred]
        metrics = classification_metrics(y_true, y_pred, card.labels)
        majority = card.majority_label or pd.Series(y_true).mode().iloc[0]
        metrics["baseline"] = {"majority_label": majority,
                               **classification_metrics(y_true, [majority] * len(y_true), card.labels)["weighted"]}
        metrics["unknown_labels"] = int(np.sum(~pd.Series(y_true).isin(card.labels)))
        return metrics


def prediction(labels: list[str], p: np.ndarray) -> dict:
    """One served prediction of a classifier from a row of probabilities: {"label": the most probable
    label, "score": its probability, "probabilities": {label: probability}}."""
    i = int(p.argmax())
    return {"label": labels[i], "score": float(p[i]), "probabilities": {lab: float(x) for lab, x in zip(labels, p)}}


def add_predictions(batch, labels: list[str], probs: np.ndarray):
    """Batch inference and evaluation: the `prediction` (label) and `score` (its probability) columns
    of a pandas batch, from the rows' probabilities."""
    idx = probs.argmax(1)
    batch["prediction"] = [labels[i] for i in idx]
    batch["score"] = probs[np.arange(len(idx)), idx]
    return batch


def classification_metrics(y_true: list[str], y_pred: list[str], labels: list[str]) -> dict:
    """Accuracy, weighted and per-class precision/recall/F1 and the confusion matrix (scikit-learn's)."""
    from sklearn.metrics import accuracy_score, confusion_matrix, precision_recall_fscore_support

    labels = sorted(set(labels) | set(y_true))
    p, r, f, s = precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    wp, wr, wf, _ = precision_recall_fscore_support(y_true, y_pred, labels=labels, average="weighted", zero_division=0)
    return {
        "rows": len(y_true),
        "accuracy": float(accuracy_score(y_true, y_pred)) if y_true else 0.0,
        "weighted": {"precision": float(wp), "recall": float(wr), "f1": float(wf)},
        "per_class": {lab: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(s[i])}
                      for i, lab in enumerate(labels)},
        # matrix[i][j]: rows of true label i predicted as label j
        "confusion_matrix": {"labels": labels,
                             "matrix": confusion_matrix(y_true, y_pred, labels=labels).tolist()},
    }


def format_report(metrics: dict) -> str:
    """The held-out report of `Classification.evaluate_rows` as a table."""
    lines = [f"{'class':<28} {'precision':>9} {'recall':>9} {'f1':>9} {'support':>8}"]
    for lab, m in metrics["per_class"].items():
        lines.append(f"{lab:<28} {m['precision']:>9.3f} {m['recall']:>9.3f} {m['f1']:>9.3f} {m['support']:>8d}")
    w = metrics["weighted"]
    lines.append(f"{'weighted':<28} {w['precision']:>9.3f} {w['recall']:>9.3f} {w['f1']:>9.3f} {metrics['rows']:>8d}")
    b = metrics["baseline"]
    lines.append(
        f"{'majority baseline':<28} {b['precision']:>9.3f} {b['recall']:>9.3f} {b['f1']:>9.3f}"
        f"   ({b['majority_label']})"
    )
    if cm := metrics.get("confusion_matrix"):
        lines += ["", "confusion matrix (rows: true label, columns: predicted, in this order)"]
        width = max(8, *(len(str(n)) + 1 for row in cm["matrix"] for n in row))
        lines.append(f"{'':<28}" + "".join(f"{lab[:width - 1]:>{width}}" for lab in cm["labels"]))
        lines += [f"{lab:<28}" + "".join(f"{n:>{width}d}" for n in row) for lab, row in zip(cm["labels"], cm["matrix"])]
    return "\n".join(lines)


def scores_from_confusion(confusion: np.ndarray) -> dict:
    """Accuracy and weighted F1 from a confusion matrix (rows: gold, columns: predicted), by
    scikit-learn as evaluate.py scores a model: one F1 definition. The ranks all-reduce the small
    matrix rather than their predictions; each cell goes to sklearn as one (gold, predicted) pair
    weighted by its count, which scores the same as the rows it counts without rebuilding them."""
    from sklearn.metrics import accuracy_score, precision_recall_fscore_support

    total = confusion.sum()
    if not total:
        return {"accuracy": 0.0, "f1": 0.0, "rows": 0}
    n = confusion.shape[0]
    gold, pred = np.divmod(np.arange(n * n), n)
    weight = confusion.reshape(-1)
    _, _, f1, _ = precision_recall_fscore_support(
        gold, pred, labels=np.arange(n), average="weighted", sample_weight=weight, zero_division=0
    )
    return {
        "accuracy": float(accuracy_score(gold, pred, sample_weight=weight)),
        "f1": float(f1),
        "rows": int(total),
    }
