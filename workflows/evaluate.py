"""Evaluation: the task's held-out report (a classifier: weighted and per-class precision/recall/F1
against a majority-class baseline, and the confusion matrix).

Predictions come from the same predictor as serving, run as a Ray Data actor pool, or in the
calling process for a split of at most `evaluate.in_process_max_rows` rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from workflows.dataset import SplitRows
from workflows.errors import UserError
from workflows.model_card import ModelCard
from workflows.serve.predictor import BatchPredictor
from workflows.tasks import task_for_card


def evaluate_dataset(
    cfg, model_spec: str, card: ModelCard, ds, label_column: str | None = None, concurrency: int = 1
) -> dict:
    """Run the model over rows (the model's input columns + label) and score it with its task: a Ray
    Dataset, or a processed split (SplitRows) whose plain columns a small split has read here;
    `card` is the registered version's (registry.model_card)."""
    import ray.data

    task = task_for_card(cfg, card)
    label_column = label_column or card.label_column
    split = ds if isinstance(ds, SplitRows) else None
    names = split.names() if split is not None else set(ds.schema().names)
    inputs = task.serving.input_columns(card, names)
    missing = [c for c in [*inputs, label_column] if c not in names]
    if missing:
        raise UserError(f"evaluation data lacks column(s) {missing} the model needs (has {sorted(names)})")
    args, size = (cfg.model_dump(mode="json"), model_spec), cfg.evaluate.batch_size
    cap = cfg.evaluate.in_process_max_rows
    wanted = [*inputs, str(label_column)]
    head = split.frame(wanted) if split is not None and 0 < split.rows <= cap else None
    if head is None:
        ds = (split.dataset() if split is not None else ds).select_columns(wanted)
        head = ds.limit(cap + 1).to_pandas() if cap else None
    if head is not None and len(head) <= cap:
        # a small split: the same predictor, called here, skips the actor's start and model load
        predict = BatchPredictor(*args)
        table = pd.concat([predict(head.iloc[i:i + size].copy()) for i in range(0, len(head), size)]) \
            if len(head) else head.assign(**{c: [] for c in task.evaluation.columns})
    else:
        scored = ds.map_batches(BatchPredictor, fn_constructor_args=args, batch_format="pandas", batch_size=size,
                                compute=ray.data.ActorPoolStrategy(size=concurrency))
        table = scored.select_columns([label_column, *task.evaluation.columns]).to_pandas()
    table = table[table[label_column].notna()]
    if not len(table):
        raise UserError("evaluation data has no labelled rows")
    return task.evaluation.frame(table, str(label_column), card)


def plot_confusion(metrics: dict, path) -> Path:
    """The confusion matrix as a PNG (counts in the cells, rows = true label)."""
    from workflows.plots import new_figure, save_png

    labels, matrix = metrics["confusion_matrix"]["labels"], np.array(metrics["confusion_matrix"]["matrix"])
    fig, ax = new_figure(1.5 + 0.9 * len(labels), 1.0 + 0.8 * len(labels))
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    top = matrix.max() if matrix.size else 0
    for (i, j), n in np.ndenumerate(matrix):
        ax.text(j, i, str(n), ha="center", va="center", color="white" if n > top / 2 else "black")
    ax.set_title(f"confusion matrix, {int(matrix.sum())} rows")
    return save_png(fig, Path(path))
