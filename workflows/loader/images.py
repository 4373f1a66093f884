"""The image transform the loader's decode processes apply per sample (the bench's preset; training
with train.image_input=raw sets its size and augmentation from the config)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workflows.seeds import derived_seed


@dataclass(frozen=True)
class ImageTransform:
    """Encoded bytes -> uint8 [3, size, size]: RandomResizedCrop + horizontal flip when `train`
    (drawn from a generator seeded by (seed, epoch, sample id), so a resumed epoch, on any number
    of workers, sees the same crops), else the center square (as serving decodes it)."""

    size: int = 224
    seed: int = 0
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    max_pixels: int | None = None  # None: preprocess.images.MAX_PIXELS

    def __call__(self, data: bytes, sample: int, epoch: int) -> np.ndarray:
        import torch

        from workflows.preprocess.images import MAX_PIXELS, decode_image, decode_random_resized_crop

        limit = self.max_pixels or MAX_PIXELS
        if self.train:
            gen = torch.Generator().manual_seed(derived_seed("crop", self.seed, epoch, sample))
            hwc = decode_random_resized_crop(data, self.size, gen, self.scale, self.ratio, self.flip, limit)
        else:
            hwc = decode_image(data, self.size, limit)
        return hwc.transpose(2, 0, 1)
