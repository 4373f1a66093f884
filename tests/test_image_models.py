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

    from workflows.tasks.image_models import image_config

    cfg = _cfg(f"model.name_or_path={name}", "preprocess.image_size=224")
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(image_config(cfg, [str(i) for i in range(1000)]))
    assert sum(p.numel() for p in model.parameters()) == params


def test_the_small_cnn_trains_a_step_on_cpu():
    from workflows.tasks.image_models import build_image_classifier

    torch.manual_seed(0)
    model = build_image_classifier(_cfg(), [str(i) for i in range(10)])
    out = model(pixel_values=torch.randn(4, 3, 32, 32), labels=torch.tensor([0, 1, 2, 3]))
    out.loss.backward()
    assert out.logits.shape == (4, 10) and sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_fine_tuning_starts_from_the_saved_weights_with_a_head_for_new_labels(tmp_path, prefix):
    from workflows.tasks.image_models import build_image_classifier

    torch.manual_seed(0)
    trained = build_image_classifier(_cfg(), [str(i) for i in range(10)])
    trained.save_pretrained(tmp_path / "model", safe_serialization=True)
    torch.manual_seed(1)
    tuned = build_image_classifier(_cfg(f"model.name_or_path={prefix}{tmp_path / 'model'}"), ["cat", "dog", "fox"])
    before, after = trained.state_dict(), tuned.state_dict()
    body = [k for k in before if not k.startswith("classifier")]
    assert body and all(torch.equal(before[k], after[k]) for k in body)
    head = [k for k in after if k.startswith("classifier") and k.endswith("weight")]
    assert after[head[0]].shape[0] == 3 and tuned.config.id2label == {0: "cat", 1: "dog", 2: "fox"}


def test_an_unknown_architecture_is_a_clear_error(tmp_path):
    from workflows.errors import UserError
    from workflows.tasks.image_models import build_image_classifier

    with pytest.raises(UserError, match="not an architecture .*small_cnn.* nor a model directory"):
        build_image_classifier(_cfg(f"model.name_or_path={tmp_path / 'nothing'}"), ["a", "b"])
