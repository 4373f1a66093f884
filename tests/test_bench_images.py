"""`python -m benchmarks.images` on a tiny set: our rows run for real against the embedded endpoint,
the store's counters say the cold epoch read the set once and the warm one nothing; the report
renders from what was stored. (The peers need their own venv, `make bench-peers`: a run without it
reports their rows as failed, which is checked too.)"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

FIXTURES = Path(__file__).parent / "fixtures"


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -m benchmarks.images ARGS` from the repository root, in a new process."""
    return subprocess.run([sys.executable, "-m", "benchmarks.images", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.extended  # the bench's own measurement rows
def test_bench_images_tiny_set(tmp_path):
    """Two interleaved repetitions of ours, ours on the set without index.json (the index build a row
    of its own, counted in our cold rate) and a peer without its venv."""
    results, doc = tmp_path / "results", tmp_path / "B.md"
    out = run_bench("--set", "bench.size=1200KB", "--set", "bench.shard_bytes=400KB",
                  "--set", "bench.rows=ours,ours_index,streaming", "--set", "bench.workers=1",
                  "--set", "bench.reps=2", "--set", f"bench.peers_python={tmp_path}/none",
                  "--set", f"bench.scratch={tmp_path}", "--results-dir", str(results), "--doc", str(doc),
                  timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((results / "images.json").read_text())
    s = r["set"]
    assert s["shards"] == 3 and s["bytes"] <= 1_200_000 and s["images"] >= 6
    cold, warm = r["rows"]["ours"]["ours_cold"], r["rows"]["ours"]["ours_warm"]
    assert cold["images"] == warm["images"] == s["images"]  # every sample once per epoch
    assert cold["samples"]["exactly_once"] and warm["samples"]["exactly_once"]
    assert cold["store_get_bytes"] >= s["bytes"]  # the shards, whole, plus index.json
    assert cold["store_get_bytes"] < s["bytes"] + 10_000
    assert warm["store_get_bytes"] == 0
    assert cold["cache"]["misses"] == 3 and warm["images_per_s"] > 0
    assert 0 < cold["peak_pss_bytes"] <= cold["peak_rss_bytes"]
    # two repetitions, each with its own figure and load; the row's figure is one of them
    assert r["repetitions"] == 2 and len(cold["reps"]) == 2 and all(x["load_1min"] > 0 for x in cold["reps"])
    assert cold["images_per_s"] in [x["images_per_s"] for x in cold["reps"]]
    assert "ours_end" not in r["rows"]  # repetitions interleave the rows instead
    build, first = r["rows"]["ours_index"]["ours_index_build"], r["rows"]["ours_index"]["ours_cold_after_index"]
    assert build["images"] == first["images"] == s["images"] and build["shards"] == 3
    assert build["store_get_bytes"] >= s["bytes"]  # no index.json: every shard read to index it
    assert first["samples"]["exactly_once"]
    assert r["cold_includes_index_build"] is True
    assert r["ours_cold_images_per_s"] == round(first["images"] / (build["seconds"] + first["seconds"]), 1)
    assert r["rows"]["streaming"]["error"].startswith(f"bench.peers_python={tmp_path}/none: not found")
    assert r["warm_vs_best_peer"] is None and r["goals_met"]["warm_vs_best_peer"] is False
    text = doc.read_text()
    assert "## Images: a training loop's input pipeline" in text and "ours, warm" in text
    assert "ours: index build, a set without index.json" in text and "Every row ran 2 times" in text
    assert r["persist"]["bytes_on_disk"] >= s["bytes"]
    assert not list(tmp_path.glob("workflows-bench-images-*"))  # the scratch dir is gone


@pytest.mark.extended  # the bench's own measurement rows
def test_bench_images_training_rows_tiny(tmp_path):
    """The training rows on a tiny set, one repetition: a real Ray Train run per row (pooled_linear,
    two epochs, batches of 2), images/s into the step of its warm epoch after the first step; the
    ray_data row's preprocessing timed as its conversion; the ratio over ours, warm, which brackets
    them (one repetition: ours again at the end). A row that yields no step after its first fails."""
    results, doc = tmp_path / "results", tmp_path / "B.md"
    out = run_bench("--set", "bench.size=2400KB", "--set", "bench.shard_bytes=800KB",
                  "--set", "bench.rows=ours,train_ray_data,train_stream", "--set", "bench.workers=1",
                  "--set", "bench.batch=2", "--set", "bench.reps=1", "--set", "bench.classes=4",
                  "--set", f"bench.scratch={tmp_path}", "--results-dir", str(results), "--doc", str(doc),
                  timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((results / "images.json").read_text())
    rows = r["rows"]
    assert "error" not in rows["train_stream"] and "error" not in rows["train_ray_data"], rows
    stream, ray_data = rows["train_stream"]["train_stream"], rows["train_ray_data"]["train_ray_data"]
    for f in (stream, ray_data):
        # the train split of the set, every image once in the measured epoch, several steps after the first
        assert 0 < f["images"] < r["set"]["images"] and f["steps"] >= 3 and f["images_per_s"] > 0
        assert f["cold_epoch"]["images"] == f["images"] and f["first_batch_s"] > 0
        assert f["model"] == "pooled_linear" and f["peak_pss_bytes"] > 0
        assert f["images_per_s"] in [x["images_per_s"] for x in f["reps"]]
    assert stream["loader"] == "stream" and stream["image_input"] == "raw" and stream["loader_workers"] == 1
    assert ray_data["loader"] == "ray_data" and ray_data["image_input"] == "pixels"
    assert "1 decode process(es)" in stream["label"] and "loader ray_data" in ray_data["label"]
    assert rows["train_ray_data"]["train_ray_data_preprocess"]["seconds"] > 0
    warm = (rows["ours"]["ours_warm"]["images_per_s"] + rows["ours_end"]["ours_warm_end"]["images_per_s"]) / 2
    assert r["train_step_vs_loader"] == round(stream["images_per_s"] / warm, 3)
    assert r["ray_data_train_step_vs_loader"] == round(ray_data["images_per_s"] / warm, 3)
    assert r["goals_met"]["train_step_vs_loader"] == (r["train_step_vs_loader"] >= 0.9)
    text = doc.read_text()
    assert stream["label"] in text and ray_data["label"] in text and "`train_step_vs_loader`" in text
    assert "The training rows (`benchmarks.images_train`) are real training runs" in text


def test_a_training_row_without_steady_steps_is_an_error_not_a_zero():
    """A training run whose measured epoch had a single step (a set smaller than two batches) has no
    steady rate: the row fails and says why, rather than reporting 0 or the start-up-bound rate."""
    from benchmarks.images_train import summarize

    epoch = {"samples": 2, "steps": 1, "samples_per_s": 5.0, "samples_after_first_step": 0,
             "samples_per_s_after_first_step": 0.0, "first_step_seconds": 0.4, "epoch_seconds": 0.4,
             "data_wait_seconds": 0.3}
    opts = {"workers": "1"}
    with pytest.raises(RuntimeError, match="no step after its first .*smaller bench.batch"):
        summarize("train_stream", {"history": [epoch, epoch]}, 9.0, {}, opts)
    with pytest.raises(RuntimeError, match="1 epoch"):
        summarize("train_stream", {"history": [epoch]}, 9.0, {}, opts)
    steady = {**epoch, "samples": 6, "steps": 3, "samples_after_first_step": 4, "samples_per_s_after_first_step": 8.0}
    got = summarize("train_ray_data", {"history": [steady, steady]}, 9.0, {}, opts)
    assert got["images_per_s"] == 8.0 and got["images_per_s_whole_pass"] == 5.0 and got["images"] == 6
    assert got["loader"] == "ray_data" and "loader ray_data" in got["label"]


def test_rows_rotate_per_repetition():
    """Each repetition starts one row later; decode stays right after local (it reads local's files)."""
    from benchmarks.images import rotated

    rows = ["ours", "train_stream", "local", "decode", "train_ray_data"]
    assert rotated(rows, 0) == rows
    assert rotated(rows, 1) == ["train_stream", "local", "decode", "train_ray_data", "ours"]
    assert rotated(rows, 2) == ["local", "decode", "train_ray_data", "ours", "train_stream"]
    assert rotated(rows, 4) == rows  # four groups: local and decode are one
    assert [rotated(rows, k)[0] for k in range(4)] == ["ours", "train_stream", "local", "train_ray_data"]


def test_bench_images_bad_option():
    from benchmarks.images import _options
    from workflows.errors import UserError

    with pytest.raises(UserError, match="bench.sizes: unknown option of bench images"):
        _options(["bench.sizes=1GB"])
    with pytest.raises(UserError, match="unknown row"):
        _options(["bench.rows=ours,mine"])
    with pytest.raises(UserError, match="bench.reps='0': a positive number of repetitions"):
        _options(["bench.reps=0"])
    opts, _ = _options(["bench.rows=train_stream,train_ray_data"])
    assert opts["rows"] == ("train_stream", "train_ray_data")
    opts, rest = _options(["bench.rows=ours", "cache.max_bytes=5"])
    assert opts["rows"] == ("ours",) and rest == ["cache.max_bytes=5"]


@pytest.mark.extended  # the bench's own measurement rows
def test_bench_images_scale_tiny(tmp_path):
    """The scale curve on two tiny sizes, each set painted whole (every image distinct), each epoch
    whole (no image cap), batches of 2 over 200 KB shards so that the cache capped below every set
    evicts: every image once by sample id, the cache's peak disk measured and judged against the cap
    plus one shard per decode process, `largest_set_bytes` what an epoch streamed, the plot written."""
    results, doc = tmp_path / "results", tmp_path / "B.md"
    out = run_bench("--tag", "scale", "--set", "bench.scale=1200KB,2400KB",
                  "--set", "bench.shard_bytes=200KB", "--set", "bench.scale_cache_bytes=900KB",
                  "--set", "bench.batch=2", "--set", "bench.workers=1", "--set", f"bench.scratch={tmp_path}",
                  "--set", f"bench.plot={tmp_path}/scale.png",
                  "--results-dir", str(results), "--doc", str(doc), timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "scale.png").read_bytes()[:4] == b"\x89PNG"
    r = json.loads((results / "images-scale.json").read_text())
    small, large = r["points"]
    assert r["max_images"] is None and r["painted"] is None  # no cap; no shared painted base to copy
    for p, size in ((small, 1_200_000), (large, 2_400_000)):  # painted up to the size, in 200 KB shards
        assert p["set"]["shards"] == size // 200_000 and p["set"]["bytes"] <= size
        assert p["painted"]["distinct"] and p["painted"]["seconds"] > 0
    for p in (small, large):
        cold = p["ours_cold"]
        assert cold["images"] == p["set"]["images"] == cold["samples"]["distinct"]  # the whole epoch
        assert cold["samples"] == {"set": p["set"]["images"], "distinct": p["set"]["images"], "repeated": 0,
                                   "missing": 0, "exactly_once": True}
        assert p["whole_epoch"] and p["streamed_bytes"] == p["set"]["bytes"]
        assert cold["store_get_bytes"] >= p["set"]["bytes"] and cold["cache"]["misses"] >= p["set"]["shards"]
        assert p["cache_disk_limit"] == 900_000 + p["set"]["shard_bytes_max"]  # one decode process
        # the cache held at least one shard, and never more than the whole set (plus block rounding)
        assert p["set"]["shard_bytes_max"] <= cold["peak_cache_disk_bytes"] <= p["set"]["bytes"] + 100_000
        # what the loader pinned at most at once: at least a shard, at most the set
        assert p["set"]["shard_bytes_max"] <= cold["cache"]["peak_pinned_bytes"] <= p["set"]["bytes"]
    assert large["ours_cold"]["cache"]["evictions"] > 0  # the cap below the set made it evict
    assert r["goals_met"]["exactly_once"]
    assert r["goals_met"]["cache_disk_bytes"] == all(
        p["ours_cold"]["peak_cache_disk_bytes"] <= p["cache_disk_limit"] for p in (small, large))
    assert r["largest_set_bytes"] == large["set"]["bytes"]
    text = doc.read_text()
    assert "## Images: cost as the data grows (scale)" in text and "whole, each of" in text
    assert "every image distinct, painted by synth-images" in text


def _recorded(name: str) -> dict:
    """Results recorded from a real run (peers included: rows this machine cannot rerun without
    their venv); kept as fixtures so that a new run's results do not change these tests."""
    return json.loads((FIXTURES / name).read_text())


def test_ratios_on_recorded_peer_rows():
    """The ratio and summary code fed a real run's rows (all five peers, #39 item 7c): each ratio is
    ours over the best peer of its kind; WebDataset, which has no cache, is never a warm peer."""
    from benchmarks.images import _ratios
    from benchmarks.images_report import markdown

    r = _recorded("bench-images-peers.json")
    rows = r["rows"]

    def ips(row, phase):
        return rows[row][phase]["images_per_s"]

    got = _ratios(rows)
    warm = (ips("ours", "ours_warm") + ips("ours_end", "ours_warm_end")) / 2  # one repetition: bracketed
    warm_peers = {"streaming": ips("streaming", "streaming_warm"), "litdata": ips("litdata", "litdata_warm")}
    cold_peers = {"streaming": ips("streaming", "streaming_cold"), "litdata": ips("litdata", "litdata_cold"),
                  "webdataset": ips("webdataset", "webdataset")}
    best_warm, best_cold = max(warm_peers, key=warm_peers.get), max(cold_peers, key=cold_peers.get)
    assert got["best_peer_warm"] == best_warm and got["best_peer_cold"] == best_cold
    assert got["warm_vs_best_peer"] == round(warm / warm_peers[best_warm], 3)
    assert got["cold_vs_best_peer"] == round(ips("ours", "ours_cold") / cold_peers[best_cold], 3)
    assert got["warm_vs_local_dataloader"] == round(warm / ips("local", "local_dataloader"), 3)
    assert got["two_workers_vs_one"] == round(ips("ours2", "ours_2_workers") / warm, 3)
    assert got["cold_includes_index_build"] is False
    assert got["goals_met"]["warm_vs_best_peer"] == (got["warm_vs_best_peer"] >= 1.0)

    # the warm peers failed: WebDataset's uncached pass does not stand in for them
    no_warm = {k: v for k, v in copy.deepcopy(rows).items() if k not in ("streaming", "litdata")}
    alone = _ratios(no_warm)
    assert alone["best_peer_warm"] is None and alone["warm_vs_best_peer"] is None
    assert alone["best_peer_cold"] == "webdataset"
    assert alone["goals_met"]["warm_vs_best_peer"] is False

    text = markdown({**r, **got})
    assert "| WebDataset, tars streamed from S3, no cache | " in text
    assert "counts as cold only" in text and "| MosaicML Streaming, warm | " in text


def test_median_of_repetitions():
    """Interleaved repetitions -> each phase the median repetition's figures, every repetition's rate
    and load kept beside; a repetition's failure is named."""
    from benchmarks.images import median_row

    ours = _recorded("bench-images-peers.json")["rows"]["ours"]
    reps = []
    for scale, load in ((0.5, 7.9), (1.0, 3.1), (1.5, 2.2)):  # the median neither first nor last
        reps.append({ph: {**f, "images_per_s": round(f["images_per_s"] * scale, 1), "load_1min": load}
                     for ph, f in ours.items()})
    row = median_row(reps)
    assert row["ours_warm"]["images_per_s"] == ours["ours_warm"]["images_per_s"]  # the middle one
    assert row["ours_warm"]["load_1min"] == 3.1
    assert [x["load_1min"] for x in row["ours_cold"]["reps"]] == [7.9, 3.1, 2.2]
    assert "error" not in row
    failed = median_row([reps[0], {"error": "exit [1]: boom"}, reps[2]])
    assert failed["error"] == "repetition 2: exit [1]: boom" and len(failed["ours_warm"]["reps"]) == 2
    assert median_row([{"error": "no peers venv"}] * 3) == {"error": "no peers venv"}


def test_scale_counts_only_what_an_epoch_streamed():
    """A recorded scale run whose epochs were capped at 20000 images (the 5 GB and 27 GB points read
    the same images): `largest_set_bytes` is what an epoch read, not the set painted, and no capped
    point passes as a whole epoch."""
    from benchmarks.images_report import markdown
    from benchmarks.images_scale import summarize

    r = _recorded("bench-images-scale-capped.json")
    largest = max(p["set"]["bytes"] for p in r["points"])
    got = summarize(r["points"])
    assert not any(p["whole_epoch"] for p in r["points"])  # no sample-id check recorded: not shown whole
    for p in r["points"]:
        read = min(p["ours_cold"]["images"], p["set"]["images"]) / p["set"]["images"]
        assert p["streamed_bytes"] == int(p["set"]["bytes"] * read)
    assert got["largest_set_bytes"] < largest / 5  # 27 GB painted, about 2 GB streamed
    assert got["goals_met"]["exactly_once"] is False and got["goals_met"]["cache_disk_bytes"] is False
    text = markdown({**r, **got})
    assert f"**each epoch capped at its first {r['max_images']} images**" in text
    assert text.count("| **partial**: ") == 2  # the 5 GB and 27 GB points; the 1 GB set has fewer images


def test_cache_disk_counts_open_evicted_files(tmp_path):
    """An evicted (unlinked) cache file that a process still holds open stays on disk: the scale
    curve's disk figure counts it for that process, once, and not once it is closed."""
    import os

    from benchmarks.images_proc import cache_disk_bytes

    kept, evicted = tmp_path / "kept.data", tmp_path / "evicted.data"
    kept.write_bytes(b"k" * 200_000)
    evicted.write_bytes(b"e" * 300_000)
    on_disk = {f: os.stat(f).st_blocks * 512 for f in (kept, evicted)}
    assert cache_disk_bytes(str(tmp_path), []) == on_disk[kept] + on_disk[evicted]
    with open(evicted, "rb"), open(evicted, "rb"):  # open twice: one inode, counted once
        evicted.unlink()
        assert cache_disk_bytes(str(tmp_path), []) == on_disk[kept]  # what `du` sees
        assert cache_disk_bytes(str(tmp_path), [os.getpid()]) == on_disk[kept] + on_disk[evicted]
    assert cache_disk_bytes(str(tmp_path), [os.getpid()]) == on_disk[kept]
