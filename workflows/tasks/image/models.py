"""Image classifiers from transformers' vision classes (no torchvision, no timm: neither imports with
this CPU torch; transformers builds ResNet, ViT and ConvNeXt by itself).

`model.name_or_path` is an architecture by name (new weights, seeded by the caller) or a directory
/ object-store URI in `from_pretrained` layout (config.json + model.safetensors), whose weights are
fine-tuned with a new head for the dataset's labels: a registered image model is such a directory.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from workflows.errors import UserError
from workflows.storage.model_dir import fetch_model_dir


def _resnet(depths, hidden, layer_type, embedding=64, downsample_first=True):
    from transformers import ResNetConfig

    return ResNetConfig(depths=depths, hidden_sizes=hidden, layer_type=layer_type, embedding_size=embedding,
                        downsample_in_first_stage=downsample_first)


def _vit_small(image_size: int):
    from transformers import ViTConfig

    patch = 16 if image_size >= 64 else 4
    return ViTConfig(image_size=image_size, patch_size=patch, hidden_size=384, num_hidden_layers=12,
                     num_attention_heads=6, intermediate_size=1536)


def _pooled_linear(image_size: int):
    from workflows.tasks.image.pooled_linear import PooledLinearConfig

    return PooledLinearConfig(pool_size=min(8, image_size))


def _convnext_tiny(image_size: int):
    from transformers import ConvNextConfig

    return ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768])


ARCHITECTURES: dict[str, Callable[[int], object]] = {
    # a ResNet small enough for a 2-core CPU: 3 basic stages of 32/64/128 channels, ~0.3M parameters
    "small_cnn": lambda size: _resnet([1, 1, 1], [32, 64, 128], "basic", embedding=32, downsample_first=False),
    "resnet18": lambda size: _resnet([2, 2, 2, 2], [64, 128, 256, 512], "basic"),
    "resnet50": lambda size: _resnet([3, 4, 6, 3], [256, 512, 1024, 2048], "bottleneck"),
    "vit_small": _vit_small,
    "convnext_tiny": _convnext_tiny,
    # a linear classifier over 8x8 average-pooled pixels: a baseline, and a model that leaves training's
    # images/s to the input pipeline (bench images' training rows)
    "pooled_linear": _pooled_linear,
}


def _with_labels(config, labels: list[str]):
    config.num_labels = len(labels)
    # what transformers' loss would infer (and write into the config) at its first call: set up front, a
    # compiled model's graph does not see the config change under it (a recompile)
    config.problem_type = "single_label_classification"
    config.id2label = dict(enumerate(labels))
    config.label2id = {lab: i for i, lab in enumerate(labels)}
    return config


def local_model_dir(name_or_path: str, cfg) -> str:
    """A from_pretrained directory on this node: a local path as it is, an object-store URI
    downloaded once into the node's model cache (workflows.storage.model_dir)."""
    from workflows.storage.uri import protocol_of

    if protocol_of(name_or_path) in ("", "file") and not os.path.isfile(
            os.path.join(os.path.expanduser(name_or_path.removeprefix("file://")), "config.json")):
        raise UserError(f"model.name_or_path {name_or_path!r}: not an architecture "
                        f"({', '.join(ARCHITECTURES)}) nor a model directory (no config.json)")
    return fetch_model_dir(name_or_path, cfg)


def image_config(cfg, labels: list[str], image_size: int):
    """The model's transformers config with a head for `labels`, reading `image_size` px (no
    weights read)."""
    from transformers import AutoConfig

    import workflows.tasks.image.pooled_linear  # noqa: F401 (registers its config: a saved one reads back by name)

    name, size = cfg.model.name_or_path, image_size
    if name in ARCHITECTURES:
        return _with_labels(ARCHITECTURES[name](size), labels)
    return _with_labels(AutoConfig.from_pretrained(local_model_dir(name, cfg)), labels)


def build_image_classifier(cfg, labels: list[str], image_size: int):
    """The model to train: a named architecture with new weights, or a pretrained one with a new
    head (safetensors weights only)."""
    from transformers import AutoModelForImageClassification
    from transformers.utils import logging as hf_logging

    name = cfg.model.name_or_path
    if name in ARCHITECTURES:
        return AutoModelForImageClassification.from_config(image_config(cfg, labels, image_size))
    hf_logging.set_verbosity_error()  # "newly initialized head" is what fine-tuning on new labels means
    directory = local_model_dir(name, cfg)
    return AutoModelForImageClassification.from_pretrained(
        directory, config=image_config(cfg, labels, image_size), ignore_mismatched_sizes=True, use_safetensors=True)
