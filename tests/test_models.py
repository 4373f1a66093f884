"""The classifier's two poolings and the head's learning rate (a tiny BERT, no Ray)."""

from __future__ import annotations

import json

import pytest
import torch

from workflows.tasks.text.model import (
    POOLING_KEY,
    MeanPoolClassifier,
    check_linear_probe_head,
    load_classifier,
    load_trained_classifier,
)
from workflows.train.loop import make_optimizer

LABELS = ["a", "b", "c"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A 'pretrained' tiny BERT directory (random weights, with the pooler a real checkpoint has)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16)).save_pretrained(path)
    return str(path)


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 1])}


def test_mean_pooling_trains_every_parameter_and_ignores_padding(base_dir):
    model = load_classifier(base_dir, LABELS, dropout=0.0, pooling="mean")
    assert isinstance(model, MeanPoolClassifier) and model.encoder.pooler is None
    out = model(**batch())
    out.loss.backward()
    # DDP waits for a gradient of every parameter: none may be left out of the graph
    assert all(p.grad is not None for p in model.parameters())
    assert out.logits.shape == (4, len(LABELS))

    model.eval()
    b = batch()
    with torch.no_grad():
        ref = model(b["input_ids"][1:2, :6], b["attention_mask"][1:2, :6]).logits
        padded = model(b["input_ids"][1:2], b["attention_mask"][1:2]).logits  # 4 masked tokens more
    assert torch.allclose(ref, padded, atol=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_saved_artifact_reloads_with_its_pooling(base_dir, tmp_path, pooling):
    model = load_classifier(base_dir, LABELS, pooling=pooling).eval()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.get(POOLING_KEY, "cls") == pooling
    assert (tmp_path / "model.safetensors").exists()
    reloaded = load_trained_classifier(str(tmp_path)).eval()
    assert type(reloaded) is type(model)
    state = reloaded.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k
    b = batch()
    with torch.no_grad():
        assert torch.equal(model(b["input_ids"], b["attention_mask"]).logits,
                           reloaded(b["input_ids"], b["attention_mask"]).logits)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_head_lr_applies_to_the_new_head_only(base_dir, pooling):
    model = load_classifier(base_dir, LABELS, pooling=pooling)
    by_param = {
        id(p): g["lr"] for g in make_optimizer(model, 1e-4, 0.01, head_lr=1e-3).param_groups for p in g["params"]
    }
    for name, p in model.named_parameters():
        assert by_param[id(p)] == (1e-3 if name.startswith("classifier.") else 1e-4), name
    assert {g["lr"] for g in make_optimizer(model, 1e-4, 0.01).param_groups} == {1e-4}


def test_linear_probe_head_check_before_any_weights_are_read(base_dir, tmp_path):
    """head_init=linear_probe fits one linear layer: a head of another shape (RoBERTa's dense +
    out_proj) is a named error from the config alone, before training starts."""
    from transformers import RobertaConfig

    from workflows.errors import UserError

    check_linear_probe_head(base_dir, LABELS, "cls")  # BERT's head: one linear layer
    roberta = tmp_path / "tiny-roberta"
    RobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    ).save_pretrained(roberta)  # config only: no weights at all
    with pytest.raises(
        UserError, match=r"one linear layer; RobertaForSequenceClassification has RobertaClassificationHead"
    ):
        check_linear_probe_head(str(roberta), LABELS, "cls")
    check_linear_probe_head(str(roberta), LABELS, "mean")  # mean pooling brings its own linear head
