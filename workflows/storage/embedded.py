"""An embedded S3-compatible endpoint: moto's server on 127.0.0.1, persisted to a local directory.

moto's server runs in a child process: its state is per process (two endpoints in one process
would share buckets), and serving shard downloads must not compete with the driver for the GIL.
The child is told to exit when its parent dies (PR_SET_PDEATHSIG), so a killed command leaves no
orphan server behind.

moto keeps objects in memory only, and what a user produces (processed data, checkpoints, models)
must outlive the command. So the endpoint restores its buckets from `data_dir` when it starts and
writes them back (only changed objects, each to a temp name then renamed) when a stage ends and
when it stops. Objects are stored content-addressed (`objects/<sha256 of bucket/key>`) with a
manifest, so no object key can become a path outside `data_dir`.

One process owns a data_dir at a time (an flock); another command that finds it owned reuses
the running endpoint instead of starting a second copy of the data.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from workflows.errors import UserError
from workflows.net import free_port
from workflows.storage.atomic import atomic_write
from workflows.storage.s3_server import TRAFFIC_PATH
from workflows.storage.uri import EMBEDDED_KEY, StorageContext

log = logging.getLogger(__name__)


def _atomic_write(path: Path, data: bytes | Callable[[Path], object]) -> None:
    # a hidden, unique temp name beside the target (the store's files are listed by name)
    atomic_write(path, data, tmp=path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}"), fsync=True)


class EmbeddedS3:
    def __init__(self, data_dir: str, host: str = "127.0.0.1", port: int = 0):
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        self.port = port
        self.endpoint_url: str | None = None
        self.owner = False
        self._proc: subprocess.Popen | None = None
        self._lock_fd: int | None = None
        self._manifest: dict[str, dict] = {}

    @property
    def url(self) -> str:
        """endpoint_url of a started (or attached) endpoint."""
        if self.endpoint_url is None:
            raise RuntimeError(f"the embedded S3 endpoint of {self.data_dir} is not started")
        return self.endpoint_url

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, wait_s: float = 120) -> str:
        """Own the data dir's endpoint (spawn, restore), or use the one its owner runs. An owner
        still restoring is waited for up to `wait_s`; one that dies meanwhile frees the lock,
        which this process then takes over."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "objects").mkdir(exist_ok=True)
        fd = os.open(self.data_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.time() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # the owner writes its record once its store is restored
                info = _record(self.data_dir)
                if info is not None:
                    os.close(fd)
                    return self._attach(info)
                if time.time() > deadline:
                    os.close(fd)
                    raise UserError(f"embedded S3 data dir {self.data_dir} is locked by {_owner(self.data_dir)}, "
                                    f"still restoring its store after {wait_s:.0f} s: retry once it is up") from None
                time.sleep(0.2)
        self._lock_fd = fd
        self.owner = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # whom a waiter names
        # a killed owner's record names a dead endpoint: gone before the restore (which takes a
        # while), so that a command attaching meanwhile waits for ours instead of using it
        (self.data_dir / "endpoint.json").unlink(missing_ok=True)
        try:
            self.endpoint_url = self._spawn()
            self._restore()
        except BaseException:
            self._release()
            raise
        _atomic_write(
            self.data_dir / "endpoint.json", json.dumps({"url": self.endpoint_url, "pid": os.getpid()}).encode()
        )
        log.info("embedded S3 endpoint at %s (data in %s)", self.endpoint_url, self.data_dir)
        return self.endpoint_url

    def _spawn(self) -> str:
        """Start moto's server in a child process and wait until it answers."""
        for _attempt in range(3):
            port = self.port or free_port(self.host)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "workflows.storage.s3_server", "-H", self.host, "-p", str(port),
                 "--parent", str(os.getpid())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            url = f"http://{self.host}:{port}"
            deadline = time.time() + 60
            while time.time() < deadline and self._proc.poll() is None:
                try:
                    with socket.create_connection((self.host, port), timeout=1):
                        return url
                except OSError:
                    time.sleep(0.1)
            self._proc.kill()
            if self.port:
                break
        raise UserError(f"the embedded S3 endpoint could not start on {self.host}:{self.port or 'a free port'}")

    def _attach(self, info: dict) -> str:
        self.endpoint_url = info["url"]
        log.info("reusing the embedded S3 endpoint of pid %s at %s", info.get("pid"), self.endpoint_url)
        return self.endpoint_url

    def stop(self) -> None:
        if not self.owner:
            return
        try:
            self.persist()
        finally:
            self._release()

    def _release(self) -> None:
        if self._proc is not None:
            self._proc.kill()  # it ignores SIGTERM (s3_server.main); its objects are persisted
            self._proc.wait(timeout=10)
            self._proc = None
        (self.data_dir / "endpoint.json").unlink(missing_ok=True)
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
        self.owner = False

    def __enter__(self) -> EmbeddedS3:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- persistence -----------------------------------------------------------------------
    def _client(self):
        return StorageContext(endpoint_url=self.endpoint_url, region="us-east-1", embedded=True).boto3_client()

    def _manifest_path(self) -> Path:
        return self.data_dir / "manifest.json"

    def _restore(self) -> None:
        path = self._manifest_path()
        self._manifest = json.loads(path.read_text()) if path.exists() else {}
        client = self._client()
        buckets = {entry["bucket"] for entry in self._manifest.values()}
        for bucket in sorted(buckets | set(self._empty_buckets())):
            client.create_bucket(Bucket=bucket)
        for entry in self._manifest.values():
            with open(self.data_dir / "objects" / entry["file"], "rb") as f:
                client.put_object(Bucket=entry["bucket"], Key=entry["key"], Body=f)
            # moto computes the same ETag for the same bytes; keep ours in step with it anyway
            head = client.head_object(Bucket=entry["bucket"], Key=entry["key"])
            entry["etag"] = head["ETag"]

    def _empty_buckets(self) -> list[str]:
        p = self.data_dir / "buckets.json"
        return json.loads(p.read_text()) if p.exists() else []

    def persist(self) -> int:
        """Write changed objects to disk; drop deleted ones. Returns the number of objects written."""
        if not self.owner:
            return 0
        client = self._client()
        seen: dict[str, dict] = {}
        written = 0
        buckets = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
        for bucket in buckets:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for obj in page.get("Contents", []):
                    ident = f"{bucket}/{obj['Key']}"
                    old = self._manifest.get(ident)
                    if old and old["etag"] == obj["ETag"] and old["size"] == obj["Size"]:
                        seen[ident] = old
                        continue
                    name = hashlib.sha256(ident.encode()).hexdigest()
                    target = self.data_dir / "objects" / name
                    # streamed, not held in memory
                    _atomic_write(target, lambda tmp: client.download_file(bucket, obj["Key"], str(tmp)))
                    seen[ident] = {
                        "bucket": bucket,
                        "key": obj["Key"],
                        "file": name,
                        "etag": obj["ETag"],
                        "size": obj["Size"],
                    }
                    written += 1
        for ident, entry in self._manifest.items():
            if ident not in seen:
                (self.data_dir / "objects" / entry["file"]).unlink(missing_ok=True)
        self._manifest = seen
        _atomic_write(self._manifest_path(), json.dumps(seen, indent=1, sort_keys=True).encode())
        _atomic_write(self.data_dir / "buckets.json", json.dumps(sorted(buckets)).encode())
        return written

    def ensure_bucket(self, bucket: str) -> None:
        client = self._client()
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)


def _record(data_dir: Path) -> dict | None:
    """The owner's endpoint.json, once written (it is written whole: an atomic rename)."""
    try:
        info = json.loads((data_dir / "endpoint.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("url"), str) else None


def _owner(data_dir: Path) -> str:
    try:
        pid = int((data_dir / "lock").read_text().strip())
    except (OSError, ValueError):
        return "another process"
    return f"pid {pid}"


def running_endpoint(data_dir: str) -> str | None:
    """The URL of the endpoint another process runs for `data_dir` (`workflows store`, a command
    in progress): its owner holds the data dir's lock, and its record is written once the store is
    restored. The lock, not a connection to the recorded port, says whether the owner lives: a
    killed owner's port may be anyone's by now."""
    path = Path(data_dir).expanduser().resolve()
    try:
        fd = os.open(path / "lock", os.O_RDONLY)
    except OSError:  # never started here
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # owned: running, or still restoring (no record yet)
        info = _record(path)
        return info["url"] if info else None
    finally:
        os.close(fd)  # releases the lock if this took it
    return None  # free: no owner, whatever a killed one's record says


def endpoint_traffic(endpoint_url: str, reset: bool = False) -> dict:
    """Requests and bytes counted at an embedded endpoint since its start (or last reset).

    `{"requests": {METHOD: n}, "bytes_out": {METHOD: n}, "bytes_in": {METHOD: n}}`, where METHOD
    is LIST for bucket listings, so object bytes served are `bytes_out["GET"]`.
    """
    import requests

    url = endpoint_url.rstrip("/") + TRAFFIC_PATH + ("/reset" if reset else "")
    r = requests.post(url, timeout=10) if reset else requests.get(url, timeout=10)
    r.raise_for_status()
    return r.json()


__all__ = ["EmbeddedS3", "EMBEDDED_KEY", "endpoint_traffic", "running_endpoint"]


def keep_up(rt, say) -> None:
    """`workflows store`, inside the runtime (which started the config's endpoint and its
    buckets, and persists and stops it at the end): keep it up until Ctrl-C or SIGTERM
    (workflows.stop turns both into KeyboardInterrupt), persisting every minute; other commands
    meanwhile use it."""
    s3 = rt.embedded
    if not s3.owner:
        raise UserError(f"the embedded store in {s3.data_dir} already runs at {s3.endpoint_url}")
    say(f"store: embedded S3 endpoint {s3.endpoint_url} (data in {s3.data_dir}); Ctrl-C to stop")
    last = time.time()
    try:
        while True:
            time.sleep(0.5)
            if time.time() - last > 60:  # what others wrote survives a crash of this process
                s3.persist()
                last = time.time()
    except KeyboardInterrupt:
        pass
    s3.persist()
    say(f"store: stopped; data persisted in {s3.data_dir}")


def check_store_enabled(cfg) -> None:
    """`workflows store` starts the embedded endpoint: a config without one has nothing to start."""
    if not cfg.storage.embedded.enabled:
        raise UserError(f"storage.embedded.enabled is false: the store is {cfg.storage.root}, nothing to start")
