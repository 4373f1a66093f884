"""What every `preprocess` opens and closes with: the raw shards of `data.source` listed, the
processed dataset's version and place, and, when that version is already written, the dataset
itself (`start_preprocess`); at the close, the manifest with the shards, their format and the time
it took (`PreprocessRun.finish`), written last so that it marks the dataset complete."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from workflows.config import WorkflowConfig
from workflows.dataset import ProcessedDataset, materialized, write_manifest
from workflows.preprocess.sources import list_shards
from workflows.storage.shards import Shard
from workflows.storage.uri import StorageContext


@dataclass
class PreprocessRun:
    shards: list[Shard]
    format: str
    version: str
    uri: str  # where the processed dataset goes
    done: ProcessedDataset | None  # the dataset of this version, already written: nothing to do
    ctx: StorageContext
    started: float = field(default_factory=time.time)

    def seconds(self) -> float:
        return time.time() - self.started

    def finish(self, data: ProcessedDataset) -> ProcessedDataset:
        """`data` with its manifest written (the shards, their format and the seconds taken)."""
        write_manifest(data, self.ctx, shards=[asdict(s) for s in self.shards], format=self.format,
                       seconds=round(self.seconds(), 2))
        return data


def start_preprocess(cfg: WorkflowConfig, ctx: StorageContext, say: Callable[[str], None],
                     version: Callable[[list[Shard]], str], what: str = "shard(s)") -> PreprocessRun:
    """The run of `preprocess` for `cfg`: its raw shards, `version(shards)` and the output's place
    (cfg.uri("processed", version)); unless that version is already written (`done`), says what it
    reads (`what`: the shards' kind) and where it writes."""
    d = cfg.data
    shards, fmt = list_shards(d.source, ctx, d.format)
    v = version(shards)
    uri = cfg.uri("processed", v)
    run = PreprocessRun(shards, fmt, v, uri, materialized(uri, ctx, say), ctx)
    if run.done is None:
        say(f"preprocess: {len(shards)} {fmt} {what} from {d.source} -> {uri}")
    return run
