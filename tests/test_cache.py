"""ShardCache with real parts: local files, the embedded S3 endpoint over HTTP, real processes."""

import hashlib
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from workflows.errors import UserError
from workflows.storage.cache import CacheStats, ShardCache
from workflows.storage.embedded import EmbeddedS3
from workflows.storage.uri import StorageContext

# fork: children inherit the imports, so eight of them start cheaply on a small, busy machine
MP = mp.get_context("fork")
LOCAL = StorageContext()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha_file(path) -> str:
    return sha(Path(path).read_bytes())


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """One moto server for the module; each test uses its own bucket."""
    with EmbeddedS3(str(tmp_path_factory.mktemp("s3"))) as s3:
        yield s3


@pytest.fixture
def bucket(s3, request):
    name = re.sub(r"[^a-z0-9]", "-", request.node.name.lower())[:60].strip("-")
    s3.ensure_bucket(name)
    ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
    client = ctx.boto3_client()

    def put(key: str, data: bytes) -> str:
        client.put_object(Bucket=name, Key=key, Body=data)
        return f"s3://{name}/{key}"

    put.ctx, put.name = ctx, name
    return put


# -- children (module level, so that a process can run them) ----------------------------------
def _fetch_and_report(directory, ctx, uri, barrier, results):
    cache = ShardCache(directory, ctx)
    barrier.wait()  # all eight ask for the uncached shard at once
    path = cache.fetch(uri)
    results.put((cache.stats().misses, sha_file(path)))


def _fetch(directory, uri, chunk_size):
    ShardCache(directory, LOCAL, chunk_size=chunk_size).fetch(uri)


def _hold_pin(directory, uri, pinned, release):
    with ShardCache(directory, LOCAL).open_local(uri):
        pinned.set()
        release.wait(60)


# -- tests -----------------------------------------------------------------------------------
def test_hits_misses_and_stats_on_local_and_s3(tmp_path, bucket):
    local = tmp_path / "shard-0.bin"
    local.write_bytes(b"a" * 1000)
    remote = bucket("shards/0.bin", b"b" * 3000)
    cache = ShardCache(str(tmp_path / "cache"), bucket.ctx)
    for uri, data in [(str(local), b"a" * 1000), (remote, b"b" * 3000)]:
        first, second = cache.fetch(uri), cache.fetch(uri)
        assert first == second and Path(first).read_bytes() == data
    assert cache.stats() == CacheStats(hits=2, misses=2, bytes_from_store=4000, bytes_from_cache=4000)
    # another process's cache object (here: another instance) sees the same entries
    other = ShardCache(str(tmp_path / "cache"), bucket.ctx)
    other.fetch(f"file://{local}")  # the same object spelled as a URI is the same entry
    other.fetch(remote)
    assert other.stats() == CacheStats(hits=2, misses=0, bytes_from_store=0, bytes_from_cache=4000)


def test_any_fsspec_protocol(tmp_path):
    import fsspec

    fsspec.filesystem("memory").pipe("/cache-test/x", b"in memory")
    assert Path(ShardCache(str(tmp_path), LOCAL).fetch("memory://cache-test/x")).read_bytes() == b"in memory"


def test_many_processes_download_an_uncached_shard_once(tmp_path, bucket):
    data = os.urandom(16 << 20)
    uri = bucket("big/shard", data)
    n = 8
    barrier, results = MP.Barrier(n), MP.Queue()
    procs = [MP.Process(target=_fetch_and_report, args=(str(tmp_path / "c"), bucket.ctx, uri, barrier, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=180) for _ in range(n)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(misses for misses, _ in reports) == 1
    assert {digest for _, digest in reports} == {sha(data)}
    assert len(list((tmp_path / "c").glob("*.data"))) == 1


def test_sigkill_mid_download_never_leaves_an_entry_read_as_good(tmp_path):
    data = os.urandom(64 << 20)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    directory = tmp_path / "c"
    rng = random.Random(1126)
    killed_mid_download = 0
    for _ in range(4):
        shutil.rmtree(directory, ignore_errors=True)
        child = MP.Process(target=_fetch, args=(str(directory), str(src), 1 << 20))
        child.start()
        deadline = time.time() + 30  # kill once the download has begun, a little later
        while not list(directory.glob("*.tmp-*")) and time.time() < deadline and child.is_alive():
            time.sleep(0.002)
        time.sleep(rng.uniform(0, 0.15))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        killed_mid_download += bool(list(directory.glob("*.tmp-*")))
        # whatever the kill left: an entry with a sidecar is complete and correct
        for meta in directory.glob("*.json"):
            assert sha_file(meta.with_suffix(".data")) == sha(data)
        cache = ShardCache(str(directory), LOCAL)
        assert sha_file(cache.fetch(str(src))) == sha(data)
        assert not list(directory.glob("*.tmp-*")), "stale temp files are cleaned up"
        assert len(list(directory.glob("*.data"))) == 1
    assert killed_mid_download >= 1  # the kills did land inside downloads


def test_corrupt_and_truncated_copies_are_fetched_again(tmp_path):
    data = os.urandom(100_000)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    directory = str(tmp_path / "c")
    checking = ShardCache(directory, LOCAL, verify_checksums=True)
    path = checking.fetch(str(src))
    with open(path, "r+b") as f:  # same size, other bytes: only a checksum sees it
        f.seek(500)
        f.write(bytes(b ^ 0xFF for b in data[500:600]))
    assert sha_file(checking.fetch(str(src))) == sha(data)
    assert checking.stats().misses == 2

    sizing = ShardCache(directory, LOCAL)  # checks sizes on every hit, hashes only in verify()
    os.truncate(path, 1234)
    assert sha_file(sizing.fetch(str(src))) == sha(data)
    assert sizing.stats().misses == 1
    with open(path, "r+b") as f:
        f.write(b"garbage")
    assert sizing.verify(str(src)) is False  # detected and dropped
    assert sha_file(sizing.fetch(str(src))) == sha(data)
    assert sizing.verify(str(src)) is True
    assert sizing.stats().misses == 2


def test_eviction_keeps_the_budget_lru_first_and_spares_pinned_entries(tmp_path):
    # an entry's footprint: its 3 data blocks plus a block each for its sidecar and pointer (5
    # blocks); a cap of 12 blocks holds two entries
    block = os.statvfs(tmp_path).f_bsize
    size, cap = 3 * block - 100, 12 * block
    srcs = {}
    for name in "abcde":
        srcs[name] = str(tmp_path / f"{name}.bin")
        Path(srcs[name]).write_bytes(name.encode() * size)
    directory = str(tmp_path / "c")
    cache = ShardCache(directory, LOCAL, max_bytes=cap)
    paths = {n: cache.fetch(srcs[n]) for n in "ab"}
    cache.fetch(srcs["a"])  # a is now more recent than b
    paths["c"] = cache.fetch(srcs["c"])
    assert not os.path.exists(paths["b"]) and os.path.exists(paths["a"])
    assert cache.cached_bytes() <= cap and cache.stats().evictions == 1

    # another process pins a; c is touched after, so a is the least recently used
    pinned, release = MP.Event(), MP.Event()
    holder = MP.Process(target=_hold_pin, args=(directory, srcs["a"], pinned, release))
    holder.start()
    try:
        assert pinned.wait(30)
        cache.fetch(srcs["c"])
        paths["d"] = cache.fetch(srcs["d"])  # over budget: a is skipped, c goes
        assert os.path.exists(paths["a"]) and Path(paths["a"]).read_bytes() == b"a" * size
        assert not os.path.exists(paths["c"])
        assert cache.cached_bytes() <= cap
    finally:
        release.set()
        holder.join(30)
    paths["e"] = cache.fetch(srcs["e"])  # unpinned now, and least recently used: a goes
    assert not os.path.exists(paths["a"]) and os.path.exists(paths["d"])
    assert cache.cached_bytes() <= cap and cache.stats().evictions == 3


def test_the_cap_bounds_the_whole_directory_however_many_objects_pass_through(tmp_path):
    """Sidecars, pointers and block rounding count against max_bytes, and an evicted object leaves
    no file behind (its URI's pointer went with it): 60 objects through a cap of 10 leave the
    directory within the cap."""
    cap = 1_000_000
    cache = ShardCache(str(tmp_path / "c"), LOCAL, max_bytes=cap)
    for i in range(60):
        src = tmp_path / f"s{i:03d}.bin"
        src.write_bytes(os.urandom(100_000 + i))
        with cache.open_local(str(src)):
            pass
    files = list((tmp_path / "c").iterdir())
    assert sum(f.stat().st_blocks * 512 for f in files) <= cap
    assert len([f for f in files if f.name.endswith("-current")]) == len([f for f in files if f.suffix == ".data"])
    assert cache.stats().evictions >= 50


def test_a_changed_object_is_fetched_again(tmp_path, bucket):
    uri = bucket("shard", b"1" * 100)
    cache = ShardCache(str(tmp_path / "c"), bucket.ctx)
    old = cache.fetch(uri)
    assert Path(old).read_bytes() == b"1" * 100
    bucket("shard", b"2" * 100)  # same size, new ETag
    new = cache.fetch(uri)
    assert new != old and Path(new).read_bytes() == b"2" * 100
    assert cache.stats().misses == 2
    assert not os.path.exists(old)  # the old version is dropped, never returned
    local = tmp_path / "local.bin"
    local.write_bytes(b"v1")
    assert Path(cache.fetch(str(local))).read_bytes() == b"v1"
    local.write_bytes(b"version 2")  # new size and mtime
    assert Path(cache.fetch(str(local))).read_bytes() == b"version 2"


def test_a_missing_object_names_the_uri(tmp_path, bucket):
    absent = bucket("present", b"x").replace("present", "absent")  # the bucket exists, the key not
    cache = ShardCache(str(tmp_path / "c"), bucket.ctx)
    for uri in [str(tmp_path / "nope.bin"), absent]:
        with pytest.raises(UserError, match=re.escape(uri)):
            cache.fetch(uri)


def test_a_warm_ray_data_pass_over_plain_uris_asks_the_store_nothing(ray_cluster, tmp_path, bucket):
    """A processed split's files are plain URIs (from its manifest). A Ray Dataset re-runs its reads
    on every pass (each training epoch): the second pass is served by the cache with no request to
    the store, its versions coming from one listing when the dataset was made."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.config import CacheConfig
    from workflows.storage.embedded import endpoint_traffic
    from workflows.storage.shards import read_shards

    uris = []
    for k in range(3):
        buf = io.BytesIO()
        pq.write_table(pa.table({"x": list(range(k * 10, k * 10 + 10))}), buf)
        uris.append(bucket(f"processed/v1/split=train/part-{k}.parquet", buf.getvalue()))
    url = bucket.ctx.endpoint_url
    endpoint_traffic(url, reset=True)
    ds = read_shards(uris, "parquet", bucket.ctx, CacheConfig(dir=str(tmp_path / "cache")), check_schemas=False)
    assert endpoint_traffic(url)["requests"] == {"LIST": 1}  # the split's one directory
    assert sorted(r["x"] for r in ds.take_all()) == list(range(30))  # cold: fetched into the cache
    endpoint_traffic(url, reset=True)
    assert sorted(r["x"] for r in ds.take_all()) == list(range(30))
    assert endpoint_traffic(url)["requests"] == {}, "no HEAD per shard in a warm pass"


RANGES = ["bytes=0-0", "bytes=5-1000004", "bytes=-7", "bytes=3-", "bytes=100-99999999"]


def _ranged_reads_match(client, bucket_name: str, key: str, data: bytes) -> None:
    from botocore.exceptions import ClientError

    n = len(data)
    for spec in RANGES + [f"bytes={n - 10}-"]:
        lo, hi = spec[6:].split("-")
        want = data[-int(hi):] if not lo else data[int(lo):int(hi) + 1 if hi else n]
        got = client.get_object(Bucket=bucket_name, Key=key, Range=spec)
        assert got["Body"].read() == want, spec
        assert got["ContentRange"].endswith(f"/{n}"), spec
    with pytest.raises(ClientError, match="InvalidRange"):
        client.get_object(Bucket=bucket_name, Key=key, Range=f"bytes={n}-")
    with pytest.raises(ClientError, match="PreconditionFailed|412"):
        client.get_object(Bucket=bucket_name, Key=key, Range="bytes=0-9", IfMatch='"not-its-etag"')
    assert client.get_object(Bucket=bucket_name, Key=key)["Body"].read() == data


def test_the_embedded_endpoint_answers_byte_ranges_as_s3_does(tmp_path, bucket):
    """The embedded endpoint reads only a ranged GET's bytes (s3_server.serve_ranges_from_the_object_file):
    every kind of range, a range past the end (416), a failed If-Match (412), a whole GET and a
    download in 1 MB ranges through the cache give S3's answers, for an object moto keeps in
    memory and one it spools to a file."""
    client = bucket.ctx.boto3_client()
    for n in (64 * 1024, 12 * 1024 * 1024 + 3):
        data = random.Random(n).randbytes(n)
        uri = bucket(f"ranged-{n}.bin", data)
        _ranged_reads_match(client, uri.split("/")[2], f"ranged-{n}.bin", data)
        assert sha_file(ShardCache(str(tmp_path / f"c{n}"), bucket.ctx, chunk_size=2 ** 20).fetch(uri)) == sha(data)


def test_a_ranged_get_reads_only_its_range_from_the_stored_object(monkeypatch):
    """moto alone reads the whole object for each ranged GET (8 MB ranges of a 125 MB object read it
    16 times: #37); with the patch a GET of `bytes=a-b` or `bytes=a-` never asks for the object's
    whole value, a plain GET still does. In this process, with moto's classes restored afterwards."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    from workflows.storage.s3_server import serve_ranges_from_the_object_file

    whole, reads = FakeKey.value, []
    monkeypatch.setattr(S3Response, "key_response", S3Response.key_response)
    monkeypatch.setattr(FakeKey, "value", property(lambda k: reads.append(k.size) or whole.fget(k), whole.fset))
    serve_ranges_from_the_object_file()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        host, port = server.get_host_and_port()
        client = StorageContext(endpoint_url=f"http://{host}:{port}", region="us-east-1", embedded=True).boto3_client()
        client.create_bucket(Bucket="ranges")
        data = random.Random(7).randbytes(6 * 1024 * 1024)
        client.put_object(Bucket="ranges", Key="obj", Body=data)
        reads.clear()
        for spec in ("bytes=0-0", "bytes=5-1000004", "bytes=3-", "bytes=100-99999999"):
            client.get_object(Bucket="ranges", Key="obj", Range=spec)["Body"].read()
        assert reads == [], "a ranged GET read the whole object"
        client.get_object(Bucket="ranges", Key="obj")["Body"].read()
        assert reads == [len(data)]
        _ranged_reads_match(client, "ranges", "obj", data)  # and the answers are S3's
    finally:
        server.stop()


# -- what the cache switch and cap cover (#51) ------------------------------------------------
def test_the_cap_counts_the_model_cache_beside_the_shards(tmp_path):
    """cache.max_bytes bounds <cache.dir>/shards and <cache.dir>/models together: with a model
    directory cached, the shard cache evicts shards to stay within what the model leaves."""
    from workflows.config.storage import CacheConfig
    from workflows.storage.model_cache import cached_dir, disk_usage

    src = tmp_path / "src"
    src.mkdir()
    uris = []
    for i in range(8):
        (src / f"s{i}").write_bytes(os.urandom(40_000))
        uris.append(str(src / f"s{i}"))
    cap = 400_000
    cfg = CacheConfig(dir=str(tmp_path / "cache"), max_bytes=cap)
    models = tmp_path / "cache" / "models"
    cached_dir(models, "m1", lambda d: Path(d, "model.safetensors").write_bytes(os.urandom(250_000)))
    cache = cfg.shard_cache(LOCAL)
    for uri in uris:
        cache.fetch(uri)
    held = sum(p.stat().st_blocks * 512 for p in (tmp_path / "cache" / "shards").iterdir())
    assert held + disk_usage(models) <= cap, (held, disk_usage(models))
    assert cache.stats().evictions > 0


def _s3_model_config(bucket, tmp_path):
    from workflows.config import load_config

    # the test's bucket is the embedded store's own (storage.root's): other buckets are read outside it
    return load_config(None, ["data.source=raw", f"storage.endpoint_url={bucket.ctx.endpoint_url}",
                              "storage.embedded.enabled=true", f"storage.root=s3://{bucket.name}/workflows",
                              f"cache.dir={tmp_path / 'cache'}"])


def test_replaced_initial_weights_beside_an_unchanged_config_are_fetched_again(tmp_path, bucket):
    """The node's copy of initial weights (model.name_or_path, an object-store URI) is keyed on every
    file of the directory, not on config.json's ETag alone."""
    from workflows.tasks.image.models import local_model_dir

    cfg = _s3_model_config(bucket, tmp_path)
    bucket("init/config.json", b'{"model_type": "resnet"}')
    uri = bucket("init/model.safetensors", b"old weights").rsplit("/", 1)[0]
    first = local_model_dir(uri, cfg)
    assert Path(first, "model.safetensors").read_bytes() == b"old weights"
    assert local_model_dir(uri, cfg) == first  # unchanged: the same copy
    bucket("init/model.safetensors", b"new weights")
    second = local_model_dir(uri, cfg)
    assert second != first and Path(second, "model.safetensors").read_bytes() == b"new weights"


def test_a_failed_model_download_leaves_nothing_behind(tmp_path, bucket, monkeypatch):
    import workflows.storage.uri as uri_module
    from workflows.tasks.image.models import local_model_dir

    cfg = _s3_model_config(bucket, tmp_path)
    bucket("broken/config.json", b"{}")
    uri = bucket("broken/model.safetensors", b"weights").rsplit("/", 1)[0]
    download_dir = uri_module.download_dir

    def half_then_fail(src, ctx, local_dir, skip=()):
        Path(local_dir, "config.json").write_bytes(b"{}")
        raise ConnectionError("the store went away mid-download")

    monkeypatch.setattr(uri_module, "download_dir", half_then_fail)
    with pytest.raises(ConnectionError):
        local_model_dir(uri, cfg)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []
    monkeypatch.setattr(uri_module, "download_dir", download_dir)
    assert Path(local_model_dir(uri, cfg), "model.safetensors").read_bytes() == b"weights"


def test_with_the_cache_disabled_the_stream_loader_keeps_nothing(tmp_path):
    """cache.enabled=false: the stream loader (and an index build, through the same shard_cache)
    reads through a temp directory that keeps no shard once unpinned and goes with the loader;
    nothing is written under cache.dir."""
    import gc

    from tests.test_loader import write_shards
    from workflows.config.storage import CacheConfig
    from workflows.loader import StreamLoader

    data = tmp_path / "data"
    data.mkdir()
    write_shards(lambda name, b: (data / name).write_bytes(b))
    cfg = CacheConfig(enabled=False, dir=str(tmp_path / "cache"))
    loader = StreamLoader(str(data), LOCAL, cfg, batch_size=8, num_workers=0)
    assert sum(len(b["sample"]) for b in loader) == len(loader.index)
    transient = loader.cache.dir
    assert not (tmp_path / "cache").exists()
    assert len(list(transient.glob("*.data"))) <= loader.peak_pinned_shards  # none kept beyond those last read
    loader.close()
    del loader
    gc.collect()
    assert not transient.exists()
