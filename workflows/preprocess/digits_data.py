"""The digits dataset: a real image set that ships with scikit-learn, so image classification runs
offline. 1,797 scans of handwritten digits, 8x8 pixels, 10 classes (see docs/data/digits.md).

Each sample becomes an 8x8 grayscale PNG (the 0..16 counts scaled to 0..255) keyed "digit-NNNNN"
(its index in scikit-learn's copy) and labelled "0".."9"; `write_shards` lays the samples out as
WebDataset tar shards (`key.png` + `key.cls`), the format the "tar" reader reads. Deterministic:
the same scikit-learn copy gives the same shards, byte for byte.
"""

from __future__ import annotations

import io
import tarfile


def build() -> list[dict]:
    """[{"key", "image" (PNG bytes), "label"}] for every sample, in scikit-learn's order."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    pixels = np.rint(digits.images * (255 / 16)).clip(0, 255).astype(np.uint8)  # 0..16 -> 0..255
    rows = []
    for i, (img, target) in enumerate(zip(pixels, digits.target)):
        buf = io.BytesIO()
        Image.fromarray(img, "L").save(buf, "PNG")
        rows.append({"key": f"digit-{i:05d}", "image": buf.getvalue(), "label": str(int(target))})
    return rows


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed metadata: same rows, same bytes
    tar.addfile(info, io.BytesIO(data))


def write_shards(rows: list[dict], source_uri: str, ctx, num_shards: int = 4) -> list[str]:
    """Write rows as tar shards `shard-NNNNNN.tar` under `source_uri` (row i goes to shard i mod
    num_shards); each sample is `<key>.png` followed by `<key>.cls`, as WebDataset groups them."""
    from workflows.storage.uri import join, write_bytes_atomic

    uris = []
    for i in range(num_shards):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for row in rows[i::num_shards]:
                add_member(tar, f"{row['key']}.png", row["image"])
                add_member(tar, f"{row['key']}.cls", row["label"].encode())
        shard = join(source_uri, f"shard-{i:06d}.tar")
        write_bytes_atomic(shard, buf.getvalue(), ctx)
        uris.append(shard)
    return uris
