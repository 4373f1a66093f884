"""The predictors shared by online serving, batch inference and evaluation (one code path, no skew):
each task's `predictor` builds one (workflows.tasks.base.Predictor); this module holds the text
classifier's and the Ray Data actor that runs any of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from workflows.model_card import ModelCard
from workflows.preprocess.encoding import TextEncoder, compose_texts, pad_batch
from workflows.tasks import base
from workflows.tasks.classify import add_predictions, prediction


class TextPredictor(base.Predictor):
    """A registered text classifier loaded once: raw rows in, labels and probabilities out."""

    def __init__(self, model_dir: str, threads: int | None = None, precision: str = "fp32"):
        from workflows.train.models import load_trained_classifier

        self.card = ModelCard.load(model_dir)
        if self.card.max_length is None:
            raise ValueError(f"{model_dir}/workflows.json has no max_length: not a servable model")
        self.labels: list[str] = self.card.labels
        self.text_columns: list[str] = self.card.text_columns
        self.input_columns = self.text_columns
        self.encoder = TextEncoder(model_dir, self.card.max_length, self.text_columns)
        if threads:
            torch.set_num_threads(threads)
        model = load_trained_classifier(model_dir).eval()  # safetensors weights only
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.precision = precision
        if precision == "int8":  # dynamic quantization: int8 weights, activations quantized per batch (CPU kernels)
            self.device = torch.device("cpu")
            model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        elif precision == "bf16":
            model = model.to(torch.bfloat16)
        elif precision != "fp32":
            raise ValueError(f"unknown precision {precision!r}")
        self.model = model.to(self.device)

    @torch.inference_mode()
    def probabilities(self, columns: Mapping[str, Sequence[object]], batch_size: int = 64) -> np.ndarray:
        texts = compose_texts(columns, self.text_columns)
        out = []
        for i in range(0, len(texts), batch_size):
            ids, mask = pad_batch(self.encoder.encode_texts(texts[i : i + batch_size]), self.encoder.pad_id)
            logits = self.model(input_ids=torch.from_numpy(ids).to(self.device),
                                attention_mask=torch.from_numpy(mask).to(self.device)).logits
            out.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), dtype=np.float32)

    def predict(self, rows: Sequence[Mapping[str, object]]) -> list[dict]:
        columns = {c: [row.get(c) for row in rows] for c in self.text_columns}
        probs = self.probabilities(columns)
        return [prediction(self.labels, p) for p in probs]

    def predict_frame(self, batch):
        return add_predictions(batch, self.labels, self.probabilities(batch))


Predictor = TextPredictor  # the name benches and notebooks import


def load_predictor(cfg, model_dir: str, threads: int | None = None, precision: str | None = None) -> base.Predictor:
    """The predictor of a registered model directory, built by the task its card names."""
    from workflows.tasks import task_for_card

    card = ModelCard.load(model_dir)
    return task_for_card(cfg, card).predictor(model_dir, card, threads, precision or cfg.serve.precision)


class BatchPredictor:
    """Ray Data actor for batch inference and evaluation: the model is fetched and loaded once per actor.

    It takes the registry coordinates, not a local path, so an actor on any node fetches the model
    into that node's cache.
    """

    def __init__(self, cfg: dict, model_spec: str, threads: int = 1, precision: str | None = None):
        from workflows import registry
        from workflows.config import WorkflowConfig
        from workflows.storage.uri import StorageContext

        wcfg = WorkflowConfig.model_validate(cfg)
        model_dir, _ = registry.fetch(wcfg, StorageContext.from_config(wcfg.storage), model_spec)
        self.predictor = load_predictor(wcfg, model_dir, threads, precision)

    def __call__(self, batch):
        return self.predictor.predict_frame(batch)
