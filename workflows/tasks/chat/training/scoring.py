"""The chat scorer: a registered chat model loaded once for the evaluation of processed rows (the
serving room's ChatPredictor hands them to it; raw rows go to the serving engine). Validation in
training scores with the same `token_nll` and greedy decoding.

For each row: its greedy answer (left-padded batches, up to model.options.max_new_tokens), the summed
next-token loss of its labels (`nll`, over `tokens` labels) and, for the baseline, the base model's
answer and loss on the same row (an adapter switched off; a whole model's base loaded on first use).
The sums, not per-row means, go back: the evaluation's loss is the token-weighted mean over the split,
as the validation in training computes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from workflows.tasks.chat.adapters import is_adapter
from workflows.tasks.chat.training.data import chat_collate, pad_left
from workflows.tasks.chat.training.model import (
    card_base_dir,
    completion_text,
    greedy_generate,
    load_causal_lm,
    load_tokenizer,
    load_trained,
    pad_id,
)
from workflows.tasks.predictor import Predictor, serving_device

PROCESSED = ("input_ids", "labels", "prompt_ids", "answer_ids")  # the columns of a processed row it scores


def token_nll(model, batch) -> tuple[Any, Any]:
    """Per row: the summed next-token loss over its labels, and how many labels (teacher forcing)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    target = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, ignore_index=-100, reduction="none")
    return nll.sum(-1), (target != -100).sum(-1)


class ChatScorer(Predictor):
    def __init__(self, task, model_dir: str, card, threads: int | None = None, batch_size: int = 16):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.task, self.card, self.cfg, self.options = task, card, task.cfg, task.options
        self.model_dir, self.batch_size = model_dir, batch_size
        self.device = serving_device()  # the replica's GPU when it has one; fp32 either way
        self.model = load_trained(model_dir, card, self.cfg).to(self.device)
        self.tok = load_tokenizer(model_dir)
        self.eos, self.pad = int(self.tok.eos_token_id), pad_id(self.tok)
        self.input_columns = list(PROCESSED)
        self._base = None

    # --- generation
    def _answers(self, model, prompts: list) -> list[str]:
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                ids, mask = pad_left(prompts[i:i + self.batch_size], self.pad)
                ids, mask = torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)
                gen = greedy_generate(model, ids, mask, self.options.max_new_tokens, self.eos, self.pad)
                out += [completion_text(self.tok, row, self.eos) for row in gen.tolist()]
        return out

    # --- evaluation
    def base_model(self):
        """The base model, for the baseline: the adapter switched off, or the whole model's base."""
        if is_adapter(self.model_dir):
            return None  # disable_adapter() on self.model
        if self._base is None:
            self._base = load_causal_lm(card_base_dir(self.card, self.cfg)).eval().to(self.device)
        return self._base

    def _score(self, model, batch) -> tuple[list, list, list]:
        import torch

        nll, tokens = [], []
        with torch.inference_mode():
            for i in range(0, len(batch["input_ids"]), self.batch_size):
                part = chat_collate({k: batch[k][i:i + self.batch_size] for k in ("input_ids", "labels")}, self.pad,
                                    prompts=False)
                part = {k: v.to(self.device) for k, v in part.items()}
                n, t = token_nll(model, part)
                nll += n.double().tolist()
                tokens += t.tolist()
        return self._answers(model, list(batch["prompt_ids"])), nll, tokens

    def predict_frame(self, batch):
        """Processed rows: `prediction`, `nll`, `tokens`, and the base model's `base_prediction`, `base_nll`."""
        columns = {k: list(batch[k]) for k in PROCESSED}
        batch["prediction"], batch["nll"], batch["tokens"] = self._score(self.model, columns)
        base = self.base_model()
        if base is None:
            with self.model.disable_adapter():
                answers, nll, _ = self._score(self.model, columns)
        else:
            answers, nll, _ = self._score(base, columns)
        batch["base_prediction"], batch["base_nll"] = answers, nll
        return batch


def exact_match(y_true: Sequence, y_pred: Sequence) -> float:
    """The share of answers equal to the reference once both are stripped of surrounding whitespace."""
    if not len(y_true):
        return 0.0
    return float(np.mean([str(p).strip() == str(t).strip() for t, p in zip(y_true, y_pred)]))
