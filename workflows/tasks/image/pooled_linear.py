"""`model.name_or_path: pooled_linear`: a linear classifier over average-pooled pixels (each image
pooled to pool_size x pool_size x 3 and normalized, then one Linear). A real image model in
transformers' from_pretrained layout (registered with AutoConfig and AutoModelForImageClassification,
so it exports, registers, evaluates and serves as the others do), with almost no compute: a baseline
for a set, and the model under which training's images/s is the input pipeline's
(`workflows bench images`' training rows)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput

MODEL_TYPE = "workflows_pooled_linear"


class PooledLinearConfig(PretrainedConfig):  # transformers 5: the annotated fields are the config's
    model_type = MODEL_TYPE

    pool_size: int = 8
    num_channels: int = 3


class PooledLinearForImageClassification(PreTrainedModel):
    config_class = PooledLinearConfig
    base_model_prefix = "pooled_linear"
    main_input_name = "pixel_values"

    def __init__(self, config: PooledLinearConfig):
        super().__init__(config)
        features = config.num_channels * config.pool_size**2
        self.norm = nn.LayerNorm(features)  # each image's pooled pixels at unit scale, whatever its brightness
        self.classifier = nn.Linear(features, config.num_labels)
        self.post_init()  # PreTrainedModel's own init: Linear N(0, 0.02), zero bias; LayerNorm ones, zeros

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        pooled = nn.functional.adaptive_avg_pool2d(pixel_values, self.config.pool_size).flatten(1)
        logits = self.classifier(self.norm(pooled))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


def _register() -> None:
    try:
        AutoConfig.register(MODEL_TYPE, PooledLinearConfig)
        AutoModelForImageClassification.register(PooledLinearConfig, PooledLinearForImageClassification)
    except ValueError:  # already registered (a module reloaded)
        pass


_register()  # importing this module is what lets from_pretrained read a saved pooled_linear model
