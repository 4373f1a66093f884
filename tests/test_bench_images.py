"""`workflows bench images` on a tiny set: our rows run for real against the embedded endpoint,
the store's counters say the cold epoch read the set once and the warm one nothing; the report
renders from what was stored. (The peers need their own venv, `make bench-peers`: a run without it
reports their rows as failed, which is checked too.)"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli


@pytest.mark.slow
def test_bench_images_tiny_set(tmp_path):
    results, doc = tmp_path / "results", tmp_path / "B.md"
    out = run_cli("bench", "images", "--set", "bench.size=1200KB", "--set", "bench.shard_bytes=400KB",
                  "--set", "bench.rows=ours,streaming", "--set", "bench.workers=1",
                  "--set", f"bench.peers_python={tmp_path}/none",
                  "--set", f"bench.scratch={tmp_path}", "--results-dir", str(results), "--doc", str(doc),
                  timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((results / "images.json").read_text())
    s = r["set"]
    assert s["shards"] == 3 and s["bytes"] <= 1_200_000 and s["images"] >= 6
    cold, warm = r["rows"]["ours"]["ours_cold"], r["rows"]["ours"]["ours_warm"]
    assert cold["images"] == warm["images"] == s["images"]  # every sample once per epoch
    assert cold["store_get_bytes"] >= s["bytes"]  # the shards, whole, plus index.json
    assert cold["store_get_bytes"] < s["bytes"] + 10_000
    assert warm["store_get_bytes"] == 0
    assert cold["cache"]["misses"] == 3 and warm["images_per_s"] > 0
    assert 0 < cold["peak_pss_bytes"] <= cold["peak_rss_bytes"]
    assert r["rows"]["streaming"]["error"].startswith(f"bench.peers_python={tmp_path}/none: not found")
    assert r["warm_vs_best_peer"] is None and r["goals_met"]["warm_vs_best_peer"] is False
    text = doc.read_text()
    assert "## Images: a training loop's input pipeline" in text and "ours, warm" in text
    assert r["persist"]["bytes_on_disk"] >= s["bytes"]
    assert not list(tmp_path.glob("workflows-bench-images-*"))  # the scratch dir is gone


def test_bench_images_bad_option():
    from workflows.bench.images import _options
    from workflows.errors import UserError

    with pytest.raises(UserError, match="bench.sizes: unknown option of bench images"):
        _options(["bench.sizes=1GB"])
    with pytest.raises(UserError, match="unknown row"):
        _options(["bench.rows=ours,mine"])
    opts, rest = _options(["bench.rows=ours", "cache.max_bytes=5"])
    assert opts["rows"] == ("ours",) and rest == ["cache.max_bytes=5"]


@pytest.mark.slow
def test_bench_images_scale_tiny(tmp_path):
    """The scale curve on two tiny sizes: copies of the painted shards, the cache capped below
    every set, the plot written."""
    results, doc = tmp_path / "results", tmp_path / "B.md"
    out = run_cli("bench", "images", "--tag", "scale", "--set", "bench.scale=1200KB,2400KB",
                  "--set", "bench.shard_bytes=400KB", "--set", "bench.scale_distinct=800KB",
                  "--set", "bench.scale_cache_bytes=900KB", "--set", "bench.scale_max_images=1000",
                  "--set", "bench.workers=1", "--set", f"bench.scratch={tmp_path}",
                  "--set", f"bench.plot={tmp_path}/scale.png",
                  "--results-dir", str(results), "--doc", str(doc), timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "scale.png").read_bytes()[:4] == b"\x89PNG"
    r = json.loads((results / "images-scale.json").read_text())
    small, large = r["points"]
    assert r["painted"]["shards"] == 2  # 800 KB in shards of at most 400 KB
    for p, size in ((small, 1_200_000), (large, 2_400_000)):  # copies until the size is reached
        assert size <= p["set"]["bytes"] < size + 400_000
    for p in (small, large):
        cold = p["ours_cold"]
        assert cold["images"] == p["set"]["images"]  # under the image cap: the whole epoch
        assert cold["store_get_bytes"] >= p["set"]["bytes"] and cold["cache"]["misses"] == p["set"]["shards"]
    # (evictions: none here, as one batch of 256 spans every shard of these tiny sets, all pinned)
    assert large["cache_max_bytes"] == 900_000 and "evictions" in large["ours_cold"]["cache"]
    assert r["largest_set_bytes"] == large["set"]["bytes"]
    assert "## Images: cost as the data grows (scale)" in doc.read_text()
