"""What every classification task shares: validation F1/accuracy over all ranks, the held-out report
(weighted and per-class P/R/F1 against a majority-class baseline, confusion matrix) and the
prediction a served classifier answers (label, score, every label's probability)."""

from __future__ import annotations

import numpy as np

from workflows.tasks.base import Task


class Classification(Task):
    """A task whose model maps an input to one of `data.labels` (logits -> softmax)."""

    score = ("val_f1", "max")

    def validate(self, model, batches, device, data) -> dict:
        from workflows.train.loop import evaluate

        val = evaluate(model, batches, len(data.labels), device)
        return {"val_f1": val["f1"], "val_accuracy": val["accuracy"], "val_loss": val["loss"]}

    def evaluate_rows(self, y_true: list, y_pred: list, card) -> dict:
        import pandas as pd

        from workflows.evaluate import classification_metrics

        y_true, y_pred = [str(y) for y in y_true], [str(y) for y in y_pred]
        metrics = classification_metrics(y_true, y_pred, card.labels)
        majority = card.majority_label or pd.Series(y_true).mode().iloc[0]
        metrics["baseline"] = {"majority_label": majority,
                               **classification_metrics(y_true, [majority] * len(y_true), card.labels)["weighted"]}
        metrics["unknown_labels"] = int(np.sum(~pd.Series(y_true).isin(card.labels)))
        return metrics

    def format_report(self, metrics: dict) -> str:
        from workflows.evaluate import format_report

        return format_report(metrics)

    def headline(self, metrics: dict) -> tuple[str, float, str]:
        return "weighted F1", metrics["weighted"]["f1"], f"majority baseline {metrics['baseline']['f1']:.4f}"


def prediction(labels: list[str], p: np.ndarray) -> dict:
    """One served prediction from a row of probabilities."""
    i = int(p.argmax())
    return {"label": labels[i], "score": float(p[i]), "probabilities": {lab: float(x) for lab, x in zip(labels, p)}}


def add_predictions(batch, labels: list[str], probs: np.ndarray):
    """Batch inference and evaluation: the `prediction` and `score` columns of a pandas batch."""
    idx = probs.argmax(1)
    batch["prediction"] = [labels[i] for i in idx]
    batch["score"] = probs[np.arange(len(idx)), idx]
    return batch
