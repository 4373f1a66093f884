"""The `storage` and `cache` sections: where data, runs and models live, and the per-node shard cache."""

from __future__ import annotations

import os

from pydantic import Field

from workflows.config.base import Strict


class EmbeddedS3Config(Strict):
    """moto's S3 server on this machine, persisted to `data_dir` between commands. It holds the
    bucket of storage.root only: any other bucket (a `data.source` of yours) is read from the store
    it is in."""

    enabled: bool = Field(False, description="serve storage.root's bucket from moto's server on this machine; "
                          "other buckets stay at storage.endpoint_url, else AWS_ENDPOINT_URL, else AWS")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    data_dir: str = Field(".workflows/s3", description="local directory that persists the buckets")


class StorageConfig(Strict):
    root: str = Field("s3://workflows", description="URI under which processed data, runs and models live")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, ...); else AWS_ENDPOINT_URL or AWS (with the embedded "
        "store on: the endpoint of every bucket but storage.root's)"
    )
    region: str | None = Field(None, description="else AWS_REGION / AWS_DEFAULT_REGION")
    embedded: EmbeddedS3Config = EmbeddedS3Config()
    retries: int = Field(5, ge=0, description="S3 client retry attempts")


class CacheConfig(Strict):
    enabled: bool = Field(True, description="read shards through the per-node cache (false: nothing is kept; the "
                          "stream loader reads through a temp directory holding only the shards it reads)")
    dir: str = Field(
        "auto",
        description="per-node cache directory (shards/, models/); 'auto' = $WORKFLOWS_CACHE_DIR if the node "
        "sets it, else /mnt/nvme/workflows-cache if /mnt/nvme exists, else ~/.cache/workflows "
        "($XDG_CACHE_HOME/workflows when set)",
    )
    max_bytes: int | None = Field(
        None, ge=1, description="byte budget of the node's cache, shards/ and models/ together (shards are "
        "evicted LRU to make room; model directories count but are not evicted); None = unbounded. Shards a "
        "stream loader is reading are pinned and never evicted: set it above what a loader pins at once (a "
        "shuffle window of 4 shards, those of the batches in flight and 2 prefetched; the loader computes it "
        "from its plan and warns when the cap is below)",
    )
    verify_checksums: bool = Field(
        False, description="re-hash a cached shard on every hit (slower; size is always checked)"
    )

    def resolved_dir(self) -> str:
        """Resolved on the node that uses it: WORKFLOWS_CACHE_DIR in the node's environment (e.g. a
        pod spec) wins over 'auto'."""
        if self.dir != "auto":
            return os.path.abspath(os.path.expanduser(self.dir))
        if os.environ.get("WORKFLOWS_CACHE_DIR"):
            return os.path.abspath(os.path.expanduser(os.environ["WORKFLOWS_CACHE_DIR"]))
        if os.path.isdir("/mnt/nvme"):
            return "/mnt/nvme/workflows-cache"
        return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workflows")

    def shard_cache(self, ctx):
        """The shard cache of the node this runs on ('auto' is resolved here, on that node); with
        enabled=false a transient one for readers that need local copies (nothing is kept)."""
        from workflows.storage.cache import ShardCache
        from workflows.storage.transient import TransientCache

        if not self.enabled:
            return TransientCache(ctx)
        return ShardCache(os.path.join(self.resolved_dir(), "shards"), ctx, self.max_bytes, self.verify_checksums,
                          counted=os.path.join(self.resolved_dir(), "models"))

