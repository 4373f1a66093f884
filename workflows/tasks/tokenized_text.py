"""What the text tasks (the classifier and the causal LM) share: their data, tokenized text columns
on Ray Data (workflows.preprocess.materialize), versioned by the raw shards, the text settings and
the tokenizer's files."""

from __future__ import annotations

from workflows.preprocess.encoding import resolve_model_dir
from workflows.tasks.base import Task
from workflows.tasks.seams import DatasetSeam


class TokenizedTextDataset(DatasetSeam):
    def version(self, shards, ctx) -> str:
        from workflows.preprocess.materialize import dataset_version

        return dataset_version(shards, self.cfg, resolve_model_dir(self.cfg.preprocess.tokenizer))


class TokenizedText(Task):
    """A task that trains on `preprocess.tokenizer`'s token ids of the text columns."""

    Dataset = TokenizedTextDataset

    def preprocess(self, ctx, say):
        from workflows.preprocess.materialize import preprocess_text

        return preprocess_text(self.cfg, ctx, say)
