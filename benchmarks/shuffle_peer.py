"""MosaicML Streaming's epoch orders for `python -m benchmarks.shuffle`, computed by Streaming's own
shuffle functions (streaming.base.shuffle.get_shuffle). Runs in the peers' venv, as a script: it
imports numpy and streaming only, never workflows.

    python -P shuffle_peer.py OUT_DIR '{"cases": [{"name", "algo", "sizes", "ncn", "block"}], "seed": 0,
                                        "workers": 8, "batch": 256}'

writes OUT_DIR/<name>.npy: epoch 0's sample ids in the order one rank reads them: Streaming's
shuffle (position -> sample id) over its default partition ("relaxed") of the positions for one
node, one rank and `workers` DataLoader workers, whose batches a DataLoader takes round-robin.
"""

import json
import sys
import types
from pathlib import Path

import numpy as np

# streaming/__init__ imports streaming.vision, which imports torchvision; the peers' venv has no
# torchvision (it would pull a second torch) and nothing here uses the vision datasets, so an empty
# module stands in for that one name.
sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")

from streaming.base.partition import get_partitions  # noqa: E402 (after the stand-in above)
from streaming.base.shuffle import get_shuffle  # noqa: E402


def main(out: str, spec: str) -> None:
    args = json.loads(spec)
    for case in args["cases"]:
        sizes = np.asarray(case["sizes"], dtype=np.int64)
        shuffle = get_shuffle(case["algo"], sizes, case["ncn"], args["seed"], 0, case["block"])
        # as StreamingDataset._get_work: partition the positions, then map them through the shuffle
        parts = get_partitions("relaxed", int(sizes.sum()), case["ncn"], 1, 1, args["workers"], args["batch"])
        pos = parts[0, 0].transpose(1, 0, 2).reshape(-1)  # batch k of worker 0, 1, ..., then batch k+1
        ids = shuffle[pos[pos >= 0]]
        # the partition repeats a sample or so to make the epoch divide evenly over ranks: keep the first read
        _, first = np.unique(ids, return_index=True)
        np.save(Path(out) / f"{case['name']}.npy", ids[np.sort(first)].astype(np.int64))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
