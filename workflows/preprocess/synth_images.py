"""An ImageNet-like image set of any size: photo-like JPEGs in WebDataset tar shards, in any store.

`workflows data synth-images` (and `python -m benchmarks.images`) write `<out>/shard-NNNNNN.tar`
(`<key>.jpg` + `<key>.cls`, as webdataset reads them) and `<out>/index.json`:
`{"format": "wds-tar", "version": 1, "shards": [{"name", "samples", "bytes", "version"}, ...], "classes": N}`
(each shard's object version, so that a reader asks the store nothing for a shard it has cached).

The images must cost what real photos cost to move and decode: about 400 x 350 pixels and 80-150 KB
each, with detail at every scale (flat colours would compress to a few KB and decode in no time).
Each worker paints a few large multi-octave noise canvases once (value noise at 7 octaves plus
per-pixel grain, per channel); an image is then a crop of one, mapped through its class's colour
curves (a per-channel tone curve, jittered per image), with a few class-shaped blobs drawn on
top, JPEG-encoded at quality 94: about 3 ms of one core per image.

Shards are written by N processes, each shard built in memory (one shard's bytes) and written
atomically (a PUT on object stores, temp name then rename on local disk); index.json is written
last, so a reader never sees an index naming a missing shard. Content depends only on the seed.
"""

from __future__ import annotations

import io
import math
import os
import re
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from workflows.errors import UserError
from workflows.preprocess.digits_data import add_member
from workflows.storage.transfer import object_version

CANVASES = 4
CANVAS_SIDE = 1024
QUALITY = 94
GRAIN = 0.8  # amplitude of the per-pixel grain: it sets the JPEG sizes (80-150 KB at quality 94)
WIDTH, HEIGHT = (340, 460), (300, 400)  # crop sizes, uniform: about 400 x 350 on average
TAR_BLOCK = 512
SHAPES = ("ellipse", "rectangle", "triangle", "ring")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, field: str = "--size") -> int:
    """'1GB', '512MiB', '27gb', '3000000' -> bytes (decimal units, binary with 'i')."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"{field} {text!r}: expected a positive size such as 1GB, 512MB, 20GiB or 3000000 (bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class SynthSpec:
    classes: int = 100
    seed: int = 0
    shard_bytes: int = 128 * 10**6


class Painter:
    """The canvases and class palettes of one seed; `image(rng, label)` paints one JPEG."""

    def __init__(self, spec: SynthSpec):
        import numpy as np

        self.spec = spec
        rng = np.random.default_rng([spec.seed, 0])
        self.canvases = [self._canvas(rng) for _ in range(CANVASES)]
        # per class: 3 channels x 5 anchor levels of a tone curve, dark to bright (contrast kept:
        # a flat curve would make a flat, tiny JPEG)
        lo, hi = rng.integers(0, 60, (spec.classes, 3, 1)), rng.integers(200, 256, (spec.classes, 3, 1))
        levels = lo + (hi - lo) * np.linspace(0, 1, 5) + rng.integers(-25, 26, (spec.classes, 3, 5))
        flip = rng.random((spec.classes, 3, 1)) < 0.3  # some channels run bright to dark
        self.levels = np.clip(np.where(flip, levels[:, :, ::-1], levels), 0, 255).astype(np.int64)
        self.shape_of = rng.integers(0, len(SHAPES), spec.classes)
        self.blobs_of = rng.integers(1, 6, spec.classes)

    @staticmethod
    def _field(rng, octaves: int):
        import numpy as np
        from PIL import Image

        acc = np.zeros((CANVAS_SIDE, CANVAS_SIDE), np.float32)
        amp, total = 1.0, 0.0
        for o in range(octaves):
            cells = 2 ** (o + 2)
            noise = Image.fromarray(rng.random((cells, cells), dtype=np.float32))
            acc += amp * np.asarray(noise.resize((CANVAS_SIDE, CANVAS_SIDE), Image.Resampling.BICUBIC))
            total += amp
            amp *= 0.65
        return acc / total

    def _canvas(self, rng):
        import numpy as np
        from PIL import Image

        base = self._field(rng, 7)  # shared by the channels: structure, not colour noise
        side = (CANVAS_SIDE, CANVAS_SIDE)
        chans = [0.7 * base + 0.3 * self._field(rng, 5) + GRAIN * (rng.random(side, dtype=np.float32) - 0.5)
                 for _ in range(3)]
        a = np.stack(chans, -1)
        a = (a - a.min()) / (a.max() - a.min())
        return Image.fromarray((a * 255).astype(np.uint8), "RGB")

    def image(self, rng, label: int) -> bytes:
        import numpy as np
        from PIL import ImageDraw

        w, h = int(rng.integers(*WIDTH)), int(rng.integers(*HEIGHT))
        x, y = int(rng.integers(0, CANVAS_SIDE - w)), int(rng.integers(0, CANVAS_SIDE - h))
        img = self.canvases[int(rng.integers(0, CANVASES))].crop((x, y, x + w, y + h))
        levels = np.clip(self.levels[label] + rng.integers(-20, 21, (3, 5)), 0, 255)  # colour jitter
        grid = np.linspace(0, 255, levels.shape[1])
        lut = np.concatenate([np.interp(np.arange(256), grid, levels[c]) for c in range(3)])
        img = img.point(lut.astype(np.uint8).tolist())
        draw = ImageDraw.Draw(img)
        shape = SHAPES[int(self.shape_of[label])]
        for _ in range(int(self.blobs_of[label])):
            cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
            r = int(rng.integers(15, 80))
            box = (cx - r, cy - r * 2 // 3, cx + r, cy + r * 2 // 3)
            fill = tuple(int(v) for v in lut.reshape(3, 256)[:, int(rng.integers(0, 256))])
            if shape == "ellipse":
                draw.ellipse(box, fill=fill)
            elif shape == "rectangle":
                draw.rectangle(box, fill=fill)
            elif shape == "triangle":
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
            else:
                draw.ellipse(box, outline=fill, width=max(3, r // 5))
        out = io.BytesIO()
        img.save(out, "JPEG", quality=QUALITY)
        return out.getvalue()


def _member_bytes(n: int) -> int:
    return TAR_BLOCK + -(-n // TAR_BLOCK) * TAR_BLOCK  # header + padded data


def build_shard(painter: Painter, index: int, target_bytes: int) -> tuple[bytes, int]:
    """Shard `index`: samples until the next would pass `target_bytes` (at least one). -> (tar, samples)"""
    import numpy as np

    rng = np.random.default_rng([painter.spec.seed, 1, index])
    buf = io.BytesIO()
    size, n = 2 * TAR_BLOCK, 0  # the end-of-archive blocks
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        while True:
            label = int(rng.integers(0, painter.spec.classes))
            jpg, cls = painter.image(rng, label), str(label).encode()
            add = _member_bytes(len(jpg)) + _member_bytes(len(cls))
            if n and size + add > target_bytes:
                break
            key = f"{index:06d}_{n:06d}"
            for name, data in ((f"{key}.jpg", jpg), (f"{key}.cls", cls)):
                add_member(tar, name, data)
            size += add
            n += 1
    return buf.getvalue(), n


_painter: Painter | None = None


def _write_one(args) -> dict:
    """In a worker process: build shard `index` and write it to `out`."""
    global _painter
    from workflows.storage.uri import filesystem, join, reaching, write_bytes_atomic

    spec, ctx, out, index, target = args
    if _painter is None or _painter.spec != spec:
        _painter = Painter(spec)
    data, samples = build_shard(_painter, index, target)
    name = f"shard-{index:06d}.tar"
    uri = join(out, name)
    write_bytes_atomic(uri, data, ctx)
    fs, path = filesystem(uri, ctx)
    with reaching(uri, ctx):  # the version the shard cache keys on: readers then need no request per cached shard
        version = object_version(fs.info(path))
    return {"name": name, "samples": samples, "bytes": len(data), "version": version}


def synth_images(out: str, size_bytes: int, ctx, spec: SynthSpec = SynthSpec(), workers: int | None = None,
                 say: Callable[[str], object] = lambda _m: None) -> dict:
    """Write about `size_bytes` of shards and index.json under `out`; returns the index."""
    import multiprocessing as mp

    from workflows.storage.uri import check_bucket, join, write_json

    if size_bytes <= 0:
        raise UserError(f"--size {size_bytes}: must be positive")
    if spec.classes < 1:
        raise UserError(f"--classes {spec.classes}: must be at least 1")
    if spec.shard_bytes < 200_000:
        raise UserError(f"--shard-bytes {spec.shard_bytes}: must be at least 200KB (one image is ~110 KB)")
    check_bucket(out, ctx)
    out = out.rstrip("/")
    n = max(1, math.ceil(size_bytes / spec.shard_bytes))
    targets = [min(spec.shard_bytes, size_bytes - i * spec.shard_bytes) for i in range(n)]
    workers = workers or os.cpu_count() or 1
    t0, done, shards = time.perf_counter(), 0, []
    # spawn: a fresh interpreter per worker, not a fork of a caller that may run threads
    with ProcessPoolExecutor(min(workers, n), mp_context=mp.get_context("spawn")) as pool:
        for entry in pool.map(_write_one, [(spec, ctx, out, i, t) for i, t in enumerate(targets)]):
            shards.append(entry)
            done += entry["bytes"]
            if len(shards) % 8 == 0 or len(shards) == n:
                say(f"synth-images: {len(shards)}/{n} shards, {done / 1e9:.2f} GB, "
                    f"{done / 1e6 / (time.perf_counter() - t0):.0f} MB/s")
    index = {"format": "wds-tar", "version": 1, "shards": shards, "classes": spec.classes}
    write_json(join(out, "index.json"), index, ctx)
    return index
