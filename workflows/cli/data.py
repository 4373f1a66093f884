"""The `workflows data` command group: synthetic data sets for tests and benchmarks."""

from __future__ import annotations

import time

import typer

from workflows import console
from workflows.cli.common import ConfigOpt, SetOpt, _in_runtime
from workflows.errors import UserError

data_app = typer.Typer(no_args_is_help=True, help="Data sets: make synthetic ones for tests and benchmarks.")


@data_app.command("synth-images")
def synth_images(
    out: str = typer.Option(..., "--out", help="where the shards go: s3://bucket/prefix (the configured endpoint), "
                            "file:// or a local path"),
    size: str = typer.Option("1GB", "--size", help="total size of the shards: 1GB, 500MB, 27GB, 20GiB"),
    classes: int = typer.Option(100, "--classes", min=1, help="number of classes (labels 0..N-1)"),
    seed: int = typer.Option(0, "--seed", help="the same seed writes the same images"),
    shard_bytes: str = typer.Option("128MB", "--shard-bytes", help="size of one tar shard"),
    workers: int | None = typer.Option(None, "--workers", min=1, help="processes painting images (default: CPUs)"),
    config: str = ConfigOpt,
    set: list[str] | None = SetOpt,
):
    """Write an ImageNet-like set (about 400x350 photo-like JPEGs of 80-150 KB, N classes) as WebDataset
    tar shards plus index.json under OUT."""
    from workflows.preprocess.synth_images import SynthSpec, parse_size
    from workflows.preprocess.synth_images import synth_images as write_set

    def body(rt):
        spec = SynthSpec(classes=classes, seed=seed, shard_bytes=parse_size(shard_bytes, "--shard-bytes"))
        t0 = time.perf_counter()
        index = write_set(out, parse_size(size), rt.storage, spec, workers, say=console.echo)
        n, total = sum(s["samples"] for s in index["shards"]), sum(s["bytes"] for s in index["shards"])
        console.echo(f"synth-images: {n} images in {len(index['shards'])} shards, {total / 1e9:.2f} GB, "
                     f"{classes} classes, under {out.rstrip('/')}/ in {time.perf_counter() - t0:.1f}s")

    try:  # a bad size fails in one line before any store starts
        parse_size(size), parse_size(shard_bytes, "--shard-bytes")
    except UserError as e:
        console.echo(f"error: {e}")
        raise typer.Exit(2) from None
    _in_runtime("data", config, set, body, ray_needed=False)
