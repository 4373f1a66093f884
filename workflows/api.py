"""The public API of a task plug-in: the only `workflows` module a plug-in imports.

A task is a class named in the config, `model.task: my_module:MyTask`, with its own settings in
`model.options` (validated by its `Options` pydantic model). Loading the config imports it and checks
that it defines the methods it must, with the base's parameters, before Ray starts.

What a task writes (`Task`; `Classification` writes the metric and serving parts of a classifier):

- `preprocess(ctx, say)`: the raw shards -> a `ProcessedDataset` (`preprocess_table` for numeric
  columns and a label or target; `list_shards`, `read_dataset`, `split_of`, `write_splits`,
  `write_manifest` and `materialized` to write one yourself);
- `collate(data, *, train, seed)`: a function, numpy columns -> the model's keyword tensors, with
  `labels` when the label column is there (serving collates instances without it);
- `build_model(data)`: a torch module whose forward returns `.loss` given `labels` (e.g. a
  `ModelOutput`), or a training seam whose `loss(model, batch)` computes it;
- `metric_states(model, batch)`: one validation batch's sums and counts (tensors or numbers). The
  platform sums them over the batches and across the ranks (one all-reduce, as torchmetrics'
  dist_reduce_fx="sum") and calls `compute_metrics(states, data)` once for the val_* metrics; a task
  never calls a collective itself. `score` names the metric that ranks checkpoints;
- a task that registers its model: `evaluate_rows(y_true, y_pred, card)` (the held-out report),
  `inputs()` (the served instance's columns and JSON types) and `predict_batch(model, batch, data)`
  (a collated batch -> one prediction dict per instance).

The rest is optional, in four seams with defaults, each a class a task replaces by naming its own
subclass (`class Dataset(DatasetSeam): ...` in the task's body) only where a default does not fit:
`DatasetSeam` (the dataset's version, a last step before training), `TrainingSeam` (model
preparation, the loss, the head's learning rate), `EvaluationSeam` (the report, its headline, the
numbers the promotion gate compares) and `ServingSeam` (export, predictor, HTTP contract, demo).

A processed dataset is written once per version (`DatasetSeam.version`), by default a hash of the
raw shards, the split settings, `preprocess.rows_per_shard`, the task, its stored `columns` and
every option but those named in the dataset seam's `model_only_options` (options that shape the
model alone, such as a hidden size): a changed option that preprocessing reads makes a new dataset.

The defaults of the serving seam do the rest: `export` writes the state dict as safetensors with a
model card (labels, label column, the dataset's `info`, the options), `ModelPredictor` loads it into
`build_model` and answers with `predict_batch`, the HTTP contract is built from `inputs`, and the
pipeline's demo requests are the val split's first rows. examples/tasks/ holds complete plug-ins.
"""

from workflows.dataset import ProcessedDataset, materialized, split_of, write_manifest, write_splits
from workflows.errors import UserError
from workflows.model_card import ModelCard, write_card
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.storage.shards import read_parquet
from workflows.tasks.base import (
    HttpContract,
    MetricStates,
    ModelOutput,
    ModelPredictor,
    Predictor,
    Task,
    card_dataset,
)
from workflows.tasks.classify import Classification, add_predictions, prediction
from workflows.tasks.contract import JsonInstances, classification_prediction
from workflows.tasks.seams import DatasetSeam, EvaluationSeam, ServingSeam, TrainingSeam
from workflows.tasks.table import preprocess_table

__all__ = [
    "Classification", "DatasetSeam", "EvaluationSeam", "HttpContract", "JsonInstances", "MetricStates", "ModelCard",
    "ModelOutput", "ModelPredictor", "Predictor", "ProcessedDataset", "ServingSeam", "Task", "TrainingSeam",
    "UserError", "add_predictions", "card_dataset", "classification_prediction", "list_shards", "materialized",
    "prediction", "preprocess_table", "read_dataset", "read_parquet", "split_of", "write_card", "write_manifest",
    "write_splits",
]
