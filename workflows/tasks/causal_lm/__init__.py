"""Causal-LM pretraining: a GPT-2-style model built from its options' size preset, trained on the
tokenized text packed into blocks of `model.options.seq_len` tokens. Its checkpoints stay with the
run: the registry and serving take the tasks that predict (registers = False).

The wing: this task with its dataset seam (rows packed into blocks) and training seam (the
planner's spec, MFU), `options` (its `model.options`: size preset, overrides, seq_len) and `model`
(the GPT-2 model, block packing, FLOPs and MFU). Its data are the tokenized text the text
classifier shares (workflows.tasks.tokenized_text)."""

from __future__ import annotations

import math

from workflows.preprocess.encoding import pad_and_vocab, resolve_model_dir
from workflows.tasks.causal_lm.model import (
    PACK_ROWS,
    build_causal_lm,
    causal_lm_config,
    lm_collate,
    mfu,
    model_shape,
    pack_batch,
)
from workflows.tasks.causal_lm.options import CausalLMOptions
from workflows.tasks.seams import TrainingSeam
from workflows.tasks.tokenized_text import TokenizedText, TokenizedTextDataset


class CausalLMDataset(TokenizedTextDataset):
    """Token rows packed into blocks of seq_len tokens (model.pack_batch per model.PACK_ROWS rows, in
    order), on Ray Data and in memory alike."""

    def prepare(self, ds):
        return ds.map_batches(pack_batch, fn_kwargs={"seq_len": self.options.seq_len}, batch_format="numpy",
                              batch_size=PACK_ROWS, num_cpus=0)

    def prepare_rows(self, rows):
        import numpy as np

        ids, seq_len = rows["input_ids"], self.options.seq_len
        parts = [pack_batch({"input_ids": ids[i: i + PACK_ROWS]}, seq_len)["input_ids"]
                 for i in range(0, len(ids), PACK_ROWS)]
        blocks = np.concatenate(parts) if parts else np.zeros((0, seq_len), np.int64)
        return {"input_ids": list(blocks), "label_id": np.zeros(len(blocks), np.int64)}


class CausalLMTraining(TrainingSeam):
    pad_label = -100  # the causal-LM loss ignores it

    def memory_spec(self):
        from transformers import AutoTokenizer

        from workflows.tasks.model_spec import spec_from_config

        lm, use_gpu = self.options, self.cfg.train.use_gpu
        vocab = len(AutoTokenizer.from_pretrained(resolve_model_dir(self.cfg.preprocess.tokenizer)))  # as the trainer
        # the trainer uses SDPA on GPUs, eager on CPU
        config = causal_lm_config(lm, vocab, self.cfg.model.dropout, attn="sdpa" if use_gpu else "eager")
        return spec_from_config(config, name=f"causal LM {lm.size} (GPT-2 style)", causal_lm=True), lm.seq_len

    def epoch_extras(self, model, stats, device) -> dict:
        """MFU of the epoch on GPU (none elsewhere: no meaningful peak)."""
        if device.type != "cuda":
            return {}
        from workflows.parallel import world

        params, layers, hidden = model_shape(model)
        return {"mfu": mfu(stats["tokens_per_s"], params, layers, hidden, self.options.seq_len, world()[1],
                           device)}


class CausalLM(TokenizedText):
    name = "causal_lm"
    columns = ("input_ids", "label_id")  # label_id only keeps the row count of in-memory rows
    registers = False
    score = ("val_loss", "min")
    Options = CausalLMOptions
    Dataset = CausalLMDataset
    Training = CausalLMTraining

    def collate(self, data, *, train: bool, seed: int | None = None):
        return lambda batch: lm_collate(batch["input_ids"])

    def build_model(self, data):
        return build_causal_lm(self.options, pad_and_vocab(self.dataset.tokenizer_of(data))[1], self.cfg.model.dropout)

    def metric_states(self, model, batch) -> dict:
        n = batch["input_ids"].shape[0]
        return {"loss": model(**batch).loss.detach() * n, "blocks": n}

    def compute_metrics(self, states, data) -> dict:
        """Mean next-token loss over all ranks (blocks are equally long, so a mean of block means)
        and its perplexity."""
        loss = states["loss"] / max(states["blocks"], 1)
        return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0))}
