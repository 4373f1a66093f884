import numpy as np
import pytest

from benchmarks.shuffle import measure
from workflows.loader.order import epoch_order, shard_offsets


def test_measure_reads_shard_locality_off_an_order():
    offsets = shard_offsets([4, 4, 4])
    m = measure(np.arange(12), offsets, batch=4)  # shard by shard: no mixing at all
    assert (m["gap_mean"], m["gap_median"], m["open_shards_max"]) == (1.0, 1.0, 1)
    assert m["span_mean"] == pytest.approx(4 / 12, abs=1e-4) and m["shards_per_batch_mean"] == 1.0
    m = measure(np.array([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]), offsets, batch=3)  # round-robin
    assert (m["gap_mean"], m["gap_p5"], m["open_shards_max"], m["shards_per_batch_min"]) == (3.0, 3.0, 3, 3)
    with pytest.raises(ValueError, match="permutation"):
        measure(np.array([0, 0, 1]), shard_offsets([3]))


def test_our_window_bounds_the_shards_a_batch_draws_from():
    sizes = [50] * 40
    for window in (1, 4):
        m = measure(epoch_order(sizes, 0, 0, window), shard_offsets(sizes), batch=32)
        assert m["open_shards_max"] == window and m["shards_per_batch_mean"] <= window + 1
