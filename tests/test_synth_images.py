"""`workflows data synth-images`: a tiny ImageNet-like set through the real CLI into the embedded
S3 endpoint, read back from the endpoint's persisted store."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from tests.conftest import QUICKSTART, run_cli, sets
from tests.helpers import tiny_overrides


def test_synth_images_into_the_embedded_store(tmp_path):
    from PIL import Image

    from workflows.preprocess.synth_images import HEIGHT, WIDTH
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext

    out = run_cli("data", "synth-images", "--out", "s3://workflows/synth", "--size", "3MB", "--classes", "5",
                  "--shard-bytes", "1MB", "--workers", "2", "--config", str(QUICKSTART),
                  *sets(tiny_overrides(tmp_path)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "synth-images:" in out.stderr and "3 shards" in out.stderr

    with EmbeddedS3(str(tmp_path / "s3")) as s3:  # what the command persisted, served again
        client = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True).boto3_client()
        index = json.loads(client.get_object(Bucket="workflows", Key="synth/index.json")["Body"].read())
        assert index["format"] == "wds-tar" and index["version"] == 1 and index["classes"] == 5
        assert [s["name"] for s in index["shards"]] == [f"shard-{i:06d}.tar" for i in range(3)]
        sizes, labels = [], set()
        for shard in index["shards"]:
            got = client.get_object(Bucket="workflows", Key=f"synth/{shard['name']}")
            assert shard["version"] == got["ETag"].strip('"')  # readers of cached shards ask the store nothing
            body = got["Body"].read()
            assert len(body) == shard["bytes"] <= 1_000_000
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                names = tar.getnames()
                keys = sorted({n.split(".", 1)[0] for n in names})
                assert sorted(names) == sorted([f"{k}.jpg" for k in keys] + [f"{k}.cls" for k in keys])
                assert len(keys) == shard["samples"] > 0
                for k in keys:
                    jpg = tar.extractfile(f"{k}.jpg").read()
                    img = Image.open(io.BytesIO(jpg))
                    img.load()  # a truncated or invalid JPEG fails here
                    assert img.format == "JPEG" and img.mode == "RGB"
                    assert WIDTH[0] <= img.width <= WIDTH[1] and HEIGHT[0] <= img.height <= HEIGHT[1]
                    sizes.append(len(jpg))
                    label = int(tar.extractfile(f"{k}.cls").read())
                    assert 0 <= label < 5
                    labels.add(label)
        assert sum(s["bytes"] for s in index["shards"]) <= 3_000_000
        assert len(labels) > 1
        mean = sum(sizes) / len(sizes)
        assert 80_000 <= mean <= 150_000, mean  # photo-like: not flat colours


def test_same_seed_same_shard_and_sizes_follow_the_target():
    from workflows.preprocess.synth_images import Painter, SynthSpec, build_shard

    painter = Painter(SynthSpec(classes=3, seed=7))
    a, n = build_shard(painter, 2, 600_000)
    b, _ = build_shard(Painter(SynthSpec(classes=3, seed=7)), 2, 600_000)
    c, _ = build_shard(painter, 3, 600_000)
    assert a == b and a != c
    assert 0 < len(a) <= 600_000 and n >= 3


@pytest.mark.parametrize("text,expected", [("1GB", 10**9), ("512MiB", 512 * 2**20), ("3000", 3000), ("1.5kb", 1500)])
def test_parse_size(text, expected):
    from workflows.preprocess.synth_images import parse_size

    assert parse_size(text) == expected


def test_bad_size_is_one_line_error(tmp_path):
    out = run_cli("data", "synth-images", "--out", str(tmp_path / "x"), "--size", "12XB", timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --size '12XB': expected a positive size such as 1GB, 512MB, 20GiB or " \
                                 "3000000 (bytes)"
    assert not (tmp_path / "x").exists()
