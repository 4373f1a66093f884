"""Text classification: a pretrained encoder (MiniLM by default) fine-tuned with a new head on
tokenized text columns (workflows/preprocess/encoding.py shares the encoding with serving).

The wing: this task and its training and serving seams; `model` (the classifier, its collate, its
size for the planner, the linear probe), `predictor` (serving, batch inference, evaluation),
`contract` (POST /predict's request and response models), `export` (the from_pretrained artifact).
Its data are the tokenized text the causal LM shares (workflows.tasks.tokenized_text)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workflows.preprocess.encoding import pad_and_vocab, resolve_model_dir
from workflows.tasks.classify import Classification, ClassificationServing, ClassificationTraining
from workflows.tasks.seams import held_out_rows
from workflows.tasks.text.contract import text_contract
from workflows.tasks.tokenized_text import TokenizedText


class TextOptions(BaseModel):
    """The classification task's `model.options`."""

    model_config = ConfigDict(extra="forbid")

    pooling: Literal["cls", "mean"] = Field(
        "cls", description="'cls' (the checkpoint's pooler on the first token, Hugging Face's classifier) or 'mean' "
        "(normalized mean of all tokens: how sentence-embedding checkpoints such as MiniLM were trained)")
    head_init: Literal["random", "linear_probe"] = Field(
        "random", description="the new head's start: 'random', or 'linear_probe' (LP-FT: the head is first fitted "
        "on the frozen pretrained features, a logistic regression over all workers' training rows, then everything "
        "is fine-tuned, so early steps do not pull the pretrained features toward a random head)")
    linear_probe_l2: float = Field(1e-3, ge=0, description="head_init=linear_probe: L2 penalty on the head's weights")
    head_lr: float | None = Field(
        None, gt=0, description="learning rate of the new head (random weights); None: train.lr")
    freeze_embeddings: bool = Field(
        False, description="keep the pretrained input embeddings fixed (half of MiniLM's weights): less compute "
        "and communication")


class TextTraining(ClassificationTraining):
    """The pretrained encoder: its head checked and, with head_init=linear_probe, fitted first;
    frozen embeddings; the head's own learning rate; the planner's spec."""

    def model_dir(self) -> str:
        return resolve_model_dir(self.cfg.model.name_or_path)

    def check(self, data) -> None:
        from workflows.tasks.text.model import check_linear_probe_head

        if self.options.head_init == "linear_probe":
            check_linear_probe_head(self.model_dir(), data.labels, self.options.pooling)

    def needs_probe_batches(self) -> bool:
        return self.options.head_init == "linear_probe"

    def prepare_model(self, model, device, probe_batches) -> None:
        from workflows.parallel import world
        from workflows.tasks.text.model import linear_probe

        if self.options.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
        if self.needs_probe_batches() and probe_batches is not None:
            probe = linear_probe(model.to(device), probe_batches, device, self.options.linear_probe_l2)
            if world()[0] == 0:
                print(f"linear probe: head fitted on {probe['rows']} rows (train accuracy "
                      f"{probe['train_accuracy']:.4f}) in {probe['seconds']:.1f}s", flush=True)

    def memory_spec(self):
        from workflows.tasks.text.model import classifier_spec

        m = self.cfg.model
        spec = classifier_spec(self.model_dir(), dropout=m.dropout, freeze_embeddings=self.options.freeze_embeddings,
                               name=m.name_or_path)
        return spec, self.cfg.preprocess.max_length

    def head_lr(self) -> float | None:
        return self.options.head_lr


class TextServing(ClassificationServing):
    """A from_pretrained artifact with its tokenizer, answering text instances."""

    def export(self, state, data, out_dir, lineage) -> dict:
        from workflows.tasks.text.export import export_text_classifier

        return export_text_classifier(self.cfg, state, data, out_dir, lineage, self.options,
                                      self.task.dataset.tokenizer_of(data))

    def predictor(self, model_dir, card, threads=None, precision="fp32"):
        from workflows.tasks.text.predictor import TextPredictor

        return TextPredictor(model_dir, threads, precision)

    def http_contract(self, card, max_instances):
        return text_contract(card, max_instances)

    def input_columns(self, card, available):
        return list(card.text_columns)

    def demo_instances(self, data, ctx, n):
        """The text of the first `n` held-out rows (test split), through the node's shard cache."""
        cache = self.cfg.cache.shard_cache(ctx) if self.cfg.cache.enabled else None
        rows = held_out_rows(data, ctx, data.text_columns, n, "test", cache)
        return [{c: str(v) for c, v in row.items()} for row in rows]


class TextClassification(TokenizedText, Classification):
    name = "classification"
    columns = ("input_ids", "label_id")
    Options = TextOptions
    Training = TextTraining
    Serving = TextServing

    def collate(self, data, *, train: bool, seed: int | None = None):
        from functools import partial

        from workflows.tasks.text.model import collate

        # a compiled model's training batches: one width, the dataset's max_length (train.compile)
        width = data.max_length if train and self.cfg.train.compiled else None
        return partial(collate, pad_id=pad_and_vocab(self.dataset.tokenizer_of(data))[0], width=width)

    def build_model(self, data):
        from workflows.tasks.text.model import load_classifier

        return load_classifier(resolve_model_dir(self.cfg.model.name_or_path), data.labels, self.cfg.model.dropout,
                               self.options.pooling)
