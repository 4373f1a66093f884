"""Image models by name (transformers' vision classes, no torchvision) and fine-tuning from a
from_pretrained directory with a new head for other labels."""

import pytest
import torch

from tests.conftest import DIGITS


def _cfg(*overrides: str):
    from workflows.config import load_config

    return load_config(DIGITS, list(overrides))


@pytest.mark.parametrize("name, params", [
    ("resnet18", 11_693_736), ("resnet50", 25_557_032), ("vit_small", 22_050_664), ("convnext_tiny", 28_589_128),
])
def test_architectures_by_name_have_their_reference_sizes(name, params):
    """ImageNet-1k heads: the sizes of the reference models (ResNet-50 25.56M, ViT-S/16 22.05M, ...)."""
    from transformers import AutoModelForImageClassification

    from workflows.tasks.image.models import image_config

    cfg = _cfg(f"model.name_or_path={name}")
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(image_config(cfg, [str(i) for i in range(1000)], 224))
    assert sum(p.numel() for p in model.parameters()) == params


def test_the_small_cnn_trains_a_step_on_cpu():
    from workflows.tasks.image.models import build_image_classifier

    torch.manual_seed(0)
    model = build_image_classifier(_cfg(), [str(i) for i in range(10)], 32)
    out = model(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.tensor([0, 1, 2, 3]))
    out.loss.backward()
    assert out.logits.shape == (4, 10) and sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_fine_tuning_starts_from_the_saved_weights_with_a_head_for_new_labels(tmp_path, prefix):
    from workflows.tasks.image.models import build_image_classifier

    torch.manual_seed(0)
    trained = build_image_classifier(_cfg(), [str(i) for i in range(10)], 32)
    trained.save_pretrained(tmp_path / "model", safe_serialization=True)
    torch.manual_seed(1)
    tuned = build_image_classifier(_cfg(f"model.name_or_path={prefix}{tmp_path / 'model'}"), ["cat", "dog", "fox"], 32)
    before, after = trained.state_dict(), tuned.state_dict()
    body = [k for k in before if not k.startswith("classifier")]
    assert body and all(torch.equal(before[k], after[k]) for k in body)
    head = [k for k in after if k.startswith("classifier") and k.endswith("weight")]
    assert after[head[0]].shape[0] == 3 and tuned.config.id2label == {0: "cat", 1: "dog", 2: "fox"}


def test_an_unknown_architecture_is_a_clear_error(tmp_path):
    from workflows.errors import UserError
    from workflows.tasks.image.models import build_image_classifier

    with pytest.raises(UserError, match="not an architecture .*small_cnn.* nor a model directory"):
        build_image_classifier(_cfg(f"model.name_or_path={tmp_path / 'nothing'}"), ["a", "b"], 32)


def test_pooled_linear_trains_saves_and_serves_from_a_fresh_process(tmp_path):
    """`pooled_linear`: a linear classifier over 8x8 pooled pixels (a few hundred weights per class), trained a
    step, saved in from_pretrained layout, and loaded by the serving predictor in a process that never named it
    (its transformers registration comes with the predictor)."""
    import subprocess
    import sys

    from workflows.tasks.image.models import build_image_classifier

    torch.manual_seed(0)
    model = build_image_classifier(_cfg("model.name_or_path=pooled_linear"), ["cat", "dog", "fox"], 224)
    assert sum(p.numel() for p in model.parameters()) == 3 * 64 * 2 + (3 * 64 + 1) * 3
    x, y = torch.rand(4, 3, 224, 224), torch.tensor([0, 1, 2, 0])
    out = model(pixel_values=x, labels=y)
    out.loss.backward()
    assert out.logits.shape == (4, 3) and model.classifier.weight.grad is not None
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    code = f"""
import types, torch
from workflows.tasks.image import ImagePredictor
card = types.SimpleNamespace(labels=["cat", "dog", "fox"], image_size=224, image_mean=[0.485, 0.456, 0.406],
                             image_std=[0.229, 0.224, 0.225])
p = ImagePredictor({str(tmp_path / "model")!r}, card)
print(type(p.model).__name__, p.probabilities(torch.zeros((2, 224, 224, 3), dtype=torch.uint8)).shape)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["PooledLinearForImageClassification", "(2,", "3)"]


@pytest.mark.parametrize("name", ["small_cnn", "pooled_linear"])
def test_uint8_batches_are_normalized_on_the_device_as_the_model_reads_them(name):
    """Training batches stay uint8 to the device (a quarter of float32's bytes); the task normalizes them
    before every call of the model (loss, validation, evaluate), or pooled_linear pools first and
    normalizes after: the same loss, metrics and predictions as the normalized float pixels give."""
    from types import SimpleNamespace

    import numpy as np

    from workflows.preprocess.images import normalize_pixels, to_model_input
    from workflows.tasks import get_task
    from workflows.tasks.image import model_input

    cfg = _cfg(f"model.name_or_path={name}", "tracking.enabled=false")
    task = get_task(cfg)
    data = SimpleNamespace(info={"image_size": 32}, labels=["0", "1", "2"], label_column="label")
    torch.manual_seed(0)
    model = task.build_model(data).eval()
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (6, 3, 32, 32), dtype=np.uint8))
    batch = task.collate(data, train=False)({"image": images, "label": torch.tensor([0, 1, 2, 0, 1, 2])})
    assert batch["pixel_values"].dtype == torch.uint8  # what crosses to the device
    floats = {**batch, "pixel_values": to_model_input(images.permute(0, 2, 3, 1))}
    assert torch.equal(model_input(model, batch)["pixel_values"] if name == "small_cnn"
                       else normalize_pixels(images), floats["pixel_values"])
    with torch.no_grad():
        assert task.training.loss(model, batch).item() == pytest.approx(model(**floats).loss.item(), abs=1e-5)
        states, reference = task.metric_states(model, batch), task.metric_states(model, floats)
    assert all(np.allclose(np.asarray(states[k]), np.asarray(reference[k])) for k in reference)
