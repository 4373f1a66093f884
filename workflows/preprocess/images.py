"""Image decoding and augmentation, shared by preprocessing (Ray Data actors) and serving, so a model
sees the same pixels for the same bytes in training and in production.

    decode_image(bytes, size)              encoded bytes -> uint8 [size, size, 3] RGB (or BadImage)
    decode_random_resized_crop(bytes, size, gen)  the same, a random crop + flip drawn at decode time
    random_resized_crop_flip(u8, gen)      training augmentation on a uint8 [N, H, W, 3] batch
    to_model_input(u8)                     uint8 [N, H, W, 3] -> normalized float32 [N, 3, H, W]
    normalize_pixels(u8)                   uint8 [N, 3, H, W] -> the same, on the tensor's own device
    ImageTransform(size, seed, train)      the per-sample transform of the loader's decode processes
                                           (model.options.image_input=raw): bytes -> uint8 [3, size, size]

Decoding: Pillow; the declared size is checked against an explicit pixel limit before any pixel is
decoded; JPEGs much larger than `size` are decoded at 1/2, 1/4 or 1/8 scale by libjpeg (`draft`);
EXIF orientation is applied; the shorter side is resized to `size` with BILINEAR (Pillow's resize is
antialiased when it shrinks; `reducing_gap` first box-reduces big factors, which is faster and
nearly identical) and the center square is kept. BILINEAR is torchvision's default for ResNet-style
recipes; whatever the choice, training and serving use this one function, so they agree.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import warnings
from dataclasses import dataclass

import numpy as np

from workflows.seeds import derived_seed

log = logging.getLogger(__name__)

# Pillow's own default (Image.MAX_IMAGE_PIXELS): ~89.5 Mpx, i.e. 256 MiB as RGB. A JPEG that large
# is drafted down cheaply; a PNG/WebP is decoded whole, so this bounds one decode's memory.
MAX_PIXELS = 89_478_485
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
REDUCING_GAP = 3.0


class BadImage(ValueError):
    """Bytes that do not decode to an image; the message is a one-line reason."""


def _pillow_bomb(e: Exception) -> BadImage:
    """Pillow refused the size itself (in Image.open, before we see it): say so in our terms."""
    m = re.search(r"\((\d+) pixels\) exceeds limit of (\d+)", str(e))
    if m:
        return BadImage(f"decompression bomb: {m.group(1)} pixels exceeds the limit of {m.group(2)} (Pillow's)")
    return BadImage(f"decompression bomb: {e}")


@contextlib.contextmanager
def _bad_image_errors():
    """Whatever Pillow raises on hostile bytes, as a BadImage with a one-line reason."""
    from PIL import Image, UnidentifiedImageError

    try:
        yield
    except BadImage:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _pillow_bomb(e) from None
    except UnidentifiedImageError:
        raise BadImage("not an image (cannot identify image file)") from None
    except MemoryError:
        raise
    except Exception as e:  # hostile bytes raise all sorts (OSError, SyntaxError, ValueError, struct.error)
        msg = " ".join(str(e).split()) or type(e).__name__
        if "truncated" in msg.lower():
            raise BadImage("truncated image") from None
        raise BadImage(f"corrupt image ({msg})") from None


def _open_checked(data: bytes, max_pixels: int):
    """Image.open with the pixel limit checked from the header, before any pixel is decoded."""
    from PIL import Image, ImageFile

    if not data:
        raise BadImage("empty (0 bytes)")
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # Some library or script turned this on: it pads a truncated file with gray instead of
        # failing, which would train on (and serve) half images. A bad record must stay bad.
        log.warning("PIL.ImageFile.LOAD_TRUNCATED_IMAGES was True; setting it to False")
        ImageFile.LOAD_TRUNCATED_IMAGES = False
    # Pillow checks its global limit inside open(): its warning (above MAX_IMAGE_PIXELS) is made
    # an error here, its error (above twice that) is one already. catch_warnings touches the
    # process-wide filter list; done per call, the worst a race can leave is this same filter.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        img = Image.open(io.BytesIO(data))
    w, h = img.size
    if w * h > max_pixels:  # the explicit limit, from the header: nothing decoded yet
        raise BadImage(f"decompression bomb: {w}x{h} pixels exceeds the limit of {max_pixels}")
    if w < 1 or h < 1:
        raise BadImage(f"empty image ({w}x{h} pixels)")
    return img


def _to_rgb(img):
    from PIL import Image

    if img.mode.startswith("I"):
        # 16-bit grayscale (PNG, TIFF): Pillow's convert would clip at 255, so keep the high byte
        px = np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8
        img = Image.fromarray(px.astype(np.uint8), "L")
    if img.mode != "RGB":
        # palette transparency is only read right through RGBA; alpha is then dropped (as
        # torchvision's and timm's loaders do with convert("RGB"))
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        img = img.convert("RGB")
    return img


def decode_image(data: bytes, size: int, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded image bytes (JPEG, PNG, WebP, anything Pillow reads) -> uint8 array [size, size, 3], RGB.

    Raises BadImage with a one-line reason for anything that is not a whole, sane image. The same
    bytes give the same array, byte for byte (for one Pillow version).
    """
    from PIL import Image, ImageOps

    with _bad_image_errors():
        img = _open_checked(data, max_pixels)
        if img.format == "JPEG":
            img.draft("RGB", (size, size))  # DCT-domain downscale; each side stays >= size
        img.load()  # decode everything now: a truncated file fails here, not later
        img = _to_rgb(ImageOps.exif_transpose(img))
        w, h = img.size
        side = min(w, h)  # the centered square, in source pixels (fractional: exact centering)
        box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
        img = img.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=REDUCING_GAP)
        out = np.array(img, dtype=np.uint8)
    if out.shape != (size, size, 3):  # cannot happen after convert("RGB"); a reason beats a shape error later
        raise BadImage(f"decoded to shape {out.shape}, not ({size}, {size}, 3)")
    return out


def decode_random_resized_crop(data: bytes, size: int, generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                               flip: bool = True, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Encoded bytes -> uint8 [size, size, 3]: RandomResizedCrop(size, scale, ratio) of the source
    image, then a horizontal flip with p=0.5, drawn from `generator` (crop, then flip), as
    random_resized_crop_flip draws them, but on the source pixels and at decode time: a JPEG is
    decoded at the smallest 1/2, 1/4, 1/8 scale (`draft`) that keeps the crop >= size, so a small
    crop of a big photo costs a fraction of a full decode. EXIF-rotated images are decoded whole
    and turned first, so the crop is drawn on the image as seen.
    """
    import torch
    from PIL import Image, ImageOps

    with _bad_image_errors():
        img = _open_checked(data, max_pixels)
        if img.getexif().get(0x0112, 1) != 1:  # EXIF orientation: turn first, no draft
            img.load()
            img = ImageOps.exif_transpose(img)
        w, h = img.size
        top, left, ch, cw = _crop_params(h, w, scale, ratio, generator)
        if img.format == "JPEG":
            # each side of the drafted image stays >= the crop's side scaled to `size`
            img.draft("RGB", (math.ceil(w * size / cw), math.ceil(h * size / ch)))
        img.load()
        sx, sy = img.size[0] / w, img.size[1] / h
        img = _to_rgb(img)
        box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
        img = img.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=REDUCING_GAP)
        if flip and torch.rand(1, generator=generator).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out = np.array(img, dtype=np.uint8)
    if out.shape != (size, size, 3):
        raise BadImage(f"decoded to shape {out.shape}, not ({size}, {size}, 3)")
    return out


def _crop_params(height: int, width: int, scale, ratio, generator) -> tuple[int, int, int, int]:
    """(top, left, h, w) as torchvision's RandomResizedCrop.get_params draws them: 10 tries at a
    random area and log-uniform aspect ratio, then the center crop clamped to `ratio`."""
    import torch

    dev = generator.device
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1, device=dev).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = math.exp(torch.empty(1, device=dev).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), device=dev, generator=generator).item())
            left = int(torch.randint(0, width - w + 1, (1,), device=dev, generator=generator).item())
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def random_resized_crop_flip(images, generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip: bool = True):
    """uint8 [N, H, W, 3] -> uint8 [N, H, W, 3]: per sample, a random crop (RandomResizedCrop's
    parameters) resized back to H x W (bilinear, antialiased), then a horizontal flip with p=0.5.

    Every random draw comes from `generator` in a fixed order (crop, then flip, sample by sample),
    so the same generator state gives the same batch. The pixels stay on `images`' device.
    """
    import torch
    import torch.nn.functional as F

    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected uint8 [N, H, W, 3], got {images.dtype} {list(images.shape)}")
    n, height, width, _ = images.shape
    out = torch.empty_like(images)
    for k in range(n):
        top, left, h, w = _crop_params(height, width, scale, ratio, generator)
        crop = images[k, top:top + h, left:left + w]
        if (h, w) != (height, width):
            x = crop.permute(2, 0, 1).unsqueeze(0).float()
            # antialias only acts along an axis that shrinks; upscaling is plain bilinear
            x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
            crop = x.squeeze(0).permute(1, 2, 0).round_().clamp_(0, 255).to(torch.uint8)
        if flip and torch.rand(1, device=generator.device, generator=generator).item() < 0.5:
            crop = crop.flip(1)
        out[k] = crop
    return out


def to_model_input(images, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W], (x/255 - mean) / std per channel.

    The result is a permuted view of the NHWC data, i.e. channels_last memory format, which
    convolutions on GPU (and oneDNN on CPU) prefer; `.contiguous()` gives NCHW if needed.
    """
    return normalize_pixels(images.permute(0, 3, 1, 2), mean, std)


def normalize_pixels(pixels, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """uint8 [N, 3, H, W] (any strides) -> float32 (x/255 - mean) / std per channel, on the tensor's
    device and with its strides. Training moves batches to the device as uint8 (a quarter of float32's
    bytes) and normalizes them there (ImageClassification.model_input)."""
    import torch

    x = pixels.to(torch.float32)  # keeps the strides (channels_last stays channels_last)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1) * 255
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1) * 255
    return x.sub_(m).div_(s)


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
    max_pixels: int | None = None  # None: MAX_PIXELS

    def __call__(self, data: bytes, sample: int, epoch: int) -> np.ndarray:
        import torch

        limit = self.max_pixels or MAX_PIXELS
        if self.train:
            gen = torch.Generator().manual_seed(derived_seed("crop", self.seed, epoch, sample))
            hwc = decode_random_resized_crop(data, self.size, gen, self.scale, self.ratio, self.flip, limit)
        else:
            hwc = decode_image(data, self.size, limit)
        return hwc.transpose(2, 0, 1)
