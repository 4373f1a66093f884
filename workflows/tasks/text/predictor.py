"""The text classifier's predictor: a registered model loaded once, raw rows in, labels and
probabilities out (serving, batch inference and evaluation share it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from workflows.model_card import ModelCard
from workflows.preprocess.encoding import TextEncoder, compose_texts, pad_batch
from workflows.tasks.classify import add_predictions, prediction
from workflows.tasks.predictor import Predictor, serving_model
from workflows.tasks.text.model import load_trained_classifier


class TextPredictor(Predictor):
    """A registered text classifier loaded once: raw rows in, labels and probabilities out."""

    def __init__(self, model_dir: str, threads: int | None = None, precision: str = "fp32"):
        self.card = ModelCard.load(model_dir)
        if self.card.max_length is None:
            raise ValueError(f"{model_dir}/workflows.json has no max_length: not a servable model")
        self.labels: list[str] = self.card.labels
        self.text_columns: list[str] = self.card.text_columns
        self.input_columns = self.text_columns
        self.encoder = TextEncoder(model_dir, self.card.max_length, self.text_columns)
        self.precision = precision
        # safetensors weights only
        self.model, self.device = serving_model(load_trained_classifier(model_dir).eval(), precision, threads)

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
