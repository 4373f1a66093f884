"""Copying one object behind an fsspec URI (or s3 via boto3's transfer manager) into a local file,
hashing it on the way and failing with ObjectChanged when the object is replaced mid-copy: the
transfer half of the shard cache (workflows/storage/cache.py does the bookkeeping)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

CHUNK = 8 * 1024 * 1024  # streamed transfer: never the whole object in memory


@dataclass(frozen=True)
class Source:
    uri: str  # canonical (protocol://path), so "/a" and "file:///a" are one entry
    fs: AbstractFileSystem
    path: str
    size: int
    version: str


def object_version(info: dict) -> str:
    """An object's version from an fsspec info/listing entry: the store's ETag where it has one
    (s3), else size + modification time. A changed object changes it."""
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return str(etag).strip('"')
    stamp = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    return f"{info.get('size')}:{stamp}"


class _KnownObject:
    """s3transfer subscriber: size and ETag known from the listing, so no HEAD is sent."""

    def __init__(self, size: int, etag: str | None):
        self.size, self.etag = size, etag

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self.size)
        if self.etag:
            future.meta.provide_object_etag(self.etag)

    def on_progress(self, **kwargs):
        pass

    def on_done(self, **kwargs):
        pass


class ObjectChanged(Exception):
    """The object changed between stat and read: stat it again."""


def stream_to_file(src: Source, tmp: Path, chunk_size: int = CHUNK):
    """(sha256, bytes) of `src` streamed into `tmp` through its fsspec filesystem, fsynced."""
    with src.fs.open(src.path, "rb") as fin, open(tmp, "wb") as fout:
        etag = getattr(fin, "details", {}).get("ETag")
        if etag and etag.strip('"') != src.version:  # replaced between our stat and this open
            raise ObjectChanged
        digest, n = copy_hashing(fin, fout, chunk_size)
        fout.flush()
        os.fsync(fout.fileno())
    return digest, n


def copy_hashing(fin, fout, chunk_size: int = CHUNK):
    """(sha256, bytes) of what is copied from the open file `fin` into `fout`, hashed as it is written."""
    digest, n = hashlib.sha256(), 0
    while chunk := fin.read(chunk_size):
        digest.update(chunk)
        fout.write(chunk)
        n += len(chunk)
    return digest, n


def s3_download_to_file(client, src: Source, tmp: Path, chunk_size: int = CHUNK):
    """(sha256, bytes) of an s3 `src` downloaded into `tmp` with the boto3 `client`, fsynced.

    s3 objects go through boto3's transfer manager (s3transfer), not s3fs: it fetches byte
    ranges of one object in parallel threads, where s3fs streams each object over one
    connection with all transfers on its single event-loop thread (about half the throughput,
    see `workflows bench data`). The listing's size and ETag are handed to it, so it sends no
    HEAD, and every ranged GET carries If-Match: a replaced object fails, never mixes."""
    from botocore.exceptions import ClientError
    from s3transfer.manager import TransferConfig, TransferManager

    bucket, key = src.path.split("/", 1)
    # threshold 1: always the ranged path, the one that sends If-Match
    config = TransferConfig(multipart_threshold=1, multipart_chunksize=chunk_size)
    pinned = _KnownObject(src.size, f'"{src.version}"' if ":" not in src.version else None)  # ETag, not size:mtime
    try:
        with open(tmp, "wb") as fout, TransferManager(client, config) as transfers:
            transfers.download(bucket, key, fout, subscribers=[pinned]).result()
            fout.flush()
            os.fsync(fout.fileno())
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("412", "PreconditionFailed"):
            raise ObjectChanged from None
        if code in ("404", "NoSuchKey"):
            raise FileNotFoundError(src.uri) from None
        raise
    digest = hashlib.sha256()  # a second pass, from the page cache: far faster than the network
    with open(tmp, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest, os.path.getsize(tmp)


def sha256_file(path: Path, chunk_size: int = CHUNK) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
