"""The predictors shared by online serving, batch inference and evaluation (one code path, no skew):
each task's `predictor` builds one (workflows.tasks.base.Predictor); this module loads the one a
registered model's card names and holds the Ray Data actor that runs any of them. The text
classifier's own is workflows.tasks.text.predictor.TextPredictor."""

from __future__ import annotations

from workflows.config import WorkflowConfig
from workflows.model_card import ModelCard
from workflows.tasks import base, task_for_card


def load_predictor(cfg, model_dir: str, threads: int | None = None, precision: str | None = None) -> base.Predictor:
    """The predictor of a registered model directory, built by the task its card names."""
    card = ModelCard.load(model_dir)
    return task_for_card(cfg, card).serving.predictor(model_dir, card, threads, precision or cfg.serve.precision)


class BatchPredictor:
    """Ray Data actor for batch inference and evaluation: the model is fetched and loaded once per actor.

    It takes the registry coordinates, not a local path, so an actor on any node fetches the model
    into that node's cache.
    """

    def __init__(self, cfg: dict, model_spec: str, threads: int = 1, precision: str | None = None):
        from workflows import registry
        from workflows.storage.uri import StorageContext

        wcfg = WorkflowConfig.model_validate(cfg)
        model_dir, _ = registry.fetch(wcfg, StorageContext.from_config(wcfg.storage), model_spec)
        self.predictor = load_predictor(wcfg, model_dir, threads, precision)

    def __call__(self, batch):
        return self.predictor.predict_frame(batch)
