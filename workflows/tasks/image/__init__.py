"""Image classification: labelled images -> stored uint8 tensors (workflows/preprocess/image_dataset.py)
-> a transformers vision classifier (workflows/tasks/image/models.py) trained with on-the-fly
augmentation -> served from JSON base64, a raw image body or multipart files.

One decode/resize path (workflows.preprocess.images.decode_image) serves preprocessing and serving;
one normalization (`normalize_pixels`, ImageNet's mean and std, recorded in the model card) serves
training and serving. Training batches stay uint8 until they are on the device (`model_input`).

The wing: this task; `models` (the architectures by name, `pooled_linear` among them) and
`contract` (the bodies POST /predict accepts). Decoding and the stored dataset are the data layer's
(workflows.preprocess.images, decoding and the loader's ImageTransform; image_dataset), which the benches and the
loaders share.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.config.base import Strict
from workflows.errors import UserError
from workflows.model_card import ModelCard, write_card
from workflows.preprocess.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_PIXELS,
    BadImage,
    ImageTransform,
    decode_image,
    normalize_pixels,
    random_resized_crop_flip,
    to_model_input,
)
from workflows.tasks.classify import (
    Classification,
    ClassificationServing,
    ClassificationTraining,
    add_predictions,
    prediction,
)
from workflows.tasks.contract import HttpContract
from workflows.tasks.image.contract import (
    EXAMPLE_REQUEST,
    RequestError,
    image_predict_models,
    over_pixel_budget,
    parse_image_request,
    with_image_request_body,
)
from workflows.tasks.image.models import build_image_classifier, image_config
from workflows.tasks.predictor import Predictor, serving_model
from workflows.tasks.seams import DatasetSeam, baseline, held_out_rows

IMAGE_MAX_BODY_BYTES = 16 << 20  # a few photos, base64 included


def stack_pixels(values, size: int):
    """Stored `pixels` (size*size*3 bytes each) -> a uint8 tensor [N, size, size, 3]."""
    import torch

    flat = np.frombuffer(b"".join(bytes(v) for v in values), dtype=np.uint8)
    return torch.from_numpy(flat.reshape(len(values), size, size, 3).copy())


def sample_seed(seed: int, key: str) -> int:
    """The augmentation seed of one sample in one epoch: the same crop however batches are formed,
    on whichever rank, after a resume."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") >> 1


class AugmentConfig(Strict):
    """On-the-fly augmentation of training images (`model.options.augment`), seeded per (seed, epoch,
    sample), never by rank, so a resumed epoch sees the same crops."""

    enabled: bool = True
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="RandomResizedCrop: the range of the crop's area as a fraction of the image")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="RandomResizedCrop: aspect ratio range")
    flip: bool = Field(True, description="horizontal flip with probability 0.5 (off for digits, text, ...)")

    @model_validator(mode="after")
    def _ranges(self):
        for name in ("crop_scale", "crop_ratio"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi or (name == "crop_scale" and hi > 1):
                raise ValueError(f"{name} must be 0 < low <= high{' <= 1' if name == 'crop_scale' else ''}")
        return self


class ImageOptions(BaseModel):
    """The image_classification task's `model.options`."""

    model_config = ConfigDict(extra="forbid")

    image_size: int = Field(
        224, ge=8, le=1024, description="the square side the model reads: preprocessing decodes, resizes (shorter "
        "side) and center-crops each image to it once and stores uint8 tensors (part of the dataset's version); "
        "raw training crops to it; serving decodes requests the same way")
    augment: AugmentConfig = Field(
        AugmentConfig(), description="on-the-fly augmentation of training images (RandomResizedCrop and flip)")
    image_input: Literal["raw", "pixels"] = Field(
        "pixels",
        description="train.loader=stream: 'raw' trains from the source's tar shards, parquet rows (image "
        "bytes in image_column) or image files (decode, "
        "RandomResizedCrop of the original image and flip in the loader's processes; val/test stay the "
        "preprocessed pixels), 'pixels' from the preprocessed fixed-size pixels (cropped in the collate; "
        "small images such as digits). docs/guides/train.md compares them",
    )
    image_column: str = Field(
        "image", description="parquet shards: the column of encoded image bytes (tar shards and "
        "class-per-folder files carry their images themselves)")


def model_input(model, batch: dict) -> dict:
    """The batch as the model reads it: uint8 pixels normalized here, after the batch moved to the
    device (in_step), so a GPU run copies a quarter of float32's bytes and its CPUs do no per-pixel
    work; before the model's forward, so FSDP's mixed precision casts the result as any input. A
    model that declares `takes_uint8_pixels` (pooled_linear) normalizes after its own pooling."""
    import torch

    from workflows.parallel import unwrap  # DDP wraps; FSDP2 keeps the class

    pixels = batch["pixel_values"]
    if pixels.dtype != torch.uint8 or getattr(unwrap(model), "takes_uint8_pixels", False):
        return batch
    return {**batch, "pixel_values": normalize_pixels(pixels)}


class ImageDataset(DatasetSeam):
    """The stored images' version (their size and source column enter it), and with
    model.options.image_input=raw a training source of the original images."""

    def version(self, shards, ctx) -> str:
        from workflows.preprocess.image_dataset import dataset_version
        from workflows.preprocess.sources import list_shards

        _, fmt = list_shards(self.cfg.data.source, ctx, self.cfg.data.format)
        return dataset_version(shards, fmt, self.cfg, self.options.image_size, self.options.image_column)

    def stream_source(self, data, storage):
        """model.options.image_input=raw: the training split's samples in the source's tar shards,
        parquet rows (image bytes in model.options.image_column) or image files (preprocess.
        image_dataset.train_sample_index), decoded and cropped from the original image in the
        loader's processes, seeded by (seed, epoch, sample)."""
        if self.options.image_input != "raw":
            return None
        from workflows.preprocess.image_dataset import train_sample_index

        aug, size = self.options.augment, int(data.info["image_size"])
        transform = ImageTransform(size=size, seed=self.cfg.train.seed, train=aug.enabled, scale=aug.crop_scale,
                                   ratio=aug.crop_ratio, flip=aug.flip,
                                   max_pixels=self.cfg.preprocess.max_image_pixels)
        return train_sample_index(self.cfg, data, storage, self.options.image_column), transform


class ImageTraining(ClassificationTraining):
    def loss(self, model, batch):
        return super().loss(model, model_input(model, batch))

    def check(self, data) -> None:
        size = self.options.image_size
        if int(data.info.get("image_size", 0)) != size:
            raise UserError(f"the dataset stores {data.info.get('image_size')}px images; model.options.image_size is "
                            f"{size}")
        image_config(self.cfg, data.labels, size)  # an unknown architecture or a missing directory fails here


class ImageServing(ClassificationServing):
    """A from_pretrained vision classifier answering JSON base64, raw or multipart images."""

    def export(self, state, data, out_dir, lineage) -> dict:
        from transformers import AutoModelForImageClassification

        size = int(data.info["image_size"])
        model = AutoModelForImageClassification.from_config(image_config(self.cfg, data.labels, size))
        model.load_state_dict(state, strict=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        return write_card(ModelCard(task=self.task.name, labels=data.labels, label_column="label",
                                    image_size=size, image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD),
                                    lineage=lineage, options=self.options.model_dump(mode="json"),
                                    **baseline(data)), out_dir)

    def predictor(self, model_dir, card, threads=None, precision="fp32"):
        return ImagePredictor(model_dir, card, threads, precision, self.cfg.preprocess.max_image_pixels)

    def http_contract(self, card, max_instances):
        return ImageContract(card, max_instances, self.cfg.preprocess.max_image_pixels,
                             self.cfg.serve.max_request_pixels)

    def input_columns(self, card, available):
        return ["pixels"] if "pixels" in available else ["image"]

    def demo_instances(self, data, ctx, n):
        """The first `n` held-out images, PNG-encoded from their stored tensors, as JSON instances."""
        import base64
        import io

        from PIL import Image

        cache = self.cfg.cache.shard_cache(ctx) if self.cfg.cache.enabled else None
        rows = held_out_rows(data, ctx, ["pixels", "key"], n, "test", cache)
        size = int(data.info["image_size"])
        out = []
        for row in rows:
            buf = io.BytesIO()
            Image.fromarray(stack_pixels([row["pixels"]], size)[0].numpy()).save(buf, format="PNG")
            out.append({"image": {"b64": base64.b64encode(buf.getvalue()).decode()}})
        return out

    def describe(self, instance) -> str:
        b64 = instance.get("image", {}).get("b64", "")
        return f"image ({len(b64) * 3 // 4:,} bytes)"


class ImageClassification(Classification):
    name = "image_classification"
    columns = ("pixels", "label", "key")
    Options = ImageOptions
    Dataset = ImageDataset
    Training = ImageTraining
    Serving = ImageServing

    def preprocess(self, ctx, say):
        from workflows.preprocess.image_dataset import preprocess_images

        return preprocess_images(self.cfg, self.options.image_size, self.options.image_column, ctx, say)

    def collate(self, data, *, train: bool, seed: int | None = None):
        """Stored pixels cropped here, each sample by sha256(seed, key) with `seed` the epoch's
        (workflows.seeds.augment_seed: never the rank's); or a loader's decoded batch as it is.
        `pixel_values` stay uint8 [N, 3, S, S]: `model_input` normalizes them on the device."""
        import torch

        size = int(data.info["image_size"])
        ids = {lab: i for i, lab in enumerate(data.labels)}
        aug = self.options.augment
        augment = train and aug.enabled

        def collate(batch: dict[str, Any]) -> dict:
            if "image" in batch:  # decoded, cropped and labelled by the loader's processes (stream_source)
                return {"pixel_values": batch["image"], "labels": batch["label"]}
            pixels = stack_pixels(batch["pixels"], size)
            if augment:
                pixels = torch.cat([
                    random_resized_crop_flip(pixels[i: i + 1],
                                             torch.Generator().manual_seed(sample_seed(seed or 0, str(key))),
                                             aug.crop_scale, aug.crop_ratio, aug.flip)
                    for i, key in enumerate(batch["key"])])
            labels = torch.tensor([ids[str(lab)] for lab in batch["label"]], dtype=torch.int64)
            return {"pixel_values": pixels.permute(0, 3, 1, 2), "labels": labels}  # a channels_last view

        return collate

    def build_model(self, data):
        return build_image_classifier(self.cfg, data.labels, int(data.info["image_size"]))

    # every call of the model in training, validation and evaluate reads the batch through `model_input`
    def metric_states(self, model, batch):
        return super().metric_states(model, model_input(model, batch))

    def predict_batch(self, model, batch, data):
        return super().predict_batch(model, model_input(model, batch), data)


class ImagePredictor(Predictor):
    """A registered image classifier loaded once: encoded images (or stored tensors) in, labels and
    probabilities out."""

    def __init__(self, model_dir: str, card, threads: int | None = None, precision: str = "fp32",
                 max_pixels: int | None = None):
        import torch
        from transformers import AutoModelForImageClassification

        import workflows.tasks.image.pooled_linear  # noqa: F401 (a registered pooled_linear model loads by its type)

        self.card, self.labels = card, list(card.labels)
        if card.image_size is None:
            raise ValueError(f"{model_dir}/workflows.json has no image_size: not a servable image model")
        self.size = int(card.image_size)
        self.mean, self.std = tuple(card.image_mean or ()), tuple(card.image_std or ())
        self.max_pixels = max_pixels or MAX_PIXELS
        self.input_columns = ["image"]
        model = AutoModelForImageClassification.from_pretrained(model_dir, use_safetensors=True).eval()
        self.precision = precision
        # int8: the Linear layers only, convolutions keep fp32 (no dynamic int8 conv kernels)
        self.model, self.device = serving_model(model, precision, threads)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def tensor(self, images: list[bytes]):
        """Encoded images -> the uint8 tensor [N, size, size, 3] the model reads (as stored in training)."""
        import torch

        arrays = [decode_image(bytes(b), self.size, self.max_pixels) for b in images]
        return torch.from_numpy(np.stack(arrays)) if arrays else torch.zeros((0, self.size, self.size, 3),
                                                                             dtype=torch.uint8)

    def probabilities(self, pixels, batch_size: int = 64) -> np.ndarray:
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(pixels), batch_size):
                # moved as uint8, normalized on the device (a quarter of float32's bytes to a GPU)
                x = to_model_input(pixels[i: i + batch_size].to(self.device), self.mean, self.std)
                logits = self.model(pixel_values=x.to(self.dtype)).logits
                out.append(torch.softmax(logits.float(), dim=-1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, len(self.labels)), dtype=np.float32)

    def predict(self, instances) -> list[dict]:
        """Instances as ImageContract.parse returns them: each holds its decoded `pixels`."""
        import torch

        pixels = torch.from_numpy(np.stack([inst["pixels"] for inst in instances]))
        return [prediction(self.labels, p) for p in self.probabilities(pixels)]

    def predict_frame(self, batch):
        """A batch of stored rows (`pixels`) or raw ones (encoded `image` bytes): the tensors are
        dropped from the output, `prediction` and `score` added."""
        if "pixels" in batch.columns:
            pixels = stack_pixels(list(batch["pixels"]), self.size)
        else:
            try:
                pixels = self.tensor(list(batch["image"]))
            except BadImage as e:
                raise UserError(f"an image in the data cannot be decoded: {e}") from None
        out = batch.drop(columns=[c for c in ("pixels", "image") if c in batch.columns])
        return add_predictions(out, self.labels, self.probabilities(pixels))


class ImageContract(HttpContract):
    """POST /predict for images: JSON {"instances": [{"image": {"b64": ...}}]}, a raw image body, or
    multipart files (workflows.tasks.image.contract); every image decoded here, so a bad one is a
    422 for its request alone, before any batch. Decoding is heavy (0.3 s for a 40 Mpx PNG): the
    replica runs parse off its event loop (`off_loop`), and a request's images may declare at most
    `max_request_pixels` in all, checked from their headers before any is decoded."""

    errors = (400, 401, 413, 415, 422, 431, 503)
    off_loop = True  # workflows.serve.app runs parse in its decode threads
    max_body_bytes = IMAGE_MAX_BODY_BYTES

    def __init__(self, card, max_instances: int, max_pixels: int, max_request_pixels: int | None = None):
        self.card, self.max_instances, self.max_pixels = card, max_instances, max_pixels
        self.max_request_pixels = max_request_pixels
        self.request_model, self.response_model = image_predict_models(card, max_instances)

    def parse(self, content_type, body):
        images = parse_image_request(content_type, body, self.max_instances, self.max_body_bytes)
        if isinstance(images, RequestError):
            return images.status, images.message
        if self.max_request_pixels and (over := over_pixel_budget(images, self.max_request_pixels)):
            return over.status, over.message
        instances = []
        for i, data in enumerate(images):
            try:
                instances.append({"pixels": decode_image(data, int(self.card.image_size), self.max_pixels)})
            except BadImage as e:
                return 422, f"instances[{i}]: {e}"
        return instances

    def openapi(self, document, path):
        return with_image_request_body(document, path, self.request_model, max_body_bytes=self.max_body_bytes,
                                       max_request_pixels=self.max_request_pixels)

    def example(self) -> dict:
        return EXAMPLE_REQUEST
