"""Create-only writes: an object written only where none exists, of racing writers exactly one winning.

`create_once(uri, data, ctx)` is the one primitive for every create-only object (a registry version's
claim, an alias move's record):

- a local file: created with O_EXCL;
- an S3 object: a conditional PUT (If-None-Match: *), which S3 answers 412 where the key exists.
  AWS answers conditional PUTs racing for one key with 409 ConditionalRequestConflict: retried, with
  backoff, until one of them decides. Not every S3-compatible store honours the header (older MinIO,
  some others accept every PUT): the first create-only write to a bucket asks the store once, with a
  probe object written twice; a second conditional PUT must get 412. Where it does not, this says so
  in one line and decides by claims beside the object instead (`_create_by_claims`);
- any other fsspec protocol: its own exclusive-create mode.

# why by hand: s3fs maps 409 to a plain OSError (not FileExistsError) and assumes the store honours
# If-None-Match; boto3 gives the status codes this needs.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
import uuid

from workflows.console import warn
from workflows.errors import UserError
from workflows.storage.uri import StorageContext, filesystem, protocol_of, reaching

CONFLICT_ATTEMPTS = 8  # 409s in a row before giving up (AWS: a conflicting write in flight, ms long)
CLAIMS_SUFFIX = ".claims/"  # beside an object created on a store that ignores If-None-Match

_probed: dict[tuple[str | None, str], bool] = {}  # (endpoint, bucket) -> honours If-None-Match
_probe_lock = threading.Lock()


def create_once(uri: str, data: bytes, ctx: StorageContext) -> bool:
    """Write `data` at `uri` unless something is there already; True where this call created it.
    Of writers racing for one name at most one gets True (on a store that ignores If-None-Match, two
    that collide may both get False: the caller moves on, as from a taken name)."""
    proto = protocol_of(uri)
    if proto == "file":
        path = filesystem(uri, ctx)[1]
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        # written whole under a temp name, then linked to its name (link fails where the name exists): a
        # reader never sees the object created but not yet written, as O_EXCL's empty file would show it
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".create-once-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(tmp)
    if proto not in ("s3", "s3a"):
        fs, path = filesystem(uri, ctx)
        with reaching(uri, ctx):
            try:
                fs.pipe_file(path, data, mode="create")
            except FileExistsError:
                return False
        return True
    bucket, key = _split(uri)
    client = ctx.for_uri(uri).boto3_client()
    with reaching(uri, ctx):
        if honours_if_none_match(uri, ctx):
            return _conditional_put(client, bucket, key, data, uri)
        return _create_by_claims(client, bucket, key, data)


def honours_if_none_match(uri: str, ctx: StorageContext) -> bool:
    """Whether the store of `uri` refuses a second PUT with If-None-Match: * (asked once per endpoint
    and bucket in a process, with a probe object beside `uri`, removed after)."""
    bucket, key = _split(uri)
    ctx = ctx.for_uri(uri)
    where = (ctx.endpoint_url, bucket)
    with _probe_lock:
        if where in _probed:
            return _probed[where]
        client = ctx.boto3_client()
        probe = f"{key}.if-none-match-probe-{uuid.uuid4().hex}"
        with reaching(uri, ctx):
            try:
                first = _conditional_put(client, bucket, probe, b"", uri)
                honours = first and not _conditional_put(client, bucket, probe, b"", uri, probing=True)
            finally:
                client.delete_object(Bucket=bucket, Key=probe)
        _probed[where] = honours
    if not honours:
        warn(f"the store at {ctx.endpoint_url or 'AWS'} ignores If-None-Match (bucket {bucket}: a second "
             "conditional PUT was accepted): create-only writes (registry versions) are decided by claims "
             "beside the object instead, which needs its listings to be strongly consistent")
    return honours


def forget_probes() -> None:
    """Ask every store again (tests: a new endpoint on a port an earlier one had)."""
    with _probe_lock:
        _probed.clear()


def _split(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    return bucket, key


def _code(e: Exception) -> tuple[str, int]:
    response = getattr(e, "response", None) or {}
    return (str(response.get("Error", {}).get("Code", "")),
            int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))


def _conditional_put(client, bucket: str, key: str, data: bytes, uri: str, probing: bool = False) -> bool:
    """PUT with If-None-Match: *; True where it created the object, False on 412. A 409 (another
    conditional write to the key in flight) is retried. `probing`: a store that refuses the header
    itself (400/501) counts as one that does not honour it."""
    from botocore.exceptions import ClientError

    for attempt in range(CONFLICT_ATTEMPTS):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            code, status = _code(e)
            if code == "PreconditionFailed" or status == 412:
                return False
            if code == "ConditionalRequestConflict" or status == 409:
                time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
                continue
            if probing and (status in (400, 501) or code in ("NotImplemented", "InvalidArgument")):
                return True  # the second PUT was not refused as existing: not honoured
            raise
    raise UserError(f"cannot create {uri}: the store answered {CONFLICT_ATTEMPTS} conditional PUTs in a row with "
                    "409 ConditionalRequestConflict (other writers to the same key); try again")


def _create_by_claims(client, bucket: str, key: str, data: bytes) -> bool:
    """Create `key` on a store that ignores If-None-Match: write a claim of this call's own under
    `<key>.claims/`, list them, and write the object only where this claim is the only one. On a store
    whose listings show every completed PUT (S3's strong consistency, MinIO's), two writers cannot
    both be alone: whichever wrote its claim second lists after that, and sees the first's. A writer
    that is not alone withdraws its claim and returns False; one that won keeps it (so that every
    later writer sees it)."""
    prefix = f"{key}{CLAIMS_SUFFIX}"
    mine = f"{prefix}{uuid.uuid4().hex}"
    client.put_object(Bucket=bucket, Key=mine, Body=b"")
    claims = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
              for o in page.get("Contents", [])]
    if claims == [mine] and not _exists(client, bucket, key):
        client.put_object(Bucket=bucket, Key=key, Body=data)
        return True
    if claims != [mine]:
        client.delete_object(Bucket=bucket, Key=mine)
        time.sleep(random.random() * 0.2)  # writers that collided do not collide again in step
    return False


def _exists(client, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as e:
        if _code(e)[1] == 404 or _code(e)[0] in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
