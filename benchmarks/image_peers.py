"""The peer rows of `python -m benchmarks.images`, one process per row, run by benchmarks.images.

    python -m benchmarks.image_peers ROW '{"endpoint": ..., "prefix": ..., ...}'

ROW: streaming (MosaicML Streaming, MDS), litdata (LitData optimize + StreamingDataset),
webdataset (the tars streamed from S3 over HTTP), local (torch DataLoader over the same images as
files on local disk), decode (N processes decoding local files in a loop: the decode limit).

Runs in the peers' venv (make bench-peers), not the product's: streaming 0.13 pins numpy<2.2 and
transformers<5. So this module imports only the standard library at the top, and in its functions
torch, numpy, PIL, boto3, the peer, and workflows.preprocess.images (numpy + PIL only) for the
transform every row shares with ours: decode, RandomResizedCrop(224, scale (0.08, 1)), flip, uint8
CHW. `ours` (benchmarks.image_rows) imports `timed_pass` and `phase` from here.

Protocol with the parent: before each measured phase the row prints `@phase NAME` and waits for a
line on stdin (the parent snapshots the endpoint's counters and starts sampling the process tree's
memory), then prints `@result {json}` when the phase ends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SIZE = 224
BATCH = 256


def _batch(a: dict) -> int:
    """The rows' batch size (bench.batch; 256)."""
    return int(a.get("batch") or BATCH)


# -- protocol ----------------------------------------------------------------------------------
@contextmanager
def phase(name: str) -> Iterator[dict]:
    """A measured phase: the parent counts store bytes and memory between `@phase` and `@result`."""
    print(f"@phase {name}", flush=True)
    sys.stdin.readline()  # the parent is ready
    out: dict = {"phase": name}
    t0 = time.perf_counter()
    yield out
    out.setdefault("seconds", round(time.perf_counter() - t0, 3))
    print("@result " + json.dumps(out), flush=True)


def timed_pass(batches, out: dict, images_of=lambda b: len(b[1]), limit: int | None = None) -> dict:
    """Iterate a loader once (or up to `limit` images): images, time to the first batch, steady
    images/s (after the first)."""
    t0 = time.perf_counter()
    n = first_n = 0
    first = None
    for batch in batches:
        n += images_of(batch)
        if first is None:
            first, first_n = time.perf_counter() - t0, n
        if limit is not None and n >= limit:
            break
    total = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("the loader yielded no batch")
    steady = (n - first_n) / (total - first) if total > first and n > first_n else n / total
    out.update(images=n, seconds=round(total, 3), first_batch_s=round(first, 3),
               images_per_s=round(steady, 1), images_per_s_whole_pass=round(n / total, 1))
    return out


# -- the shared transform -------------------------------------------------------------------------
def crop_flip(data: bytes, seed: int):
    """Encoded bytes -> uint8 [3, 224, 224]: the same decode + RandomResizedCrop + flip as ours."""
    import torch

    from workflows.preprocess.images import decode_random_resized_crop

    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.from_numpy(decode_random_resized_crop(data, SIZE, gen).transpose(2, 0, 1))


def _seed(key: str | int, epoch: int) -> int:
    import zlib

    return zlib.crc32(f"{key}:{epoch}".encode())


# -- the source shards ------------------------------------------------------------------------------
def _client(a: dict):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=a["endpoint"], region_name="us-east-1", aws_access_key_id="embedded",
                        aws_secret_access_key="embedded", config=Config(signature_version="s3v4"))


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, key = uri.split("://", 1)[1].split("/", 1)
    return bucket, key


def _index(a: dict) -> dict:
    bucket, key = _bucket_key(a["prefix"].rstrip("/") + "/index.json")
    return json.loads(_client(a).get_object(Bucket=bucket, Key=key)["Body"].read())


def _source_samples(a: dict, shard: str) -> Iterator[tuple[str, bytes, int]]:
    """(key, jpg bytes, label) of one source tar, streamed from the store."""
    bucket, key = _bucket_key(a["prefix"].rstrip("/") + "/" + shard)
    body = _client(a).get_object(Bucket=bucket, Key=key)["Body"]
    jpg: dict[str, bytes] = {}
    with tarfile.open(fileobj=body, mode="r|") as tar:
        for m in tar:
            stem, _, ext = m.name.partition(".")
            member_file = tar.extractfile(m)
            assert member_file is not None, m.name  # a stream of regular files, written by synth-images
            data = member_file.read()
            if ext == "jpg":
                jpg[stem] = data
            elif ext == "cls":
                yield stem, jpg.pop(stem), int(data)


# -- MosaicML Streaming ------------------------------------------------------------------------------
def _import_streaming() -> Any:  # a module of the peers' venv, not installed here
    # streaming's package __init__ imports streaming.vision, its only torchvision user, and
    # torchvision cannot be imported beside this CPU torch (it is removed from the peers' venv).
    # An empty module under that name lets MDSWriter and StreamingDataset import and run.
    import types

    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def row_streaming(a: dict) -> None:
    os.environ.update(S3_ENDPOINT_URL=a["endpoint"], AWS_ACCESS_KEY_ID="embedded",
                      AWS_SECRET_ACCESS_KEY="embedded", AWS_DEFAULT_REGION="us-east-1")
    streaming: Any = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    scratch = Path(a["scratch"])
    remote = a["prefix"].rstrip("/") + "-mds"
    with phase("streaming_convert") as out:
        stage = scratch / "mds-stage"
        with streaming.MDSWriter(out=(str(stage), remote), columns={"jpg": "bytes", "cls": "int"}) as w:
            for shard in _index(a)["shards"]:
                for _key, jpg, label in _source_samples(a, shard["name"]):
                    w.write({"jpg": jpg, "cls": label})
        shutil.rmtree(stage, ignore_errors=True)

    class Images(streaming.StreamingDataset):
        def __getitem__(self, idx):
            s = super().__getitem__(idx)
            return crop_flip(s["jpg"], _seed(idx, self.next_epoch)), s["cls"]

    clean_stale_shared_memory()
    ds = Images(remote=remote, local=str(scratch / "mds-cache"), shuffle=True, shuffle_seed=0, batch_size=_batch(a))
    # persistent workers: the warm epoch keeps the cold one's worker processes, as ours does
    loader = DataLoader(ds, batch_size=_batch(a), num_workers=a["workers"], persistent_workers=a["workers"] > 0)
    for name in ("streaming_cold", "streaming_warm"):
        with phase(name) as out:
            timed_pass(loader, out)


# -- LitData ---------------------------------------------------------------------------------------
def _litdata_samples(shard: str):
    a = json.loads(os.environ["IMAGE_PEERS_ARGS"])
    for _key, jpg, label in _source_samples(a, shard):
        yield {"jpg": jpg, "cls": label}


_count = iter(range(1 << 62))


def _litdata_allow_http() -> None:
    """LitData downloads through obstore with fixed client options that lack allow_http, so obstore
    refuses a plain-http endpoint such as the embedded one ("builder error"); add it. LitData's
    DataLoader workers are spawned: they run this when they import this module for the transform."""
    from litdata.streaming import downloader

    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}


if os.environ.get("IMAGE_PEERS_LITDATA_HTTP"):
    _litdata_allow_http()


def _lit_transform(item: dict):
    return crop_flip(item["jpg"], _seed(next(_count), os.getpid())), item["cls"]


def row_litdata(a: dict) -> None:
    import litdata

    scratch = Path(a["scratch"])
    remote = a["prefix"].rstrip("/") + "-litdata"
    storage = {"endpoint_url": a["endpoint"], "aws_access_key_id": "embedded",
               "aws_secret_access_key": "embedded", "region_name": "us-east-1"}
    os.environ["IMAGE_PEERS_ARGS"] = json.dumps(a)
    os.environ["IMAGE_PEERS_LITDATA_HTTP"] = "1"  # its spawned workers patch litdata too (at import, below)
    _litdata_allow_http()
    with phase("litdata_convert") as out:
        # optimize writes to local disk here, then the chunks are uploaded: its own s3:// output
        # goes through a helper that only knows AWS's endpoint
        stage = scratch / "litdata-stage"
        litdata.optimize(fn=_litdata_samples, inputs=[s["name"] for s in _index(a)["shards"]],
                         output_dir=str(stage), chunk_bytes="64MB", num_workers=a["workers"])
        client = _client(a)
        bucket, key = _bucket_key(remote)
        for f in sorted(stage.iterdir()):
            client.upload_file(str(f), bucket, f"{key}/{f.name}")
        shutil.rmtree(stage, ignore_errors=True)

    # litdata's workers are spawned: the transform must pickle by a module path, not as __main__'s
    from benchmarks.image_peers import _lit_transform

    ds = litdata.StreamingDataset(remote, cache_dir=str(scratch / "litdata-cache"), shuffle=True, seed=0,
                                  storage_options=storage, transform=_lit_transform)
    loader = litdata.StreamingDataLoader(ds, batch_size=_batch(a), num_workers=a["workers"],
                                        persistent_workers=a["workers"] > 0)
    for name in ("litdata_cold", "litdata_warm"):
        with phase(name) as out:
            timed_pass(loader, out)


# -- WebDataset ------------------------------------------------------------------------------------
def row_webdataset(a: dict) -> None:
    import webdataset as wds
    from torch.utils.data import DataLoader

    bucket, key = _bucket_key(a["prefix"].rstrip("/"))
    client = _client(a)
    # presigned GETs (SigV4: the endpoint refuses anonymous ones), fetched by webdataset's curl pipe
    urls = [client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": f"{key}/{s['name']}"},
                                          ExpiresIn=86400) for s in _index(a)["shards"]]

    def decode(sample):
        return crop_flip(sample["jpg"], _seed(sample["__key__"], 0)), int(sample["cls"])

    ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.single_node_only, seed=0)
          .shuffle(1000).map(decode).batched(_batch(a), partial=True))
    loader = DataLoader(ds, batch_size=None, num_workers=a["workers"])
    with phase("webdataset") as out:
        timed_pass(loader, out)


# -- local files -----------------------------------------------------------------------------------
def _extract(a: dict, root: Path) -> list[tuple[str, int]]:
    """The same images as files on local disk (<root>/<key>.jpg) and their labels."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for shard in _index(a)["shards"]:
        for key, jpg, label in _source_samples(a, shard["name"]):
            path = root / f"{key}.jpg"
            path.write_bytes(jpg)
            files.append((str(path), label))
    return files


class _Files:
    """A map-style dataset over local image files (the plain torch DataLoader recipe)."""

    def __init__(self, files: list[tuple[str, int]]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        path, label = self.files[i]
        with open(path, "rb") as f:
            return crop_flip(f.read(), _seed(i, 0)), label


def row_local(a: dict) -> None:
    from torch.utils.data import DataLoader

    with phase("local_convert") as out:
        files = _extract(a, Path(a["scratch"]) / "local-files")
        out["images"] = len(files)
    Path(a["scratch"], "local-files.json").write_text(json.dumps(files))
    import torch

    loader = DataLoader(_Files(files), batch_size=_batch(a), shuffle=True, num_workers=a["workers"],
                        generator=torch.Generator().manual_seed(0))
    with phase("local_dataloader") as out:
        timed_pass(loader, out)


def _decode_files(paths: list[str]) -> int:
    for i, p in enumerate(paths):
        with open(p, "rb") as f:
            crop_flip(f.read(), i)
    return len(paths)


def row_decode(a: dict) -> None:
    """The decode limit: N processes, each decoding and cropping its share of the local files."""
    import multiprocessing as mp

    files = json.loads(Path(a["scratch"], "local-files.json").read_text())
    paths = [p for p, _ in files]
    n = a["workers"]
    with mp.get_context("fork").Pool(n) as pool:
        pool.map(_decode_files, [paths[:8]] * n)  # processes up and imports done before the clock starts
        with phase("decode_limit") as out:
            t0 = time.perf_counter()
            done = sum(pool.map(_decode_files, [paths[i::n] for i in range(n)]))
            seconds = time.perf_counter() - t0
            out.update(images=done, seconds=round(seconds, 3), images_per_s=round(done / seconds, 1),
                       images_per_s_whole_pass=round(done / seconds, 1))


ROWS = {"streaming": row_streaming, "litdata": row_litdata, "webdataset": row_webdataset, "local": row_local,
        "decode": row_decode}


def main(argv: list[str]) -> None:
    row, args = argv[0], json.loads(argv[1])
    if row not in ROWS:
        raise SystemExit(f"unknown row {row!r}; one of {', '.join(ROWS)}")
    ROWS[row](args)


if __name__ == "__main__":
    main(sys.argv[1:])
