"""Image building blocks with real parts: Pillow-encoded images, hostile bytes built by hand, the
tar and folder readers over the embedded S3 endpoint and Ray Data, and the built-in digits set."""

import collections
import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from workflows.config import CacheConfig
from workflows.errors import UserError, surface_user_errors
from workflows.preprocess import digits_data
from workflows.preprocess.images import (
    MAX_PIXELS,
    BadImage,
    decode_image,
    random_resized_crop_flip,
    to_model_input,
)
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.storage.embedded import EmbeddedS3
from workflows.storage.uri import StorageContext


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def photo(w: int = 120, h: int = 80, seed: int = 0) -> Image.Image:
    """Smooth content with some noise: what a lossy codec keeps roughly, not exactly."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1) + rng.normal(0, 8, (h, w, 3))
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def halves(w: int, h: int) -> Image.Image:
    """Left half red, right half blue."""
    arr = np.zeros((h, w, 3), np.uint8)
    arr[:, : w // 2, 0] = 255
    arr[:, w // 2 :, 2] = 255
    return Image.fromarray(arr)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A valid-looking PNG whose header declares width x height grayscale pixels, with two rows of
    data: a few hundred bytes that would ask for width*height bytes if decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1) * 2, 9)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


# -- decode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_decode_gives_rgb_square_and_is_deterministic(fmt):
    data = encode(photo(), fmt)
    a = decode_image(data, 32)
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, decode_image(bytes(data), 32))
    # close to the source's center square resized the same way (lossy codecs: roughly)
    ref = np.asarray(photo().resize((32, 32), Image.Resampling.BILINEAR, box=(20, 0, 100, 80)), np.int16)
    assert np.abs(a.astype(np.int16) - ref).mean() < (1 if fmt == "PNG" else 6)


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "I;16"])
def test_decode_converts_every_mode_to_rgb(mode):
    if mode == "I;16":
        img = Image.fromarray(np.full((10, 12), 200 * 256, np.uint16))  # 16-bit gray: the high byte is kept
    elif mode == "P":
        img = Image.new("P", (12, 10), 1)
        img.putpalette([0, 0, 0, 200, 200, 200])
        img.info["transparency"] = 0  # palette transparency: read through RGBA
    else:
        img = Image.new("RGB", (12, 10), (200, 200, 200)).convert(mode)
    a = decode_image(encode(img, "PNG"), 8)
    assert a.shape == (8, 8, 3) and (a == 200).all()


def test_decode_crops_the_center_and_follows_exif_orientation():
    a = decode_image(encode(halves(40, 20), "PNG"), 16)
    # the center square: red | blue (bilinear blends the two columns at the edge)
    assert (a[:, :7] == [255, 0, 0]).all() and (a[:, 9:] == [0, 0, 255]).all()
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display": the displayed image is portrait
    b = decode_image(encode(halves(40, 20), "PNG", exif=exif), 16)
    assert (b[:7] == [255, 0, 0]).all() and (b[9:] == [0, 0, 255]).all()  # red on top, blue below


def test_a_large_jpeg_is_drafted_and_still_right():
    big = photo(1600, 1200, seed=1)
    a = decode_image(encode(big, "JPEG", quality=95), 64)
    ref = np.asarray(big.resize((64, 64), Image.Resampling.BILINEAR, box=(200, 0, 1400, 1200)), np.int16)
    assert a.shape == (64, 64, 3) and np.abs(a.astype(np.int16) - ref).mean() < 4


def _truncated_jpeg() -> bytes:
    data = encode(photo(), "JPEG")
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "data, max_pixels, reason",
    [
        (b"", MAX_PIXELS, r"^empty \(0 bytes\)$"),
        (b"<html>not found</html>", MAX_PIXELS, r"^not an image \(cannot identify image file\)$"),
        (_truncated_jpeg(), MAX_PIXELS, r"^truncated image$"),
        # far above Pillow's own limit: Pillow refuses it in Image.open
        (png_declaring(50_000, 50_000), MAX_PIXELS, r"^decompression bomb: 2500000000 pixels exceeds the limit"),
        # between Pillow's limit and twice it: Pillow only warns; that warning is an error here
        (png_declaring(10_000, 9_000), MAX_PIXELS, r"^decompression bomb: 90000000 pixels exceeds the limit"),
        # our explicit limit, checked on the header before decoding
        (encode(photo(100, 100), "PNG"), 5_000, r"^decompression bomb: 100x100 pixels exceeds the limit of 5000$"),
    ],
    ids=["empty", "not-an-image", "truncated-jpeg", "bomb-50000x50000", "bomb-pillow-warning", "max-pixels"],
)
def test_hostile_inputs_raise_bad_image_with_a_one_line_reason(data, max_pixels, reason):
    assert len(data) < 100_000
    with pytest.raises(BadImage, match=reason) as info:
        decode_image(data, 32, max_pixels=max_pixels)
    assert "\n" not in str(info.value)


def test_the_bomb_is_tiny_on_disk():
    assert len(png_declaring(50_000, 50_000)) < 500


def test_truncated_stays_bad_even_if_someone_turned_on_load_truncated_images(monkeypatch):
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(BadImage, match="^truncated image$"):
        decode_image(_truncated_jpeg(), 32)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


# -- augmentation and model input ----------------------------------------------------------------
def batch(n: int = 6, h: int = 24, w: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))


def test_random_resized_crop_flip_keeps_shape_and_is_seeded():
    x = batch()
    out = random_resized_crop_flip(x, torch.Generator().manual_seed(1))
    assert out.shape == x.shape and out.dtype == torch.uint8
    assert torch.equal(out, random_resized_crop_flip(x, torch.Generator().manual_seed(1)))
    assert not torch.equal(out, random_resized_crop_flip(x, torch.Generator().manual_seed(2)))
    assert not torch.equal(out, x)
    assert torch.equal(x, batch())  # the input is left alone


def test_flip_false_never_mirrors():
    # a ramp along the width: any mirror shows; scale (1, 1) on a square crops the whole image
    ramp = torch.arange(32, dtype=torch.uint8).mul(8).view(1, 1, 32, 1).expand(8, 32, 32, 3).contiguous()
    mirrored = 0
    for seed in range(10):
        kept = random_resized_crop_flip(ramp, torch.Generator().manual_seed(seed), scale=(1, 1), flip=False)
        assert torch.equal(kept, ramp)
        flipped = random_resized_crop_flip(ramp, torch.Generator().manual_seed(seed), scale=(1, 1))
        same = [torch.equal(f, r) for f, r in zip(flipped, ramp)]
        assert all(s or torch.equal(f, r.flip(1)) for s, f, r in zip(same, flipped, ramp))
        mirrored += same.count(False)
    assert 20 < mirrored < 60  # p = 0.5 over 80 samples


def test_to_model_input_normalizes_to_nchw_float():
    x = torch.tensor([124, 116, 104], dtype=torch.uint8).view(1, 1, 1, 3).expand(2, 4, 5, 3).contiguous()
    y = to_model_input(x)
    assert y.shape == (2, 3, 4, 5) and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert y.abs().max() < 0.01  # ImageNet's mean color is ~0
    white = to_model_input(torch.full((1, 2, 2, 3), 255, dtype=torch.uint8))
    assert torch.allclose(white[0, :, 0, 0], torch.tensor([(1 - 0.485) / 0.229, (1 - 0.456) / 0.224,
                                                           (1 - 0.406) / 0.225]))


# -- readers over the embedded S3 store and Ray Data ---------------------------------------------
@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with EmbeddedS3(str(tmp_path_factory.mktemp("s3"))) as s3:
        s3.ensure_bucket("images")
        yield s3


@pytest.fixture
def store(s3):
    ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
    client = ctx.boto3_client()

    def put(key: str, data: bytes) -> str:
        client.put_object(Bucket="images", Key=key, Body=data)
        return f"s3://images/{key}"

    put.ctx = ctx
    return put


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_tar_shards_group_members_by_key(ray_cluster, store, tmp_path):
    jpg, png, webp = (encode(photo(seed=i), f) for i, f in enumerate(["JPEG", "PNG", "WEBP"]))
    store("tars/shard-000000.tar", tar_of([
        ("a.jpg", jpg), ("a.cls", b" cat\n"),
        ("b.PNG", png), ("b.json", json.dumps({"label": 3, "w": 120}).encode()),
        ("sub/c.webp", webp),  # no label
        ("d.cls", b"dog"),  # no image
        ("README", b"no key"), ("._a.jpg", b"macOS metadata"),  # skipped, as webdataset does
    ]))
    store("tars/shard-000001.tar", tar_of([
        ("e.jpg", jpg), ("e.png", png), ("e.cls", b"cat"),  # two images
        ("f.seg.png", png), ("f.cls", b"dog"),  # "seg.png" is another field, not the image
    ]))
    shards, fmt = list_shards("s3://images/tars/", store.ctx)
    assert fmt == "tar" and [s.uri for s in shards] == ["s3://images/tars/shard-000000.tar",
                                                        "s3://images/tars/shard-000001.tar"]
    cache = CacheConfig(dir=str(tmp_path / "cache"))
    rows = {r["key"]: r for r in read_dataset(shards, fmt, store.ctx, cache).take_all()}
    assert {k: (r["image"], r["label"]) for k, r in rows.items()} == {
        "shard-000000.tar/a": (jpg, "cat"),
        "shard-000000.tar/b": (png, "3"),
        "shard-000000.tar/sub/c": (webp, None),
        "shard-000000.tar/d": (None, "dog"),
        "shard-000001.tar/e": (None, "cat"),
        "shard-000001.tar/f": (None, "dog"),
    }
    assert len(list((tmp_path / "cache" / "shards").glob("*.data"))) == 2  # read through the shard cache


def _tar_cut(where: str) -> bytes:
    jpg = encode(photo(), "JPEG")
    good = tar_of([("a.jpg", jpg), ("a.cls", b"cat")])
    second_header = 512 + (len(jpg) + 511) // 512 * 512
    return {"in-data": good[: 512 + len(jpg) // 2], "in-header": good[: second_header + 100],
            "at-member-end": good[: second_header + 1024], "garbage": b"not a tar " * 100}[where]


@pytest.mark.parametrize("where", ["in-data", "in-header", "at-member-end", "garbage"])
def test_a_malformed_tar_names_the_shard(ray_cluster, store, tmp_path, where):
    # tarfile alone reads a tar cut in a header or at a member's end as a shorter, valid archive
    store(f"broken-{where}/shard-000000.tar", tar_of([("a.jpg", encode(photo(), "JPEG")), ("a.cls", b"cat")]))
    store(f"broken-{where}/shard-000001.tar", _tar_cut(where))
    shards, fmt = list_shards(f"s3://images/broken-{where}/", store.ctx)
    bad = rf"malformed tar shard s3://images/broken-{where}/shard-000001\.tar: \S"
    with pytest.raises(UserError, match=bad), surface_user_errors():
        read_dataset(shards, fmt, store.ctx, CacheConfig(dir=str(tmp_path / "cache"))).materialize()


def test_class_folders_read_in_groups_through_the_cache(ray_cluster, store, tmp_path):
    files = {
        "train/cat/1.jpg": encode(photo(seed=1), "JPEG"),
        "train/cat/2.png": encode(photo(seed=2), "PNG"),
        "train/dog/3.webp": encode(photo(seed=3), "WEBP"),
        "train/dog/4.jpeg": b"",  # an empty file is a row; decoding it is what fails
        "train/dog/notes.txt": b"not a shard",
    }
    for key, data in files.items():
        store(key, data)
    shards, fmt = list_shards("s3://images/train/", store.ctx)
    assert fmt == "image" and len(shards) == 4
    cache = CacheConfig(dir=str(tmp_path / "cache"))
    for _ in range(2):  # the second read is served by the cache
        rows = read_dataset(shards, fmt, store.ctx, cache, shards_per_task=3).take_all()
        got = {r["key"]: (r["image"], r["label"]) for r in rows}
        assert got == {f"s3://images/{k}": (v, k.split("/")[1]) for k, v in files.items() if not k.endswith(".txt")}
    assert len(list((tmp_path / "cache" / "shards").glob("*.data"))) == 4


def test_parquet_binary_columns_pass_through(ray_cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [encode(photo(seed=i), "PNG") for i in range(3)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "label": ["a", "b", "a"]}),
                   tmp_path / "part-0.parquet")
    shards, fmt = list_shards(str(tmp_path), StorageContext())
    rows = read_dataset(shards, fmt, StorageContext(), CacheConfig(dir=str(tmp_path / "cache"))).take_all()
    assert fmt == "parquet" and [(r["image"], r["label"]) for r in rows] == list(zip(images, ["a", "b", "a"]))
    assert decode_image(rows[0]["image"], 16).shape == (16, 16, 3)


def test_a_named_format_skips_files_of_another(tmp_path):
    (tmp_path / "part-0.jsonl").write_text('{"text": "x", "label": "a"}\n')
    (tmp_path / "preview.png").write_bytes(encode(photo(), "PNG"))
    assert [s.uri for s in list_shards(str(tmp_path), StorageContext(), "jsonl")[0]] == [str(tmp_path / "part-0.jsonl")]
    with pytest.raises(UserError, match="cannot tell one format"):
        list_shards(str(tmp_path), StorageContext())
    with pytest.raises(UserError, match=r"no shard matched .* \(pattern \*\.tar\)"):
        list_shards(str(tmp_path), StorageContext(), "tar")


# -- the built-in digits set ---------------------------------------------------------------------
def test_digits_build_write_and_read_back(ray_cluster, store, tmp_path):
    rows = digits_data.build()
    assert len(rows) == 1797 and {r["label"] for r in rows} == {str(d) for d in range(10)}
    assert rows[42]["key"] == "digit-00042"
    assert rows == digits_data.build()  # deterministic, PNG bytes included
    from sklearn.datasets import load_digits

    scan = np.rint(load_digits().images[42] * 255 / 16).astype(np.uint8)
    assert np.array_equal(decode_image(rows[42]["image"], 8)[..., 0], scan)  # lossless, 8x8 kept as is

    uris = digits_data.write_shards(rows, "s3://images/digits/", store.ctx)
    assert uris == [f"s3://images/digits/shard-{i:06d}.tar" for i in range(4)]
    shards, fmt = list_shards("s3://images/digits/", store.ctx)
    back = read_dataset(shards, fmt, store.ctx, CacheConfig(dir=str(tmp_path / "cache"))).take_all()
    assert fmt == "tar" and len(back) == 1797
    by_key = {r["key"].split("/", 1)[1]: r for r in back}
    assert {k: (r["image"], r["label"]) for k, r in by_key.items()} == {
        r["key"]: (r["image"], r["label"]) for r in rows
    }
    assert collections.Counter(r["label"] for r in back) == collections.Counter(r["label"] for r in rows)


def test_torchrun_and_trial_crops_follow_the_sample_not_the_rank():
    """train.standalone.epoch_batches (torchrun workers, one-worker Tune trials): rank 0 and rank 1
    of the same epoch give a sample the same crop (each rank's order differs), another epoch another."""
    from types import SimpleNamespace

    from workflows.config import load_config
    from workflows.tasks import get_task
    from workflows.train.standalone import epoch_batches

    cfg = load_config("configs/digits.yaml", ["tracking.enabled=false"])
    task, size = get_task(cfg), 8
    data = SimpleNamespace(info={"image_size": size}, labels=["0", "1"])
    rng = np.random.default_rng(0)
    rows = {"pixels": [rng.integers(0, 255, size * size * 3, dtype=np.uint8).tobytes() for _ in range(12)],
            "label": np.array(["0", "1"] * 6, dtype=object), "key": np.array([f"k{i}" for i in range(12)])}

    def crops(epoch: int, rank: int) -> set[bytes]:
        """The epoch's 12 training inputs (in this rank's order, which differs by rank)."""
        return {x.numpy().tobytes() for b in epoch_batches(task, data, rows, 4, cfg.train.seed, epoch, rank)
                for x in b["pixel_values"]}

    assert crops(1, 0) == crops(1, 1)  # the same crop of each sample, whatever the rank
    assert crops(1, 0) != crops(2, 0)
