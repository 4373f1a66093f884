"""train.loader=stream: a Ray Train worker's training batches from workflows.loader instead of Ray
Data, so that an epoch is one global order whatever the number of workers, each sample is seen
exactly once, and a step checkpoint can resume mid-epoch (also on another number of workers)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from workflows.errors import UserError
from workflows.loader import StreamLoader, parquet_index
from workflows.loader.index import DatasetIndex
from workflows.loader.order import STAND_IN
from workflows.seeds import augment_seed

# (world rank, epoch, position of the batch's step in the epoch order, the batch's global sample ids)
SampleHook = Callable[[int, int, int, list[int]], None]


@dataclass(frozen=True)
class SampleRecorder:
    """A SampleHook that appends each batch's ids as a JSON line to `<directory>/samples-<rank>-<pid>.jsonl`
    (a restarted worker is a new process: a new file), to check what a run trained on."""

    directory: str

    def __call__(self, rank: int, epoch: int, position: int, ids: list[int]) -> None:
        line = json.dumps({"t": time.time(), "rank": rank, "epoch": epoch, "position": position, "ids": ids})
        with open(os.path.join(self.directory, f"samples-{rank}-{os.getpid()}.jsonl"), "a") as f:
            f.write(line + "\n")


def gpu_training(tc) -> bool:
    """Whether this process trains on a GPU (its loader then pins the batches it hands over)."""
    import torch

    return bool(tc.use_gpu) and torch.cuda.is_available()


def stream_refused(cfg) -> UserError:
    """The error of train.loader=stream with a task that trains on examples made from the stored rows
    (a causal LM's blocks): the loader reads the rows themselves."""
    return UserError(f"train.loader=stream reads the stored rows, but model.task={cfg.model.task} trains on "
                     "other examples made from them; use train.loader=ray_data")


def head(index: DatasetIndex, rows: int) -> DatasetIndex:
    """The index of the first `rows` samples in file order (train.max_train_rows, as Ray Data's
    `limit` keeps them)."""
    shards, left = [], rows
    for s in index.shards:
        if left <= 0:
            break
        shards.append(replace(s, samples=min(s.samples, left)))
        left -= s.samples
    return replace(index, shards=shards)


class StreamInput:
    """One worker's loader over the processed split's parquet files (rows go to the task's collate
    as numpy columns, as with Ray Data), or over what the task's `stream_source` names (an image
    task's raw tars or files, decoded and cropped in the loader's processes)."""

    def __init__(self, cfg, data, storage, rank: int, world_size: int, rows: int,
                 on_samples: SampleHook | None = None, task=None):
        tc = cfg.train
        cache = cfg.cache.shard_cache(storage)
        source = task.dataset.stream_source(data, storage) if task is not None else None
        index, transform = source if source is not None else (parquet_index(data.files["train"], storage, cache), None)
        index = head(index, rows)
        self.rank, self.on_samples, self.task, self.data, self.seed = rank, on_samples, task, data, tc.seed
        self.loader = StreamLoader(index, storage, cache, transform, batch_size=tc.batch_size,
                                   num_workers=tc.decode_workers(transform is not None), seed=tc.seed, rank=rank,
                                   world_size=world_size, shuffle_window=tc.shuffle_window,
                                   pin_memory=gpu_training(tc))
        self.samples = len(index)
        self.cfg, self.storage, self.cache = cfg, storage, cache
        self._val: StreamLoader | None = None

    def train_batches(self, epoch: int, start: int) -> Iterator[dict]:
        """The epoch's training batches from global position `start`, through the task's training
        collate: its augmentation seeded by (seed, epoch) and the sample, never by the rank."""
        return self.batches(epoch, start, self.task.collate(self.data, train=True, seed=augment_seed(self.seed, epoch)))

    def batches(self, epoch: int, start: int, collate: Callable, record: bool = True) -> Iterator[dict]:
        """`record`: a training pass, whose ids go to `on_samples` and whose stand-ins (a rank's batch of a
        step with fewer samples left than ranks, order.Batch) stay in, marked, for loop.train_epoch to
        run with zero weight; False (the probe, one rank's own pass): no stand-ins."""
        import torch

        self.loader.set_epoch(epoch, start)
        for batch in self.loader:
            position = self.loader.last_step_start
            ids = batch.pop("sample")
            stand_in = batch.pop(STAND_IN, False)
            if stand_in and not record:
                continue
            if record and not stand_in and self.on_samples is not None:
                self.on_samples(self.rank, epoch, position, ids.tolist())
            out = collate(batch)
            if stand_in:
                out[STAND_IN] = torch.ones(())
            yield out

    def val_batches(self, rows: int, share: slice, collate: Callable) -> Iterator[dict]:
        """The val split's first `rows` rows (train.max_val_rows, as Ray Data's `limit` keeps them), read
        in this process like the training rows: the same seeded order on every rank (each reads the whole
        split), this rank's positions `share` of it (worker_setup.val_positions), through the task's
        evaluation collate. A task's val metrics are sums over rows, so the order leaves them as they are."""
        step = share.step or 1
        if self._val is None:  # the index read once, the loader's batches a multiple of the share's step
            index = head(parquet_index(self.data.files["val"], self.storage, self.cache), rows)
            self._val = StreamLoader(index, self.storage, self.cache, batch_size=self.cfg.evaluate.batch_size * step,
                                     num_workers=0, seed=self.seed, shuffle_window=self.cfg.train.shuffle_window)
        self._val.set_epoch(0)
        for batch in self._val:
            batch.pop("sample")
            yield collate(batch if step == 1 else {k: v[share] for k, v in batch.items()})

    @property
    def consumed(self) -> int:
        return self.loader.consumed
