"""The map-style dataset a StreamLoader's decode processes run (stream.py): a batch of items, each
naming a sample's local file and where its bytes are, to a dict of arrays. The main process plans
and pins; these processes only read (os.pread, parquet row groups) and transform.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from workflows.errors import UserError
from workflows.loader.columns import column_values

ROW_GROUPS = 8  # per decode process: parquet row groups kept decoded (a shuffle window's worth)
FOOTERS = 32  # per decode process: parquet footers kept parsed (metadata only, no open file)


class Samples:
    """The map-style dataset the DataLoader's workers run: a batch of items -> a dict of arrays.

    Items carry everything a worker needs (epoch, sample id, local path, where the bytes are), so
    one persistent worker pool serves every epoch and resume point."""

    def __init__(self, fmt: str, transform: Callable | None, columns: list[str] | None):
        self.fmt = fmt
        self.transform = transform
        self.columns = columns
        self._groups: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._footers: OrderedDict[str, tuple[Any, np.ndarray]] = OrderedDict()  # metadata, row-group starts

    def __len__(self) -> int:  # the DataLoader asks; batches come from the batch sampler
        return 0

    def __getitem__(self, item):
        return self.__getitems__([item])

    def __getitems__(self, items: list[tuple]) -> dict:
        import torch

        if self.fmt == "parquet":
            out = self._rows(items)
        elif self.fmt == "raw-parquet":  # items: (epoch, sample, path, row, label); the image column's bytes
            blobs = self._table([it[:4] for it in items]).column(0).to_pylist()
            if self.transform is None:
                out = {"data": blobs}
            else:
                out = {"image": stack_images([self.transform(d, it[1], it[0]) for d, it in zip(blobs, items)])}
            out["label"] = torch.tensor([it[4] for it in items], dtype=torch.int64)
        else:
            images, labels = [], []
            # why open per batch, not an LRU of fds kept across batches: a cap bounds the disk. A
            # file evicted while a process holds it open stays on disk until closed, uncounted by
            # the cache (issue #37: 4 evicted shards held at a cap of 2). A batch is decoded while
            # the main process pins its shards (eviction skips pinned entries), so closing every
            # file at the end of the batch means no evicted file is ever held open; an open+close
            # per shard of a batch costs microseconds beside its decodes.
            fds: dict[str, int] = {}
            try:
                for epoch, sample, path, off, size, label in items:
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    data = os.pread(fds[path], size, off)
                    if len(data) != size:
                        raise UserError(f"{path}: short read of sample {sample} (the cached shard changed?)")
                    images.append(self.transform(data, sample, epoch) if self.transform is not None else data)
                    labels.append(label)
            finally:
                for fd in fds.values():
                    os.close(fd)
            if self.transform is None:
                out = {"data": images}
            else:
                out = {"image": stack_images(images)}
            out["label"] = torch.tensor(labels, dtype=torch.int64)
        out["sample"] = torch.tensor([it[1] for it in items], dtype=torch.int64)
        return out

    def _rows(self, items: list[tuple]) -> dict:
        table = self._table(items)
        return {c: column_values(table.column(c)) for c in table.column_names}

    def _table(self, items: list[tuple]):
        """Parquet rows (`self.columns`), read by row group (kept decoded, LRU) and taken in the
        items' order. Files are opened only to read a row group and closed at once (see
        __getitems__: a cap bounds the disk); the parsed footers are kept, so a reopen reads no footer."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = []
        for _epoch, _sample, path, row in items:
            footer = self._footers.pop(path, None)
            if footer is None:
                meta = pq.read_metadata(path)
                footer = (meta, np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]))
            self._footers[path] = footer
            if len(self._footers) > FOOTERS:
                self._footers.popitem(last=False)
            meta, starts = footer
            g = int(np.searchsorted(starts, row, side="right") - 1)
            table = self._groups.pop((path, g), None)
            if table is None:
                with pq.ParquetFile(path, metadata=meta) as pf:
                    table = pf.read_row_group(g, columns=self.columns)
            self._groups[(path, g)] = table
            if len(self._groups) > ROW_GROUPS:
                self._groups.popitem(last=False)
            parts.append(table.slice(int(row - starts[g]), 1))
        return pa.concat_tables(parts)


def stack_images(images: list):
    """Per-sample [C, H, W] arrays -> one [N, C, H, W] tensor in channels_last memory (stored as N, H, W,
    C): the format convolutions prefer and the one the training collate of stored pixels gives, so a
    compiled model sees one layout (its graph guards on strides) whichever input trains it. Other
    arrays are stacked as they are."""
    import torch

    if not images or np.ndim(images[0]) != 3:
        return torch.from_numpy(np.stack(images))
    return torch.from_numpy(np.stack([a.transpose(1, 2, 0) for a in images])).permute(0, 3, 1, 2)
