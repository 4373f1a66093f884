"""Our row of `workflows bench images`: the product's StreamLoader, one rank per process, run by
workflows.bench.images in the product's venv, with the same phase protocol as the peers'
(workflows.bench.image_peers).

    python -m workflows.bench.image_rows '{"endpoint", "prefix", "cache_dir", "max_bytes", "workers",
                                           "rank", "world_size", "phases": ["ours_cold", "ours_warm"]}'

Each phase is one epoch (epoch 0, 1, ...) of one loader (its decode processes persist), through
one shard cache: the first reads from the store into an empty cache (cold), the next from the cache (warm).
"""

from __future__ import annotations

import json
import sys

from workflows.bench.image_peers import BATCH, SIZE, phase, timed_pass


def main(argv: list[str]) -> None:
    from workflows.loader import StreamLoader
    from workflows.loader.images import ImageTransform
    from workflows.storage.cache import ShardCache
    from workflows.storage.uri import StorageContext

    a = json.loads(argv[0])
    ctx = StorageContext(endpoint_url=a["endpoint"], region="us-east-1", embedded=True)
    cache = ShardCache(a["cache_dir"], ctx, a.get("max_bytes"))
    loader = StreamLoader(a["prefix"], ctx, cache, ImageTransform(SIZE, seed=0), batch_size=BATCH,
                          num_workers=a["workers"], seed=0, epoch=0, rank=a.get("rank", 0),
                          world_size=a.get("world_size", 1))
    try:
        for epoch, name in enumerate(a["phases"]):
            with phase(name) as out:
                loader.set_epoch(epoch)  # the same loader and decode processes, as a training loop keeps them
                timed_pass(loader, out, images_of=lambda b: len(b["image"]), limit=a.get("max_images"))
                stats = cache.stats()
                out["cache"] = {"hits": stats.hits, "misses": stats.misses, "evictions": stats.evictions}
                out["fetch_wait_s"] = round(loader.fetch_wait_s, 2)
    finally:
        loader.close()

if __name__ == "__main__":
    main(sys.argv[1:])
