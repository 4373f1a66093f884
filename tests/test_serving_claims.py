"""What the docs claim about serving, held against the model and data the shared tiny pipeline
(`quickstart_run`) registered and materialized: the serving predictor feeds the model a raw row as
the training shard's input_ids, and int8 serving quantizes the Linear layers and stays close to fp32."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pytest
import torch

from tests.conftest import QUICKSTART

pytestmark = pytest.mark.integration

# int8 dynamic quantization against fp32, per class probability (docs/guides/serve.md); the
# largest difference seen on the tiny model's held-out rows was 0.004
INT8_PROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def registered(quickstart_run):
    """The registered model's local dir and card, the raw rows, and the processed train and test
    splits, read from the shared run's store."""
    from workflows import registry
    from workflows.config import load_config
    from workflows.dataset import ProcessedDataset
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.shards import read_parquet
    from workflows.storage.uri import StorageContext, filesystem
    from workflows.train.standalone import column_values

    cfg = load_config(QUICKSTART, quickstart_run.overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        model_dir, card = registry.fetch(cfg, ctx, "quickstart:1")
        data = ProcessedDataset.load(card.lineage["dataset_uri"], ctx)

        def frame(uris):  # the token ids as training reads them (standalone.read_rows)
            table = pa.concat_tables([read_parquet(u, ctx, ["text", "input_ids"]) for u in uris])
            return pd.DataFrame({"text": table.column("text").to_pylist(),
                                 "input_ids": [ids.tolist() for ids in column_values(table.column("input_ids"))]})

        fs, path = filesystem(cfg.data.source, ctx)
        raw = [json.loads(line) for f in sorted(fs.glob(f"{path}/*.jsonl")) for line in fs.cat(f).decode().splitlines()]
        return model_dir, card, raw, frame(data.files["train"]), frame(data.files["test"])


def fed_to_the_model(predictor, columns: dict, batch_size: int) -> list[list[int]]:
    """The token ids `probabilities` hands the model's forward, caught there (a forward pre-hook), each
    row cut to its attention mask: what the model sees, not what a parallel encoder would say."""
    seen = []

    def hook(_module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        seen.extend(row[m.bool()].tolist() for row, m in zip(ids, mask))

    handle = predictor.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        predictor.probabilities(columns, batch_size=batch_size)
    finally:
        handle.remove()
    return seen


def test_serving_feeds_the_model_a_raw_row_as_the_training_shards_input_ids(registered):
    from workflows.tasks.text.predictor import TextPredictor

    model_dir, card, raw, train, _ = registered
    by_text = {row["text"]: row for row in raw}
    rows = [by_text[t] for t in train["text"][:64]]  # the raw rows behind these training rows
    predictor = TextPredictor(model_dir)
    trained = list(train["input_ids"][:64])
    # batches of 16: padding to each batch's longest row must not change a row's ids
    assert fed_to_the_model(predictor, {"text": [r["text"] for r in rows]}, batch_size=16) == trained
    # truncation is part of what must agree: some of these rows reach the model's max_length
    assert any(len(ids) == card.max_length for ids in trained) and card.max_length == 32


@pytest.mark.extended  # an accuracy claim: int8's predictions against fp32's
def test_int8_serving_quantizes_linear_layers_and_stays_near_fp32(registered):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    from workflows.tasks.text.predictor import TextPredictor

    model_dir, card, _, _, test = registered
    fp32, int8 = TextPredictor(model_dir), TextPredictor(model_dir, precision="int8")
    quantized = [m for m in int8.model.modules() if isinstance(m, DynamicQuantizedLinear)]
    float_linear = [m for m in int8.model.modules() if type(m) is torch.nn.Linear]
    assert len(quantized) >= 6 * 6 and not float_linear  # MiniLM: 6 layers x 6 Linear, plus pooler and head
    assert not [m for m in fp32.model.modules() if isinstance(m, DynamicQuantizedLinear)]
    columns = {"text": list(test["text"])}
    p32, p8 = fp32.probabilities(columns), int8.probabilities(columns)
    assert p8.shape == p32.shape == (len(test), len(card.labels))
    assert abs(p8 - p32).max() <= INT8_PROB_TOLERANCE, abs(p8 - p32).max()
