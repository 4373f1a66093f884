"""The text classifier's model: a pretrained encoder from a local Hugging Face directory (MiniLM by
default) with a new head, its collate (token ids padded per batch), its size for the memory planner
(`classifier_spec`) and the linear probe that can start its head (LP-FT).

Two poolings (the classification task's model.options.pooling):
- "cls": Hugging Face's sequence-classification model (its pooler on the first token, then a linear head).
- "mean": `MeanPoolClassifier`, the masked mean of the last hidden states, L2-normalized, into a
  scaled linear head: the representation sentence-embedding checkpoints such as all-MiniLM-L6-v2
  were trained to produce (their model card pools this way). transformers has no class for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from workflows.errors import UserError
from workflows.parallel import world
from workflows.preprocess.encoding import pad_batch
from workflows.tasks.model_spec import ModelSpec, spec_from_config

POOLING_KEY = "workflows_pooling"  # in the saved config.json: which class loads the artifact


class MeanPoolClassifier(nn.Module):
    """Encoder -> masked mean of the last hidden states -> L2 norm -> linear head x SCALE.

    On unit-length features the head's logits are scaled cosines; SCALE sets how sharp the softmax
    can get (as in cosine/normalized-softmax classifiers). It takes and returns what the Hugging Face
    classifier does (input_ids, attention_mask, labels -> .loss, .logits), so the training loop,
    FSDP/DDP, checkpoints, export and serving treat both alike.
    """

    SCALE = 20.0

    def __init__(self, encoder: nn.Module, num_labels: int):
        super().__init__()
        if getattr(encoder, "pooler", None) is not None:
            encoder.pooler = None  # unused here: parameters without gradients would stall DDP
        self.encoder = encoder
        self.config = encoder.config
        setattr(self.config, POOLING_KEY, "mean")  # saved with it: load_trained_classifier reads it
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if attention_mask is None:  # no padding: every position
            pooled = hidden.mean(1)
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        logits = self.classifier(F.normalize(pooled, dim=-1)) * self.SCALE
        loss = F.cross_entropy(logits.float(), labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def get_input_embeddings(self) -> nn.Module:
        return self.encoder.get_input_embeddings()

    def activation_checkpointing_enable(self, **kwargs) -> None:
        self.encoder.activation_checkpointing_enable(**kwargs)

    def save_pretrained(self, out_dir: str, safe_serialization: bool = True) -> None:
        """config.json (marked with the pooling) and model.safetensors, as Hugging Face lays them out."""
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError("only safetensors artifacts are written")
        os.makedirs(out_dir, exist_ok=True)
        self.config.save_pretrained(out_dir)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def head_logit_scale(model: nn.Module) -> float:
    """What the model multiplies its `classifier` head's output by to get the logits."""
    return MeanPoolClassifier.SCALE if isinstance(model, MeanPoolClassifier) else 1.0


def check_linear_head(model: nn.Module) -> nn.Linear:
    """The head that model.options.head_init=linear_probe fits: one linear layer named `classifier`."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Linear):
        raise UserError(
            "model.options.head_init=linear_probe needs a classifier whose head (`classifier`) is one linear layer; "
            f"{type(model).__name__} has {type(head).__name__}; use model.options.head_init=random or "
            "model.options.pooling=mean"
        )
    return head


def check_linear_probe_head(model_dir: str, labels: list[str], pooling: str) -> None:
    """Before any worker starts: the model that would be built has a head linear_probe can fit.
    The model is built on the meta device from its config: no weights are read."""
    if pooling == "mean":
        return  # MeanPoolClassifier's head is one linear layer
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        check_linear_head(AutoModelForSequenceClassification.from_config(classifier_config(model_dir, labels, None)))


def classifier_config(model_dir: str, labels: list[str], dropout: float | None):
    """The checkpoint's config with a head for `labels` and model.dropout applied (the planner sizes the same)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            model_dir,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={lab: i for i, lab in enumerate(labels)},
        )
    except (OSError, ValueError) as e:
        raise UserError(f"not a model directory: {model_dir} ({e})".splitlines()[0]) from None
    # what transformers' loss would infer (and write into the config) at its first call: set up front, a
    # compiled model's graph does not see the config change under it (a recompile)
    config.problem_type = "single_label_classification"
    if dropout is not None:
        for attr in ("hidden_dropout_prob", "classifier_dropout", "dropout"):
            if hasattr(config, attr):
                setattr(config, attr, dropout)
    return config


def load_classifier(model_dir: str, labels: list[str], dropout: float | None = None, pooling: str = "cls") -> nn.Module:
    """A pretrained encoder from `model_dir` with a new head for `labels` (pooling: "cls" or "mean")."""
    from transformers import AutoModel, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the "classifier newly initialized" report is expected here
    config = classifier_config(model_dir, labels, dropout)
    # safetensors weights only, never a pickle
    if pooling == "mean":
        return MeanPoolClassifier(
            AutoModel.from_pretrained(model_dir, config=config, use_safetensors=True), len(labels)
        )
    return AutoModelForSequenceClassification.from_pretrained(model_dir, config=config, use_safetensors=True)


def load_trained_classifier(model_dir: str) -> nn.Module:
    """A registered artifact (export.py wrote it) with its weights, whichever pooling it was trained with."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, POOLING_KEY, "cls") != "mean":
        # safetensors weights only: from_pretrained loads model.safetensors, never a pickle
        return AutoModelForSequenceClassification.from_pretrained(model_dir, config=config, use_safetensors=True)
    from safetensors.torch import load_file

    model = MeanPoolClassifier(AutoModel.from_config(config), config.num_labels)
    model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")), strict=True)
    return model


def collate(batch: dict[str, np.ndarray], pad_id: int = 0, width: int | None = None) -> dict[str, torch.Tensor]:
    """A batch of token id lists -> padded tensors: to the batch's longest row, or to `width` (a compiled
    model's one shape, train.compile). A mask without padding is left out (checked here, on the host):
    given one, the model would ask the device whether it is all ones, a host sync every forward."""
    ids, mask = pad_batch(list(batch["input_ids"]), pad_id, width)
    out = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(np.array(batch["label_id"], dtype=np.int64))}
    if not mask.all():
        out["attention_mask"] = torch.from_numpy(mask)
    return out


def classifier_spec(
    model_dir: str,
    *,
    num_labels: int = 2,
    dropout: float | None = None,
    freeze_embeddings: bool = False,
    name: str | None = None,
) -> ModelSpec:
    """The spec of the classifier `load_classifier(model_dir, ...)` would build, without its weights."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = classifier_config(model_dir, [f"LABEL_{i}" for i in range(num_labels)], dropout)
    return spec_from_config(config, name=name or model_dir, freeze_embeddings=freeze_embeddings)


LINEAR_PROBE_MAX_ROWS = 20_000  # all ranks together: plenty for a logistic regression on ~1k features


def linear_probe(model: nn.Module, batches: Iterable[dict], device: torch.device, l2: float) -> dict:
    """Fit the new linear head (`model.classifier`) on the frozen pretrained features: the first
    step of LP-FT (Kumar et al., 2022, "Fine-Tuning can Distort Pretrained Features").

    Every rank passes over its own rows (eval mode, no gradients) and keeps the head's inputs;
    the features of all ranks are gathered, and each rank fits the same multinomial logistic
    regression (full-batch L-BFGS, `l2` on the weights) on them; rank 0's result is broadcast so
    the ranks start fine-tuning from identical weights. Runs on the plain model, before FSDP/DDP
    wrap it. Solved with torch's L-BFGS rather than scikit-learn so the objective is the model's own
    (its logit scale, no penalty on the bias) and the result needs no translation back.
    """
    import torch.distributed as dist

    head = check_linear_head(model)
    t0 = time.perf_counter()
    rank, world_size = world()
    limit = -(-LINEAR_PROBE_MAX_ROWS // world_size)
    feats: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, inputs, _out: feats.append(inputs[0].detach().float().cpu()))
    labels, rows = [], 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:  # each rank on its own: no collective runs inside this pass
                if rows >= limit:
                    break
                model(**{k: v.to(device) for k, v in batch.items()})
                labels.append(batch["labels"].cpu())
                rows += batch["labels"].shape[0]
    finally:
        hook.remove()
    x = torch.cat(feats) if feats else torch.zeros(0, head.in_features)
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64)
    if world_size > 1:
        parts: list = [None] * world_size
        dist.all_gather_object(parts, (x, y))
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    if len(y) == 0:
        raise UserError("model.options.head_init=linear_probe: no training rows to fit the head on")
    scale = head_logit_scale(model)
    weight = head.weight.detach().float().cpu().clone().requires_grad_(True)
    bias = head.bias.detach().float().cpu().clone().requires_grad_(True)
    solver = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=500, history_size=20, line_search_fn="strong_wolfe")

    def objective():
        solver.zero_grad()
        loss = nn.functional.cross_entropy(scale * (x @ weight.T + bias), y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    solver.step(objective)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
        if world_size > 1:
            for p in (head.weight, head.bias):
                dist.broadcast(p.data, src=0)
        accuracy = float((scale * (x @ weight.T + bias)).argmax(-1).eq(y).float().mean())
    return {"rows": int(len(y)), "train_accuracy": accuracy, "seconds": round(time.perf_counter() - t0, 2)}
