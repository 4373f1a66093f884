"""A deterministic streaming loader: every sample exactly once per epoch, in one global order that
does not depend on the number of workers, resumable mid-epoch (also on another worker count).

    index.py   the dataset index: shards and their sample counts (index.json, or built once)
    order.py   the epoch's global order and each rank's share of it (pure functions)
    stream.py  StreamLoader: one rank's batches, read from shards cached on local disk
    images.py  the image transform the loader decodes with (RandomResizedCrop + flip, seeded)
"""

from workflows.loader.index import DatasetIndex, ShardEntry, parquet_index, read_index
from workflows.loader.order import epoch_order, rank_batches, step_bounds
from workflows.loader.stream import StreamLoader

__all__ = ["DatasetIndex", "ShardEntry", "StreamLoader", "epoch_order", "parquet_index", "rank_batches",
           "read_index", "step_bounds"]
