"""`model.name_or_path: pooled_linear`: a linear classifier over average-pooled pixels (each image
pooled to pool_size x pool_size x 3 from an evenly spaced grid of at most 4 x 4 pixels per cell,
and normalized, then one Linear). A real image model in
transformers' from_pretrained layout (registered with AutoConfig and AutoModelForImageClassification,
so it exports, registers, evaluates and serves as the others do), with almost no compute: a baseline
for a set, and the model under which training's images/s is the input pipeline's
(`python -m benchmarks.images`' training rows)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput

from workflows.preprocess.images import normalize_pixels

MODEL_TYPE = "workflows_pooled_linear"


class PooledLinearConfig(PretrainedConfig):  # transformers 5: the annotated fields are the config's
    model_type = MODEL_TYPE

    pool_size: int = 8
    num_channels: int = 3


class PooledLinearForImageClassification(PreTrainedModel):
    config_class = PooledLinearConfig
    base_model_prefix = "pooled_linear"
    main_input_name = "pixel_values"
    # Training hands it uint8 pixels (ImageClassification.model_input): it pools them first and
    # normalizes the few pooled values, which equals pooling normalized pixels (an affine map per
    # channel commutes with averaging), so the trainer does no per-pixel float work: next to no compute.
    takes_uint8_pixels = True

    def __init__(self, config: PooledLinearConfig):
        super().__init__(config)
        features = config.num_channels * config.pool_size**2
        self.norm = nn.LayerNorm(features)  # each image's pooled pixels at unit scale, whatever its brightness
        self.classifier = nn.Linear(features, config.num_labels)
        self.post_init()  # PreTrainedModel's own init: Linear N(0, 0.02), zero bias; LayerNorm ones, zeros

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        pool = self.config.pool_size
        step = max(1, min(pixel_values.shape[-2:]) // (4 * pool))  # a grid of up to 4 x 4 pixels per cell
        x = pixel_values[..., ::step, ::step]
        if x.dtype == torch.uint8:  # raw pixels (training): pool, then normalize (see takes_uint8_pixels)
            pooled = normalize_pixels(nn.functional.adaptive_avg_pool2d(x.float(), pool))
        else:  # normalized pixels (the serving predictor)
            pooled = nn.functional.adaptive_avg_pool2d(x, pool)
        logits = self.classifier(self.norm(pooled.flatten(1).to(self.classifier.weight.dtype)))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def _register() -> None:
    try:
        AutoConfig.register(MODEL_TYPE, PooledLinearConfig)
        AutoModelForImageClassification.register(PooledLinearConfig, PooledLinearForImageClassification)
    except ValueError:  # already registered (a module reloaded)
        pass


_register()  # importing this module is what lets from_pretrained read a saved pooled_linear model
