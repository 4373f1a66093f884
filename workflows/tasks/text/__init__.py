"""Text classification: a pretrained encoder (MiniLM by default) fine-tuned with a new head on
tokenized text columns (workflows/preprocess/encoding.py shares the encoding with serving).

The wing: this task; `predictor` (serving, batch inference, evaluation), `contract` (POST /predict's
request and response models), `export` (the from_pretrained artifact). Its preprocessing is
workflows.preprocess.materialize's text tokenization on Ray Data, which the causal LM shares, and its
model the transformers classifier of workflows.train.models, which the training engine's linear probe
and memory planner read too."""

from __future__ import annotations

from workflows.tasks.classify import Classification


class TextClassification(Classification):
    name = "classification"
    columns = ("input_ids", "label_id")

    # --- data
    def preprocess(self, ctx, say):
        from workflows.preprocess.materialize import preprocess_text

        return preprocess_text(self.cfg, ctx, say)

    def dataset_version(self, shards, ctx) -> str:
        from workflows.preprocess.encoding import resolve_model_dir
        from workflows.preprocess.materialize import dataset_version

        return dataset_version(shards, self.cfg, resolve_model_dir(self.cfg.preprocess.tokenizer))

    def record_encoder(self, data):
        from workflows.preprocess.encoding import resolve_model_dir
        from workflows.preprocess.materialize import Tokenize, _clean, tokenize_args

        d = self.cfg.data
        tokenize = Tokenize(*tokenize_args(self.cfg, resolve_model_dir(self.cfg.preprocess.tokenizer), data.labels))
        return lambda batch: tokenize(_clean(batch, d.text_columns, d.label_column, None, d.split_seed))

    def collate(self, data, *, train: bool, seed: int | None = None):
        from functools import partial

        from workflows.train.loop import collate
        from workflows.train.worker_setup import pad_and_vocab

        return partial(collate, pad_id=pad_and_vocab(data.tokenizer)[0])

    # --- model
    def model_dir(self) -> str:
        from workflows.preprocess.encoding import resolve_model_dir

        return resolve_model_dir(self.cfg.model.name_or_path)

    def check(self, data) -> None:
        from workflows.train.models import check_linear_probe_head

        if self.cfg.train.head_init == "linear_probe":
            check_linear_probe_head(self.model_dir(), data.labels, self.cfg.model.pooling)

    def build_model(self, data):
        from workflows.train.models import load_classifier

        m = self.cfg.model
        return load_classifier(self.model_dir(), data.labels, m.dropout, m.pooling)

    def prepare_model(self, model, device, probe_batches) -> None:
        from workflows.train.loop import linear_probe
        from workflows.train.parallel import world

        tc = self.cfg.train
        if tc.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
        if tc.head_init == "linear_probe" and probe_batches is not None:
            probe = linear_probe(model.to(device), probe_batches, device, tc.linear_probe_l2)
            if world()[0] == 0:
                print(f"linear probe: head fitted on {probe['rows']} rows (train accuracy "
                      f"{probe['train_accuracy']:.4f}) in {probe['seconds']:.1f}s", flush=True)

    def memory_spec(self):
        from workflows.train.model_spec import model_spec

        m = self.cfg.model
        spec = model_spec(self.model_dir(), dropout=m.dropout, freeze_embeddings=self.cfg.train.freeze_embeddings,
                          name=m.name_or_path)
        return spec, self.cfg.preprocess.max_length

    def head_lr(self) -> float | None:
        return self.cfg.train.head_lr

    def export(self, state, data, out_dir, lineage) -> dict:
        from workflows.tasks.text.export import export_text_classifier

        return export_text_classifier(self.cfg, state, data, out_dir, lineage)

    # --- serving
    def predictor(self, model_dir, card, threads=None, precision="fp32"):
        from workflows.tasks.text.predictor import TextPredictor

        return TextPredictor(model_dir, threads, precision)

    def http_contract(self, card, max_instances):
        from workflows.tasks.text.contract import text_contract

        return text_contract(card, max_instances)

    def input_columns(self, card, available):
        return list(card.text_columns)

    def demo_instances(self, data, ctx, n):
        """The text of the first `n` held-out rows, read straight from the split's first file
        (through the node's shard cache): a few rows need no Ray Data job."""
        from workflows.storage.shards import read_parquet

        files = data.files.get("test") or []
        if n <= 0 or not files:
            return []
        cache = self.cfg.cache.shard_cache(ctx) if self.cfg.cache.enabled else None
        table = read_parquet(files[0], ctx, data.text_columns, cache)
        return [{c: str(v) for c, v in row.items()} for row in table.slice(0, n).to_pylist()]
