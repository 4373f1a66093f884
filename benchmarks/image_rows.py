"""Our row of `python -m benchmarks.images`: the product's StreamLoader, one rank per process, run by
benchmarks.images in the product's venv, with the same phase protocol as the peers'
(benchmarks.image_peers).

    python -m benchmarks.image_rows '{"endpoint", "prefix", "cache_dir", "max_bytes", "workers",
                                           "rank", "world_size", "phases": ["ours_cold", "ours_warm"]}'

Each phase is one epoch (epoch 0, 1, ...) of one loader (its decode processes persist), through
one shard cache: the first reads from the store into an empty cache (cold), the next from the cache (warm).
Each phase counts how often every sample id was delivered (`samples`: distinct, repeated, missing
from the set), so "exactly once" is checked over the epoch it measured, not assumed.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from benchmarks.image_peers import SIZE, _batch, phase, timed_pass


def main(argv: list[str]) -> None:
    from workflows.loader import StreamLoader
    from workflows.loader.index import read_index
    from workflows.preprocess.images import ImageTransform
    from workflows.storage.cache import ShardCache
    from workflows.storage.uri import StorageContext

    a = json.loads(argv[0])
    ctx = StorageContext(endpoint_url=a["endpoint"], region="us-east-1", embedded=True)
    cache = ShardCache(a["cache_dir"], ctx, a.get("max_bytes"))
    source = a["prefix"]
    if a.get("build_index"):  # a set without index.json: what building its index costs is a phase of its own
        with phase("ours_index_build") as out:
            source = read_index(a["prefix"], ctx, cache)
            out.update(shards=len(source.shards), images=len(source))
    loader = StreamLoader(source, ctx, cache, ImageTransform(SIZE, seed=0), batch_size=_batch(a),
                          num_workers=a["workers"], seed=0, epoch=0, rank=a.get("rank", 0),
                          world_size=a.get("world_size", 1))
    try:
        for epoch, name in enumerate(a["phases"]):
            with phase(name) as out:
                loader.set_epoch(epoch)  # the same loader and decode processes, as a training loop keeps them
                seen = np.zeros(len(loader.index), np.int64)

                def images_of(batch, seen=seen) -> int:
                    np.add.at(seen, batch["sample"].numpy(), 1)
                    return len(batch["image"])

                timed_pass(loader, out, images_of=images_of, limit=a.get("max_images"))
                out["samples"] = once(seen, a.get("world_size", 1))
                stats = cache.stats()
                out["cache"] = {"hits": stats.hits, "misses": stats.misses, "evictions": stats.evictions,
                                "peak_pinned_bytes": loader.peak_pinned_bytes}
                out["fetch_wait_s"] = round(loader.fetch_wait_s, 2)
    finally:
        loader.close()


def once(seen, world_size: int = 1) -> dict:
    """How often each sample of the set came: `exactly_once` when every one came once (one rank of
    several sees its share only: then no repeats is what it can check)."""
    out = {"set": int(len(seen)), "distinct": int((seen > 0).sum()), "repeated": int((seen > 1).sum()),
           "missing": int((seen == 0).sum())}
    out["exactly_once"] = out["repeated"] == 0 and (out["missing"] == 0 or world_size > 1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
