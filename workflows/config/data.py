"""The `data` and `preprocess` sections: the raw source, its splits, and how it is processed."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from workflows.config.base import Strict


class DataConfig(Strict):
    source: str = Field(..., description="URI of a raw shard, a directory of shards or a glob")
    format: Literal["auto", "csv", "jsonl", "parquet", "tar", "image"] = "auto"
    text_columns: list[str] = Field(["text"], min_length=1, description="text tasks: the columns joined into the input")
    label_column: str = "label"
    max_bad_records: int = Field(
        0, ge=0, description="records that cannot be decoded (an image that is truncated, empty, not an image, a "
        "decompression bomb) skipped and named in the preprocessing summary; one more fails preprocessing, "
        "naming the first bad key (0: the first bad record fails it)")
    builtin: Literal["quickstart", "digits", "chat"] | None = Field(
        None,
        description="build this dataset into `source` when no shard is there: in the embedded store only, "
        "unless write_builtin is set (anywhere else an empty source is an error)",
    )
    write_builtin: bool = Field(
        False, description="let `builtin` write its dataset into a source outside the embedded store "
        "(a real bucket or a local directory)"
    )
    builtin_rows_per_class: int = Field(900, ge=10, description="quickstart: rows per label; chat: rows per kind "
                                        "of instruction")
    val_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    test_fraction: float = Field(0.2, gt=0.0, lt=0.5)
    split_seed: int = 0
    max_rows: int | None = Field(None, ge=1, description="keep at most this many rows (a deterministic subset)")


class PreprocessConfig(Strict):
    tokenizer: str = Field("minilm", description="'minilm' (the packaged all-MiniLM-L6-v2) or a local HF directory")
    max_length: int = Field(128, ge=8, le=4096)
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="image tasks: an image declaring more pixels is refused undecoded "
        "(decompression bombs), in preprocessing and serving alike")
    batch_size: int = Field(256, ge=1)
    concurrency: int = Field(2, ge=1, description="tokenizing or image-decoding Ray tasks at a time")
    rows_per_shard: int = Field(2000, ge=1)

