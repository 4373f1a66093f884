"""URIs -> filesystems. Every data and model location is a URI: s3://, a local path, any fsspec protocol.

`StorageContext` is the picklable part of the storage config that Ray tasks and workers need to
reach the same object store as the driver (endpoint, region). Credentials never travel in it:
s3fs/boto3 take them from the standard AWS environment and credential chain. The one exception is
the embedded endpoint, whose fixed dummy keys protect nothing.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import fsspec
import pyarrow.fs as pafs

from workflows.errors import StoreUnreachable, UserError
from workflows.storage.atomic import atomic_write

EMBEDDED_KEY = "embedded"  # moto accepts any key; these are not secrets


def bucket_of(uri: str) -> str | None:
    """The bucket of an s3:// URI; None for any other protocol."""
    return uri.split("://", 1)[1].split("/", 1)[0] if protocol_of(uri) in ("s3", "s3a") else None


def _env_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class StorageContext:
    """How to reach the object store. With the embedded endpoint on, it serves only its own buckets
    (`embedded_buckets`: storage.root's; None: every bucket, for a context built on the endpoint
    alone); any other bucket, such as a user's `data.source=s3://my-bucket/...`, is read from the
    store it is in: `outside_endpoint_url` (storage.endpoint_url, else AWS_ENDPOINT_URL, else AWS),
    with the standard AWS credentials. `for_uri` picks the context of a URI."""

    endpoint_url: str | None = None
    region: str | None = None
    embedded: bool = False
    retries: int = 5
    embedded_buckets: tuple[str, ...] | None = None
    outside_endpoint_url: str | None = None

    @classmethod
    def from_config(cls, storage_cfg) -> StorageContext:
        """The store of a config as loaded. A running embedded endpoint takes storage.endpoint_url's
        place in the runtime's config; the runtime keeps the configured one as the outside endpoint
        (`outside`)."""
        embedded = storage_cfg.embedded.enabled
        root_bucket = bucket_of(storage_cfg.root)
        return cls(
            endpoint_url=storage_cfg.endpoint_url or _env_endpoint(),
            region=storage_cfg.region
            or os.environ.get("AWS_REGION")
            or os.environ.get("AWS_DEFAULT_REGION")
            or "us-east-1",
            embedded=embedded,
            retries=storage_cfg.retries,
            embedded_buckets=(root_bucket,) if embedded and root_bucket else None,
            outside_endpoint_url=(storage_cfg.endpoint_url or _env_endpoint()) if embedded else None,
        )

    def outside(self, configured_endpoint_url: str | None) -> StorageContext:
        """This context with buckets other than the embedded store's at `configured_endpoint_url`
        (else AWS_ENDPOINT_URL, else AWS)."""
        return replace(self, outside_endpoint_url=configured_endpoint_url or _env_endpoint())

    def for_uri(self, uri: str) -> StorageContext:
        """The context that reaches `uri`: this one, or for a bucket that the embedded endpoint does
        not serve, the outside store's (no embedded keys: the AWS credential chain)."""
        bucket = bucket_of(uri)
        if not self.embedded or self.embedded_buckets is None or bucket is None or bucket in self.embedded_buckets:
            return self
        return StorageContext(endpoint_url=self.outside_endpoint_url, region=self.region, retries=self.retries)

    def s3_options(self) -> dict[str, Any]:
        client_kwargs: dict[str, Any] = {"region_name": self.region}
        if self.endpoint_url:
            client_kwargs["endpoint_url"] = self.endpoint_url
        opts: dict[str, Any] = {
            "client_kwargs": client_kwargs,
            "config_kwargs": {"retries": {"max_attempts": self.retries, "mode": "standard"}},
            # Listings must reflect writes made by other processes (Ray workers) at once.
            "use_listings_cache": False,
        }
        if self.embedded:
            opts.update(key=EMBEDDED_KEY, secret=EMBEDDED_KEY)
        return opts

    def boto3_client(self):
        import boto3
        from botocore.config import Config

        kwargs: dict[str, Any] = {
            "region_name": self.region,
            "config": Config(retries={"max_attempts": self.retries, "mode": "standard"}),
        }
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        if self.embedded:
            kwargs.update(aws_access_key_id=EMBEDDED_KEY, aws_secret_access_key=EMBEDDED_KEY)
        return boto3.client("s3", **kwargs)


def _is_unreachable(e: BaseException) -> bool:
    """Connection failures after the client's own retries (botocore's are not OSErrors)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return isinstance(e, (BotoConnectionError, HTTPClientError, ConnectionError, TimeoutError))


def _lacks_credentials(e: BaseException) -> bool:
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    return isinstance(e, (NoCredentialsError, PartialCredentialsError))


@contextmanager
def reaching(uri: str, ctx: StorageContext):
    """Turn "the store cannot be reached" into a UserError naming the URI and the endpoint."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        endpoint = ctx.for_uri(uri).endpoint_url or "default"
        if _is_unreachable(e):
            message = f"cannot reach {uri} (endpoint {endpoint}): {type(e).__name__}: {e}"
            raise StoreUnreachable(message.splitlines()[0]) from None
        if _lacks_credentials(e):
            raise UserError(
                f"no credentials for {uri} (endpoint {endpoint}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or give the node a role; for the built-in store, storage.embedded.enabled=true"
            ) from None
        raise


def protocol_of(uri: str) -> str:
    return uri.split("://", 1)[0] if "://" in uri else "file"


def filesystem(uri: str, ctx: StorageContext) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem for `uri` and the path inside it."""
    proto = protocol_of(uri)
    options = ctx.for_uri(uri).s3_options() if proto in ("s3", "s3a") else {}
    try:
        fs, path = fsspec.core.url_to_fs(uri, **options)
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open {uri}: {e}") from None
    return fs, path


def pyarrow_filesystem(uri: str, ctx: StorageContext) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem over the same fsspec one (Ray Train storage, Ray Data writes)."""
    fs, path = filesystem(uri, ctx)
    if protocol_of(uri) == "file":
        return pafs.LocalFileSystem(), os.path.abspath(path)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


def with_protocol(uri: str, path: str) -> str:
    """A path inside `uri`'s filesystem (as fsspec/pyarrow return them) back to a full URI."""
    proto = protocol_of(uri)
    return path if proto == "file" else f"{proto}://{path}"


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *[p.strip("/") for p in parts]])


def download_dir(uri: str, ctx: StorageContext, local_dir: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Copy the files directly under `uri` (a flat "directory" of objects; prefixes below it, such
    as create-only claims, are not files) into `local_dir`; each copied file's sha256 by name, hashed as
    it is written (a signed version is checked against them without reading it again). A key's name
    comes from the store: one that is not a plain file name (`..`, `.`) is refused."""
    from workflows.storage.transfer import copy_hashing

    fs, path = filesystem(uri, ctx)
    digests = {}
    os.makedirs(local_dir, exist_ok=True)
    with reaching(uri, ctx):
        found = {e["name"]: e["name"].rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(path, detail=True)
                 if e.get("type") != "directory"}
        for base in found.values():
            if base in ("", ".", "..") or os.sep in base:
                raise UserError(f"{uri} holds an object named {base!r}, which is no file name: not downloaded")
        for remote, base in found.items():
            if base not in skip:
                with fs.open(remote, "rb") as fin, open(os.path.join(local_dir, base), "wb") as fout:
                    digests[base] = copy_hashing(fin, fout)[0].hexdigest()
    return digests


def names_under(uri: str, ctx: StorageContext) -> list[str]:
    """The names of the objects and prefixes directly under `uri`, sorted; none where there is nothing."""
    fs, path = filesystem(uri, ctx)
    with reaching(uri, ctx):
        try:
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def exists(uri: str, ctx: StorageContext) -> bool:
    fs, path = filesystem(uri, ctx)
    with reaching(uri, ctx):
        return fs.exists(path)


def write_bytes_atomic(uri: str, data: bytes, ctx: StorageContext) -> None:
    """Write so that a reader never sees a partial object.

    On object stores a PUT is atomic already; on a local disk write a temp name and rename.
    """
    fs, path = filesystem(uri, ctx)
    if protocol_of(uri) == "file":
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        atomic_write(path, data, tmp=f"{path}.tmp-{uuid.uuid4().hex}", fsync=True)
    else:
        with reaching(uri, ctx), fs.open(path, "wb") as f:
            f.write(data)


def json_bytes(obj: Any) -> bytes:
    """`obj` as write_json stores it (where the exact bytes matter: a signed card)."""
    return json.dumps(obj, indent=2, sort_keys=True).encode()


def write_json(uri: str, obj: Any, ctx: StorageContext) -> None:
    write_bytes_atomic(uri, json_bytes(obj), ctx)


def read_json(uri: str, ctx: StorageContext, max_bytes: int | None = None) -> Any:
    """The JSON object at `uri`; `max_bytes`: one over it is refused in one line, unread (an object the
    store holds is as large as its writer made it)."""
    return json.loads(read_bytes(uri, ctx, max_bytes))


def read_bytes(uri: str, ctx: StorageContext, max_bytes: int | None = None) -> bytes:
    """The bytes at `uri`; `max_bytes` as read_json's."""
    fs, path = filesystem(uri, ctx)
    with reaching(uri, ctx), fs.open(path, "rb") as f:
        raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
    if max_bytes is not None and len(raw) > max_bytes:
        raise UserError(f"{uri} is over {max_bytes} bytes: refused")
    return raw


def check_bucket(uri: str, ctx: StorageContext) -> None:
    """Fail early, naming the URI, when an s3 bucket is missing or unreachable."""
    if protocol_of(uri) not in ("s3", "s3a"):
        return
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    ctx = ctx.for_uri(uri)
    client = ctx.boto3_client()
    try:
        client.head_bucket(Bucket=bucket)
    except Exception as e:  # botocore ClientError / EndpointConnectionError / NoCredentialsError
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchBucket"):
            raise UserError(f"bucket not found for {uri} (endpoint {ctx.endpoint_url or 'AWS'})") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise UserError(f"access denied to {uri}: check the AWS credentials") from None
        raise UserError(f"cannot reach {uri} (endpoint {ctx.endpoint_url or 'AWS'}): {type(e).__name__}: {e}") from None
