"""The streaming loader (workflows/loader) on real tar shards: a local directory and the embedded S3
endpoint over HTTP, real decode processes."""

import io
import json
import logging
import re
import tarfile

import numpy as np
import pytest

from workflows.errors import UserError
from workflows.loader import (
    DatasetIndex,
    StreamLoader,
    epoch_order,
    parquet_index,
    rank_batches,
    read_index,
    step_bounds,
)
from workflows.loader.order import STAND_IN
from workflows.preprocess.images import ImageTransform
from workflows.storage.cache import ShardCache
from workflows.storage.embedded import EmbeddedS3
from workflows.storage.uri import StorageContext

LOCAL = StorageContext()
COUNTS = [13, 9, 11, 7, 12, 10]  # uneven shards: 62 samples
SIZE = 16  # decoded side: tiny, the tests are about ids and order


def _image(i: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(i)
    img = Image.fromarray(rng.integers(0, 255, (20 + i % 7, 24, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if i % 2 else "PNG")
    return buf.getvalue()


def _tar(samples: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, img, label in samples:
            for name, data in ((f"{key}.jpg", img), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_shards(put, with_index: bool = True, counts: list[int] = COUNTS) -> list[bytes]:
    """Shards `shard-00000k.tar` via `put(name, bytes)`; sample i has label i % 10."""
    shards, i = [], 0
    for n in counts:
        shards.append(_tar([(f"s{i + j:05d}", _image(i + j), (i + j) % 10) for j in range(n)]))
        i += n
    for k, data in enumerate(shards):
        put(f"shard-{k:06d}.tar", data)
    if with_index:
        index = {"format": "wds-tar", "version": 1, "classes": 10,
                 "shards": [{"name": f"shard-{k:06d}.tar", "samples": n, "bytes": len(d)}
                            for k, (n, d) in enumerate(zip(counts, shards))]}
        put("index.json", json.dumps(index).encode())
    return shards


@pytest.fixture
def local_data(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    write_shards(lambda name, data: (root / name).write_bytes(data))
    return str(root)


def loader(prefix, cache, **kw):
    kw.setdefault("num_workers", 0)
    kw.setdefault("batch_size", 4)
    return StreamLoader(prefix, LOCAL, cache, ImageTransform(size=SIZE, seed=kw.get("seed", 0)), **kw)


def global_sequence(prefix, cache, world_size, start=0, epoch=0, **kw) -> tuple[list[int], dict[int, bytes]]:
    """The ids of the epoch from `start`, by global position (step by step, rank by rank), as
    `world_size` ranks see them, and each sample's decoded pixels."""
    ranks = [list(loader(prefix, cache, rank=r, world_size=world_size, start=start, epoch=epoch, **kw))
             for r in range(world_size)]
    assert len({len(b) for b in ranks}) == 1, "every rank runs the same number of steps"
    ids, pixels = [], {}
    for step in zip(*ranks):
        for b in step:
            if b.get(STAND_IN):  # a rank with no sample left in the step: trains nothing
                assert len(b["sample"]) == 1 and sum(COUNTS) - start < world_size
                continue
            ids += b["sample"].tolist()
            for sid, img, label in zip(b["sample"].tolist(), b["image"], b["label"].tolist()):
                assert label == sid % 10 and img.shape == (3, SIZE, SIZE) and str(img.dtype) == "torch.uint8"
                pixels[sid] = img.numpy().tobytes()
    return ids, pixels


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_sample_exactly_once_per_epoch(local_data, tmp_path, world_size):
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    ids, _ = global_sequence(local_data, cache, world_size)
    assert sorted(ids) == list(range(sum(COUNTS)))
    # the sequence is the epoch order, whatever the world size
    assert ids == epoch_order(COUNTS, 0, 0, 4).tolist()


def test_decode_processes_give_the_same_batches(local_data, tmp_path):
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    inline = list(loader(local_data, cache, rank=1, world_size=2))
    procs = loader(local_data, cache, rank=1, world_size=2, num_workers=2)
    for _ in range(2):  # persistent worker processes serve a second pass
        batches = list(procs)
        assert len(batches) == len(inline)
        for a, b in zip(inline, batches):
            assert a["sample"].tolist() == b["sample"].tolist() and (a["image"] == b["image"]).all()
    procs.close()


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_resume_at_40_percent_on_another_worker_count(local_data, tmp_path, before, after):
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    full, full_pixels = global_sequence(local_data, cache, before, epoch=1)
    # a run killed at ~40%: its checkpoint stores the loader's state after the last step
    ranks = [loader(local_data, cache, rank=r, world_size=before, epoch=1) for r in range(before)]
    its = [iter(r) for r in ranks]
    steps = int(0.4 * len(ranks[0]))
    for _ in range(steps):
        for it in its:
            next(it)
    consumed = ranks[0].state()["consumed"]
    assert consumed == ranks[-1].state()["consumed"] == step_bounds(sum(COUNTS), 0, before, 4)[steps]
    assert 0.3 * sum(COUNTS) < consumed < 0.5 * sum(COUNTS)
    rest, rest_pixels = global_sequence(local_data, cache, after, start=consumed, epoch=1)
    assert rest == full[consumed:]  # the same samples in the same order
    assert all(rest_pixels[i] == full_pixels[i] for i in rest)  # and the same crops


def lockstep(n: int, start: int, world_size: int, batch_size: int) -> list[int]:
    """The positions trained by `world_size` ranks planned from `start`, as the ranks run in step
    (loop.in_step: as many steps as the rank with fewest batches), stand-ins left out."""
    plans = [rank_batches(n, start, world_size, r, batch_size) for r in range(world_size)]
    steps = min(len(p) for p in plans)
    assert all(len(p) == steps for p in plans), "a rank would stop the others early"
    trained = []
    for r, plan in enumerate(plans):
        for b in plan:
            assert b.hi > b.lo, f"rank {r} of {world_size} has no batch in a step from {start}"
            assert start <= b.lo and b.hi <= n
            trained += [] if b.stand_in else list(range(b.lo, b.hi))
    return trained


@pytest.mark.parametrize("n", [1, 2, 5, 10, 13])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
def test_an_elastic_resume_at_any_position_trains_each_sample_once(n, batch_size):
    """A run on `before` workers stopped at any step, resumed on more or fewer (or at any position
    at all): the rest of the epoch is trained exactly once, every rank in every step (#51: a resume
    at 8 of 10 on 3 workers gave rank 0 nothing, so no rank trained the last 2 samples)."""
    for before in (1, 2, 3):
        for stop in step_bounds(n, 0, before, batch_size).tolist():
            for after in (1, 2, 3, 4, 6):
                trained = lockstep(n, stop, after, batch_size)
                assert sorted(trained) == list(range(stop, n)), (before, stop, after)
    for start in range(n + 1):  # any position, not only a step's end
        for world_size in (1, 2, 3, 5, 8, 16):
            assert sorted(lockstep(n, start, world_size, batch_size)) == list(range(start, n)), (start, world_size)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_resume_at_an_epochs_end_on_more_workers_reads_each_sample_once(local_data, tmp_path, world_size):
    """The loader itself, near the epoch's end on more ranks than samples left: every rank yields a
    batch per step, the stand-ins are marked, and the remaining samples come once each, in order."""
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    full = epoch_order(COUNTS, 0, 1, 4).tolist()
    n = sum(COUNTS)
    for start in range(n - world_size - 1, n + 1):
        rest, _ = global_sequence(local_data, cache, world_size, start=start, epoch=1)
        assert rest == full[start:], start


def test_orders_differ_by_epoch_and_seed_and_repeat_for_the_same(local_data, tmp_path):
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    e0, _ = global_sequence(local_data, cache, 1, epoch=0)
    assert global_sequence(local_data, cache, 1, epoch=0)[0] == e0
    assert global_sequence(local_data, cache, 1, epoch=1)[0] != e0
    assert global_sequence(local_data, cache, 1, epoch=0, seed=1)[0] != e0
    # the shuffle window: with window 1 the samples of a shard stay together
    w1 = epoch_order(COUNTS, 0, 0, 1)
    offsets = np.cumsum([0, *COUNTS])
    shard_of = np.searchsorted(offsets, w1, side="right") - 1
    assert (np.diff(shard_of) != 0).sum() == len(COUNTS) - 1


def test_the_loader_imports_torch_when_built_so_a_cold_epoch_fetches_at_once(local_data, tmp_path):
    """A cold epoch's first downloads start when the DataLoader first asks the batch sampler. Were
    torch imported only then (about 1 s), they would start that much later (#37): building the
    loader imports it, in a fresh interpreter as a script's first epoch has."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from workflows.loader import StreamLoader\n"
        "from workflows.storage.cache import ShardCache\n"
        "from workflows.storage.uri import StorageContext\n"
        "assert 'torch' not in sys.modules, 'imported before the loader is built: this test checks nothing'\n"
        f"StreamLoader({local_data!r}, StorageContext(), ShardCache({str(tmp_path / 'c')!r}, StorageContext()),"
        " num_workers=0)\n"
        "assert 'torch.utils.data' in sys.modules, 'built without importing torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


class _CollectingTransform:
    """A decode process's transform that runs a full collection first, as a busy worker soon does."""

    def __call__(self, data: bytes, sample: int, epoch: int):
        import gc

        gc.collect()
        return np.zeros((3, SIZE, SIZE), np.uint8)


def test_decode_processes_do_not_finalize_the_parents_garbage(local_data, tmp_path):
    """A forked decode process must not run the finalizers of garbage it inherited: s3fs's waited on
    the parent's event loop, stalling each new worker about 1.2 s (#37). Here a reference cycle that
    is garbage at the fork records which process finalizes it."""
    import gc
    import os
    import weakref

    class Node:
        pass

    record = tmp_path / "finalized"

    def finalized(path=str(record)):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")

    node = Node()
    node.self = node  # a cycle: only a collection frees it
    weakref.finalize(node, finalized)
    del node
    gc.disable()  # kept uncollected until the fork, where the decode processes' collections would find it
    try:
        reader = StreamLoader(local_data, LOCAL, ShardCache(str(tmp_path / "c"), LOCAL), _CollectingTransform(),
                              batch_size=8, num_workers=2)
        batches = iter(reader)
        next(batches)
    finally:
        gc.enable()
    assert sum(len(b["sample"]) for b in batches) + 8 == sum(COUNTS)
    reader.close()
    gc.collect()
    assert record.read_text().split() == [str(os.getpid())]  # the parent's collection, and only it


def test_s3_cold_then_warm_reads_nothing_from_the_store(tmp_path):
    with EmbeddedS3(str(tmp_path / "s3")) as s3:
        s3.ensure_bucket("imgs")
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        client = ctx.boto3_client()
        shards = write_shards(lambda name, data: client.put_object(Bucket="imgs", Key=f"ds/{name}", Body=data))
        cold = StreamLoader("s3://imgs/ds", ctx, ShardCache(str(tmp_path / "cache"), ctx),
                            ImageTransform(size=SIZE), batch_size=8, num_workers=0)
        ids = [i for b in cold for i in b["sample"].tolist()]
        assert sorted(ids) == list(range(sum(COUNTS)))
        assert cold.stats()["bytes_from_store"] == sum(len(s) for s in shards)
        warm = StreamLoader("s3://imgs/ds", ctx, ShardCache(str(tmp_path / "cache"), ctx),
                            ImageTransform(size=SIZE), batch_size=8, num_workers=0, epoch=1)
        assert sorted(i for b in warm for i in b["sample"].tolist()) == list(range(sum(COUNTS)))
        stats = warm.stats()
        assert stats["bytes_from_store"] == 0 and stats["misses"] == 0 and stats["hits"] == len(COUNTS)


def test_an_index_is_built_when_the_prefix_has_none(tmp_path, caplog):
    root = tmp_path / "data"
    root.mkdir()
    write_shards(lambda name, data: (root / name).write_bytes(data), with_index=False)
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    with caplog.at_level(logging.WARNING):
        index = read_index(str(root), LOCAL, cache)
    assert index.counts == COUNTS and "building one from the tar headers" in caplog.text
    assert all(s.version for s in index.shards)  # from the listing, as the cache keys them
    saved = json.loads((root / "index.json").read_text())  # saved beside the shards, for the next run
    assert [s["samples"] for s in saved["shards"]] == COUNTS
    assert [s["bytes"] for s in saved["shards"]] == [(root / s["name"]).stat().st_size for s in saved["shards"]]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_index(str(root), LOCAL, cache).counts == COUNTS
    assert "building" not in caplog.text  # reused
    # the set changes (the last shard loses samples): the saved index no longer matches, and is rebuilt
    (root / "shard-000005.tar").write_bytes(_tar([(f"t{j}", _image(j), j % 10) for j in range(3)]))
    with caplog.at_level(logging.WARNING):
        assert read_index(str(root), LOCAL, cache).counts == [*COUNTS[:-1], 3]
    assert "a stale index.json" in caplog.text
    assert json.loads((root / "index.json").read_text())["shards"][-1]["samples"] == 3


def test_a_raw_sample_index_reads_the_wanted_samples_bytes(local_data, tmp_path):
    """An image task's training split straight from the tars: the wanted keys' byte ranges (a bad
    sample in a shard skipped), read back as the exact image bytes, with the wanted labels."""
    from workflows.loader.index import sample_index
    from workflows.storage.shards import Shard

    root = tmp_path / "data"
    with tarfile.open(root / "shard-000006.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("bad.cls"), io.BytesIO(b""))  # a sample without an image member
    names = sorted(p.name for p in root.glob("*.tar"))
    shards = [Shard(str(root / n), (root / n).stat().st_size, "v") for n in names]
    starts = np.cumsum([0, *COUNTS])
    keys = {i: f"shard-{k:06d}.tar/s{i:05d}" for k in range(len(COUNTS)) for i in range(starts[k], starts[k + 1])}
    picked = [i for i in keys if i % 3 != 1]  # a subset, as a split is
    wanted = {keys[i]: 9 - i % 10 for i in picked}
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    index = sample_index(shards, "tar", wanted, LOCAL, cache)
    assert len(index) == len(picked) and index.format == "raw"
    again = DatasetIndex.from_json("", json.loads(json.dumps(index.to_json())))  # as saved and read back
    batches = list(StreamLoader(again, LOCAL, cache, None, batch_size=5, num_workers=0))
    got = {int(s): (d, int(lab)) for b in batches for s, d, lab in zip(b["sample"], b["data"], b["label"])}
    assert sorted(got) == list(range(len(picked)))
    assert {got[k] for k in got} == {(_image(i), 9 - i % 10) for i in picked}
    with pytest.raises(UserError, match="not parquet|parquet shards"):
        sample_index(shards, "parquet", wanted, LOCAL, cache)


def test_a_truncated_or_bad_shard_is_an_error_naming_it(local_data, tmp_path):
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    bad = f"{local_data}/shard-000002.tar"
    data = open(bad, "rb").read()
    open(bad, "wb").write(data[: len(data) // 2])
    with pytest.raises(UserError, match=re.escape(bad)):
        list(loader(local_data, cache))
    open(bad, "wb").write(b"not a tar at all" * 100)
    with pytest.raises(UserError, match=re.escape(bad)):
        list(loader(local_data, cache))


def test_index_errors_name_the_problem(local_data, tmp_path):
    with pytest.raises(UserError, match="lists no shards"):
        DatasetIndex(prefix=local_data, shards=[])
    index = read_index(local_data, LOCAL)
    wrong = DatasetIndex(prefix=local_data, shards=[*index.shards[:-1], index.shards[-1].__class__(
        index.shards[-1].name, 99)])
    with pytest.raises(UserError, match="index says 99"):
        list(StreamLoader(wrong, LOCAL, ShardCache(str(tmp_path / "c"), LOCAL), ImageTransform(size=SIZE),
                          num_workers=0))


def test_a_capped_cache_evicts_while_reading(local_data, tmp_path):
    biggest = max(len(open(f"{local_data}/shard-{k:06d}.tar", "rb").read()) for k in range(len(COUNTS)))
    cache = ShardCache(str(tmp_path / "cache"), LOCAL, max_bytes=3 * biggest)
    for epoch in range(2):
        ids, _ = global_sequence(local_data, cache, 1, epoch=epoch, shuffle_window=1, prefetch_shards=1)
        assert sorted(ids) == list(range(sum(COUNTS)))
        assert cache.cached_bytes() <= 3 * biggest
    assert cache.stats().evictions >= len(COUNTS)


def test_parquet_shards_rows_exactly_once_with_their_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.loader import parquet_index

    files, start = [], 0
    for k, n in enumerate([30, 17, 25]):
        path = tmp_path / f"part-{k}.parquet"
        rows = np.arange(start, start + n)
        pq.write_table(pa.table({"x": rows * 10, "label": rows % 3}), path, row_group_size=8)
        files.append(str(path))
        start += n
    index = parquet_index(files, LOCAL)
    assert index.counts == [30, 17, 25]
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    # each shard's version and size, as the cache keys its entry (which it then reads with no stat)
    assert [(s.version, s.bytes) for s in index.shards] == [cache.current_version(f) for f in files]
    assert DatasetIndex.from_json("", index.to_json()) == index  # and they round-trip through index.json
    seen = []
    for rank in range(2):
        for b in StreamLoader(index, LOCAL, cache, None, batch_size=5, num_workers=0, rank=rank, world_size=2,
                              columns=["x", "label"]):
            assert (b["x"] == b["sample"].numpy() * 10).all() and (b["label"] == b["sample"].numpy() % 3).all()
            seen += b["sample"].tolist()
    assert sorted(seen) == list(range(72))


def _disk_in_use(cache_dir, pids: list[int]) -> int:
    """Shard bytes the cache holds on disk now: its data files (and downloads in progress), plus
    files removed from it (evicted) that one of `pids` still holds open, which stay on disk until
    closed (read from /proc/<pid>/fd; one count per inode). Sidecars, locks and pointers (bytes
    each, and not what the cap counts) are left out."""
    import os

    held: dict[tuple[int, int], int] = {}
    for p in cache_dir.glob("*.data*"):
        try:
            st = p.stat()
        except FileNotFoundError:  # removed meanwhile
            continue
        held[(st.st_dev, st.st_ino)] = st.st_size
    prefix = f"{cache_dir}/"
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")  # "<path> (deleted)" once unlinked
                if target.startswith(prefix) and ".data" in target:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")  # the open inode itself
                    held[(st.st_dev, st.st_ino)] = st.st_size
            except FileNotFoundError:  # closed meanwhile
                continue
    return sum(held.values())


def _parquet_shards(root, counts: list[int]) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files, start = [], 0
    for k, n in enumerate(counts):
        rows = np.arange(start, start + n)
        path = root / f"part-{k}.parquet"
        noise = np.random.default_rng(k).integers(0, 255, (n, 2000), dtype=np.uint8)  # ~2 KB a row
        pq.write_table(pa.table({"x": rows, "blob": [r.tobytes() for r in noise]}), path, row_group_size=4)
        files.append(str(path))
        start += n
    return files


@pytest.mark.parametrize("fmt", ["wds-tar", "parquet"])
def test_a_cap_bounds_the_disk_with_evicted_files_counted(tmp_path, fmt):
    """Disk in use by the cache, evicted-but-open files included, stays within the cap plus the one
    download in flight of the loader's one fetch thread (prefetch_shards=1), over two epochs decoded
    by two processes; measured after every batch and after each epoch. The cap holds the pinned
    working set: with shuffle_window 1 and the 2 x 2 batches of 2 in flight (10 samples, under a
    shard of 12), at most two shards being read and the prefetched one."""
    import os

    import psutil

    from workflows.loader import parquet_index

    counts = [12] * 8
    if fmt == "parquet":
        source = parquet_index(_parquet_shards(tmp_path, counts), LOCAL)
        files = [s.name for s in source.shards]
        kw = {"columns": ["x"], "transform": None}
    else:
        root = tmp_path / "data"
        root.mkdir()
        write_shards(lambda name, data: (root / name).write_bytes(data), counts=counts)
        source = read_index(str(root), LOCAL)
        files = [f"{root}/{s.name}" for s in source.shards]
        kw = {"transform": ImageTransform(size=SIZE)}
    biggest = max(os.path.getsize(f) for f in files)
    cap = 3 * biggest
    cache_dir = tmp_path / "cache"
    cache = ShardCache(str(cache_dir), LOCAL, max_bytes=cap)
    reader = StreamLoader(source, LOCAL, cache, batch_size=2, num_workers=2, prefetch_factor=2, shuffle_window=1,
                          prefetch_shards=1, **kw)
    me = psutil.Process()

    def disk() -> int:
        return _disk_in_use(cache_dir, [me.pid] + [c.pid for c in me.children(recursive=True)])

    peak, seen = 0, []
    try:
        for epoch in range(2):
            reader.set_epoch(epoch)
            for b in reader:
                seen += b["sample"].tolist()
                peak = max(peak, disk())
            assert len(me.children(recursive=True)) >= 2, "the decode processes are up (and measured)"
            peak = max(peak, disk())  # between epochs, the persistent decode processes idle
    finally:
        reader.close()
    assert sorted(seen) == sorted(list(range(sum(counts))) * 2)
    assert cache.stats().evictions >= len(counts)  # the cap did evict, in both epochs
    assert peak <= cap + biggest, f"{peak} bytes on disk ({peak / biggest:.1f} shards) for a cap of 3 shards"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_pinned_peak_it_plans_is_what_it_pins_and_a_cap_below_it_is_named(local_data, tmp_path, caplog,
                                                                              num_workers):
    """A cap below the shards a loader must hold at once cannot bound the disk (pinned shards are
    never evicted): the loader computes that peak from its plan, never pins more, and says so."""
    sizes = [len(open(f"{local_data}/shard-{k:06d}.tar", "rb").read()) for k in range(len(COUNTS))]
    cache = ShardCache(str(tmp_path / "cache"), LOCAL, max_bytes=min(sizes))
    reader = loader(local_data, cache, num_workers=num_workers, prefetch_factor=2, shuffle_window=2,
                    prefetch_shards=1)
    most = 0
    try:
        with caplog.at_level(logging.WARNING, logger="workflows.loader.stream"):
            for _ in reader:
                with reader._lock:
                    most = max(most, sum(sizes[s] for s in reader._pins))
    finally:
        reader.close()
    assert 0 < most <= reader.peak_pinned_bytes, (most, reader.peak_pinned_bytes)
    assert reader.peak_pinned_bytes >= 2 * min(sizes)  # a shuffle window of 2 shards is pinned whole
    assert reader.stats()["peak_pinned_bytes"] == reader.peak_pinned_bytes
    warned = [r.getMessage() for r in caplog.records if "cache.max_bytes" in r.getMessage()]
    assert len(warned) == 1 and f"in {reader.peak_pinned_shards} shards" in warned[0]

    caplog.clear()
    roomy = ShardCache(str(tmp_path / "roomy"), LOCAL, max_bytes=reader.peak_pinned_bytes)
    again = loader(local_data, roomy, num_workers=num_workers, prefetch_factor=2, shuffle_window=2, prefetch_shards=1)
    with caplog.at_level(logging.WARNING, logger="workflows.loader.stream"):
        assert sorted(i for b in again for i in b["sample"].tolist()) == list(range(sum(COUNTS)))
    again.close()
    assert not [r for r in caplog.records if "cache.max_bytes" in r.getMessage()]


def _s3_dataset(s3, with_versions: bool):
    """The test shards under s3://imgs/ds with an index.json, its shards' versions recorded (as
    writers record them: object_version of the stored object) or not (an older index)."""
    from workflows.storage.transfer import object_version
    from workflows.storage.uri import filesystem

    s3.ensure_bucket("imgs")
    ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
    client = ctx.boto3_client()
    write_shards(lambda name, data: client.put_object(Bucket="imgs", Key=f"ds/{name}", Body=data), with_index=False)
    fs, _ = filesystem("s3://imgs/ds", ctx)
    shards = []
    for k, n in enumerate(COUNTS):
        info = fs.info(f"imgs/ds/shard-{k:06d}.tar")
        shards.append({"name": f"shard-{k:06d}.tar", "samples": n, "bytes": info["size"],
                       **({"version": object_version(info)} if with_versions else {})})
    client.put_object(Bucket="imgs", Key="ds/index.json",
                      Body=json.dumps({"format": "wds-tar", "version": 1, "shards": shards}).encode())
    return ctx


def _epoch(reader, epoch: int) -> list[int]:
    reader.set_epoch(epoch)
    return sorted(i for b in reader for i in b["sample"].tolist())


def test_a_warm_epoch_asks_the_store_nothing_and_runs_with_it_stopped(tmp_path):
    from workflows.storage.embedded import endpoint_traffic

    everything = list(range(sum(COUNTS)))
    s3 = EmbeddedS3(str(tmp_path / "s3"))
    s3.start()
    try:
        ctx = _s3_dataset(s3, with_versions=True)
        reader = StreamLoader("s3://imgs/ds", ctx, ShardCache(str(tmp_path / "cache"), ctx), ImageTransform(size=SIZE),
                              batch_size=8, num_workers=0)
        assert all(s.version for s in reader.index.shards)
        assert _epoch(reader, 0) == everything  # cold: fetches every shard
        endpoint_traffic(s3.endpoint_url, reset=True)
        assert _epoch(reader, 1) == everything
        # another loader over the same index (a new run, another rank): a cache it did not fill
        other = StreamLoader(reader.index, ctx, ShardCache(str(tmp_path / "cache"), ctx), ImageTransform(size=SIZE),
                             batch_size=8, num_workers=0, epoch=2)
        assert _epoch(other, 2) == everything
        assert endpoint_traffic(s3.endpoint_url)["requests"] == {}, "no HEAD, GET or LIST in a warm epoch"
    finally:
        s3.stop()
    for r in (reader, other):  # the store is down: the cached shards are all an epoch needs
        assert _epoch(r, 3) == everything
        assert r.stats()["hits"] >= 2 * len(COUNTS) and other.stats()["misses"] == 0


_WARM_EPOCH = """
import json, sys
from workflows.loader import StreamLoader, parquet_index
from workflows.preprocess.images import ImageTransform
from workflows.storage.cache import ShardCache
from workflows.storage.uri import StorageContext

endpoint, cache_dir, files = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ctx = StorageContext(endpoint_url=endpoint, region="us-east-1", embedded=True)
cache = ShardCache(cache_dir, ctx)
tars = StreamLoader("s3://imgs/ds", ctx, cache, ImageTransform(size=16), batch_size=8, num_workers=0, epoch=1)
rows = StreamLoader(parquet_index(files, ctx, cache), ctx, cache, batch_size=8, num_workers=0, columns=["v"], epoch=1)
print(json.dumps({"tars": sorted(i for b in tars for i in b["sample"].tolist()),
                  "rows": sorted(int(v) for b in rows for v in b["v"]), "misses": cache.stats().misses}))
"""


def test_a_new_process_runs_a_warm_epoch_with_the_store_stopped(tmp_path):
    """A new run on a node whose cache is warm, with the store down: the tar dataset's index (asked
    of the store, which does not answer) and a processed split's parquet footers come from the
    node's copies, the shards from the cache (before: the index's HEAD, GET and LIST and the
    footers' reads went to the store, and the run failed before its epoch)."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    s3 = EmbeddedS3(str(tmp_path / "s3"))
    s3.start()
    try:
        ctx = _s3_dataset(s3, with_versions=True)
        client = ctx.boto3_client()
        files = []
        for k, (lo, hi) in enumerate(((0, 30), (30, 50))):
            buf = io.BytesIO()
            pq.write_table(pa.table({"v": list(range(lo, hi))}), buf)
            client.put_object(Bucket="imgs", Key=f"processed/v1/part-{k}.parquet", Body=buf.getvalue())
            files.append(f"s3://imgs/processed/v1/part-{k}.parquet")
        cache = ShardCache(str(tmp_path / "cache"), ctx)  # a first run fills the node's cache
        assert _epoch(StreamLoader("s3://imgs/ds", ctx, cache, ImageTransform(size=SIZE), num_workers=0), 0) \
            == list(range(sum(COUNTS)))
        rows = StreamLoader(parquet_index(files, ctx, cache), ctx, cache, num_workers=0, columns=["v"])
        assert sorted(int(v) for b in rows for v in b["v"]) == list(range(50))
    finally:
        s3.stop()
    done = subprocess.run([sys.executable, "-c", _WARM_EPOCH, s3.endpoint_url, str(tmp_path / "cache"),
                           json.dumps(files)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"tars": list(range(sum(COUNTS))), "rows": list(range(50)), "misses": 0}
    assert "cannot reach s3://imgs/ds/index.json" in done.stderr  # said, then the node's copy read


def test_an_index_without_versions_asks_the_store_once_per_shard(tmp_path, caplog):
    from workflows.storage.embedded import endpoint_traffic

    everything = list(range(sum(COUNTS)))
    with EmbeddedS3(str(tmp_path / "s3")) as s3:
        ctx = _s3_dataset(s3, with_versions=False)

        def reader():  # each with its own cache object (its own counters), on one cache directory
            cache = ShardCache(str(tmp_path / "cache"), ctx)
            return StreamLoader("s3://imgs/ds", ctx, cache, ImageTransform(size=SIZE), num_workers=0)

        assert _epoch(reader(), 0) == everything
        with caplog.at_level(logging.WARNING):
            warm = reader()
        assert "has no version for 6 of its 6 shards" in caplog.text
        endpoint_traffic(s3.endpoint_url, reset=True)
        assert _epoch(warm, 1) == everything
        assert endpoint_traffic(s3.endpoint_url)["requests"] == {"HEAD": len(COUNTS)}
        endpoint_traffic(s3.endpoint_url, reset=True)
        assert _epoch(warm, 2) == everything  # later epochs: the versions asked once are kept
        assert endpoint_traffic(s3.endpoint_url)["requests"] == {}
        assert warm.stats()["misses"] == 0


def _parquet_images(root, with_key: bool, counts=(13, 9, 11)) -> tuple[list, dict[int, tuple[int, int, str]]]:
    """Parquet files `part-k.parquet` of encoded images (`png`: the originals, 20-26 x 24 pixels) and
    labels (`digit`), row groups of 4, with a `key` column or not; then a row repeating sample 0's
    image (and key) without a label: a bad record of a training sample's key. Returns the shards
    and, per sample, (file, row, key) with the key as preprocessing names it."""
    import hashlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.storage.shards import Shard

    shards, where, i = [], {}, 0
    for k, n in enumerate(counts):
        ids = list(range(i, i + n))
        cols = {"png": [_image(j) for j in ids], "digit": [str(j % 10) for j in ids]}
        if k == 1:
            cols["png"].append(_image(0))
            cols["digit"].append(None)
        keys = [f"k{j:05d}" if with_key else hashlib.sha256(_image(j)).hexdigest()[:16] for j in ids]
        if with_key:
            cols["key"] = keys + ["k00000"] * (k == 1)
        path = root / f"part-{k}.parquet"
        pq.write_table(pa.table(cols), path, row_group_size=4)
        shards.append(Shard(str(path), path.stat().st_size, "v"))
        where.update({j: (k, r, key) for r, (j, key) in enumerate(zip(ids, keys))})
        i += n
    return shards, where


@pytest.mark.parametrize("with_key", [False, True])
def test_a_raw_parquet_index_reads_the_training_rows_original_images(tmp_path, with_key):
    """model.options.image_input=raw over parquet (image bytes in a column): the rows whose keys the train
    split names (the `key` column, else the image's hash, as preprocessing keys them), each exactly
    once per epoch with the train split's class ids and its original bytes; crops of the original
    image that follow (seed, epoch, sample): the same on 2 ranks with 2 decode processes, on 1 rank
    inline, and resumed mid-epoch on 1 rank."""
    from workflows.preprocess.image_dataset import parquet_sample_index

    shards, where = _parquet_images(tmp_path, with_key)
    picked = [i for i in where if i % 3 != 1]  # the train split: a subset (0 among it, see _parquet_images)
    wanted = {where[i][2]: 9 - i % 10 for i in picked}
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    built = parquet_sample_index(shards, "png", "digit", wanted, cache)
    index = DatasetIndex.from_json("", json.loads(json.dumps(built.to_json())))  # as saved and read back
    assert index.format == "raw-parquet" and index.column == "png" and len(index) == len(picked)
    got = {int(s): (d, int(lab)) for b in StreamLoader(index, LOCAL, cache, None, batch_size=5, num_workers=0)
           for s, d, lab in zip(b["sample"], b["data"], b["label"])}
    assert sorted(got) == list(range(len(picked)))
    assert sorted(got.values()) == sorted((_image(i), 9 - i % 10) for i in picked)

    transform = ImageTransform(size=SIZE, seed=3)
    original = {s: d for s, (d, _) in got.items()}

    def epoch(world_size, num_workers, start=0):
        ids, pixels = [], {}
        ranks = [StreamLoader(index, LOCAL, cache, transform, batch_size=4, num_workers=num_workers, seed=3, epoch=1,
                              rank=r, world_size=world_size, start=start) for r in range(world_size)]
        for step in zip(*ranks):
            for b in step:
                ids += b["sample"].tolist()
                pixels.update(zip(b["sample"].tolist(), (x.numpy().tobytes() for x in b["image"])))
        for r in ranks:
            r.close()
        return ids, pixels

    two, two_pixels = epoch(2, 2)
    one, one_pixels = epoch(1, 0)
    assert two == one and sorted(one) == list(range(len(picked)))
    assert one_pixels == two_pixels
    assert all(one_pixels[s] == transform(original[s], s, 1).tobytes() for s in one)  # a crop of the original
    rest, rest_pixels = epoch(1, 0, start=12)
    assert rest == one[12:] and all(rest_pixels[s] == one_pixels[s] for s in rest)


def test_a_raw_parquet_index_names_a_missing_column_and_its_file(tmp_path):
    from workflows.preprocess.image_dataset import parquet_sample_index

    shards, where = _parquet_images(tmp_path, with_key=True)
    wanted = {key: 0 for _, _, key in where.values()}
    cache = ShardCache(str(tmp_path / "cache"), LOCAL)
    with pytest.raises(UserError, match=r"part-0\.parquet: no column 'image' \(model\.options\.image_column\)"):
        parquet_sample_index(shards, "image", "digit", wanted, cache)
    with pytest.raises(UserError, match=r"part-0\.parquet: no column 'label' \(data\.label_column\)"):
        parquet_sample_index(shards, "png", "label", wanted, cache)
