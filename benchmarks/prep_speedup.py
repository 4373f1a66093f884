"""Preprocessing on one node: the product's Ray Data map (tokenize text, decode + resize images) over
N CPUs against one process calling the same code, beside N plain processes (multiprocessing, already
started) doing the same work: the "decode limit", what N cores give with no Ray in the way.

The sides run interleaved (one process, Ray Data, plain processes; again; again) and each side's
median is kept, so a machine loaded by others weighs on all of them alike; the 1-minute load average
is sampled while each part runs and stored beside its figures. One process's CPU seconds over its
wall seconds say whether it already used more than one core (a tokenizer's own threads). The CPU
seconds of each side (this process and all its descendants: the local Ray cluster, the plain
processes) give the load-free figure: N x one process's CPU seconds / Ray Data's, the speedup on an
idle node if Ray Data kept its N CPUs busy.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import statistics
import time
from collections.abc import Callable

from benchmarks.load import LoadSampler

ROUNDS = 3
N_CPUS = 2
IMAGES = 480
IMAGE_BATCH = 32  # a few hundred images: the product's 256 would leave one batch per CPU


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tree_cpu() -> float:
    """CPU seconds of this process and every live descendant: this driver's local Ray cluster (GCS,
    raylet, its workers) and the plain processes."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def interleaved(sides: dict[str, Callable[[], None]], rounds: int = ROUNDS) -> dict:
    """Each side timed `rounds` times, alternating; medians, every round, and the load during each."""
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            with LoadSampler(every=0.5) as load:
                c0, tc0, t0 = _cpu(), _tree_cpu(), time.perf_counter()
                fn()
                wall, cpu, tree = time.perf_counter() - t0, _cpu() - c0, _tree_cpu() - tc0
            runs[name].append({"seconds": round(wall, 3), "driver_cpu_s": round(cpu, 3), "cpu_s": round(tree, 3),
                               "load": load.summary()})
    return {name: {"median_s": round(statistics.median(r["seconds"] for r in rs), 3), "rounds": rs}
            for name, rs in runs.items()}


def ray_worker_niceness() -> int:
    """The niceness Ray gives its worker processes (the raylet's worker_niceness, 15 unless
    RAY_worker_niceness says otherwise): read from a running worker, not assumed."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(_niceness).remote())


def _niceness() -> int:
    return os.nice(0)


class PlainProcesses:
    """N started worker processes (spawn: the driver runs Ray's threads, which fork would copy
    mid-flight) mapping a top-level function over batches; started and warmed before any timing.
    `niceness`: theirs (os.nice), e.g. Ray's workers' own, so the two compete for CPU alike."""

    def __init__(self, n: int, warm: Callable, warm_args: tuple, niceness: int = 0):
        self.pool = multiprocessing.get_context("spawn").Pool(n, initializer=os.nice, initargs=(niceness,))
        self.pool.starmap(warm, [warm_args] * n * 2)  # every worker imports and loads its tools

    def run(self, fn: Callable, batches: list) -> None:
        self.pool.starmap(fn, batches, chunksize=1)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def _split(df, size: int) -> list:
    return [df.iloc[i : i + size] for i in range(0, len(df), size)]


def compare(df, fn: Callable, args: tuple, batch_size: int, local: Callable, warm: Callable,
            rounds: int = ROUNDS) -> dict:
    """`fn(batch, *args)` (the product's Ray Data task) over `df`, four ways, interleaved:

    one_process         `local()` in this process (the driver, at its own niceness, 0): the work
                        without Ray, as the issue measured it
    ray_data            Ray Data map_batches(fn) on N_CPUS tasks at a time, on Ray's workers
    one_process_niced   one started process at Ray's worker niceness mapping `fn` over the batches
    plain_processes     N_CPUS started processes at that niceness doing the same: the decode limit
    """
    import ray

    batches = _split(df, batch_size)
    blocks = _split(df, -(-len(df) // 16))

    def ray_data():
        ds = ray.data.from_pandas(blocks).map_batches(
            fn, batch_format="pandas", batch_size=batch_size,
            compute=ray.data.TaskPoolStrategy(size=N_CPUS), fn_args=args)
        if ds.materialize().count() != len(df):
            raise RuntimeError(f"Ray Data's {fn.__name__} gave a different number of rows")

    nice = ray_worker_niceness()
    one, many = PlainProcesses(1, warm, args, nice), PlainProcesses(N_CPUS, warm, args, nice)
    work = [(b, *args) for b in batches]
    try:
        res = interleaved({"one_process": local, "ray_data": ray_data,
                           "one_process_niced": lambda: one.run(fn, work),
                           "plain_processes": lambda: many.run(fn, work)}, rounds)
    finally:
        one.close()
        many.close()
    med = {k: v["median_s"] for k, v in res.items()}
    cpu = {k: statistics.median(r["cpu_s"] for r in v["rounds"]) for k, v in res.items()}
    cores = statistics.median(r["driver_cpu_s"] / r["seconds"] for r in res["one_process"]["rounds"])
    return {
        "cpus": N_CPUS, "batch_size": batch_size, "ray_worker_niceness": nice,
        "speedup": round(med["one_process"] / med["ray_data"], 2),
        "speedup_same_niceness": round(med["one_process_niced"] / med["ray_data"], 2),
        "plain_processes_speedup": round(med["one_process_niced"] / med["plain_processes"], 2),
        "one_process_cores": round(cores, 2),
        # what the same CPU seconds would give on an idle node: N CPUs all busy, one process on one
        # (the load-free figure: CPU seconds barely change with the load, wall seconds do)
        "cpu_bound_speedup": round(N_CPUS * cpu["one_process"] / cpu["ray_data"], 2),
        "plain_processes_cpu_bound_speedup": round(N_CPUS * cpu["one_process_niced"] / cpu["plain_processes"], 2),
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "load_mean": round(statistics.fmean(r["load"]["mean"] for v in res.values() for r in v["rounds"]), 2),
        "sides": res,
    }


def _tokenize_warm(*args) -> None:
    from workflows.preprocess.materialize import _cached_tokenize, json

    _cached_tokenize(json.dumps(args))


def tokenize(cfg, rows: int, rounds: int = ROUNDS) -> dict:
    """The text task's preprocessing (workflows.preprocess.materialize.tokenize_batch) on `rows` rows."""
    import pandas as pd

    from workflows.preprocess import quickstart_data
    from workflows.preprocess.encoding import resolve_model_dir
    from workflows.preprocess.materialize import Tokenize, tokenize_batch

    base = pd.DataFrame(quickstart_data.build(cfg.data.builtin_rows_per_class))
    df = pd.concat([base] * (rows // len(base) + 1), ignore_index=True).iloc[:rows][["text", "label"]]
    labels = sorted(df["label"].unique())
    p = cfg.preprocess
    args = (resolve_model_dir(p.tokenizer), p.max_length, ["text"], "label", labels, 0, 0.1, 0.1)

    def one_process():
        tok = Tokenize(*args)  # its load is part of the work, as each Ray worker's is
        for i in range(0, len(df), p.batch_size):
            tok(df.iloc[i : i + p.batch_size])

    return {"rows": rows, **compare(df, tokenize_batch, args, p.batch_size, one_process, _tokenize_warm, rounds)}


def synth_jpegs(n: int) -> list[bytes]:
    """`n` photo-like JPEGs (about 400 x 350, 80-150 KB) from the synth-images generator."""
    import numpy as np

    from workflows.preprocess.synth_images import Painter, SynthSpec

    painter = Painter(SynthSpec(classes=10, seed=0))
    rng = np.random.default_rng(1)
    return [painter.image(rng, i % 10) for i in range(n)]


def _decode_warm(*args) -> None:
    import pandas as pd

    from workflows.preprocess.image_dataset import decode_batch

    decode_batch(pd.DataFrame({"key": [], "image": [], "label": []}), *args)


def decode(cfg, n: int = IMAGES, rounds: int = ROUNDS) -> dict:
    """The image task's preprocessing (workflows.preprocess.image_dataset.decode_batch: decode,
    resize, center-crop) on `n` JPEGs."""
    import pandas as pd

    from workflows.preprocess.image_dataset import DecodeImages, decode_batch, decoder_args
    from workflows.tasks import get_task
    from workflows.tasks.image import ImageOptions

    # the config's image size when it trains images, else the image task's default
    size = getattr(get_task(cfg).options, "image_size", None) or ImageOptions().image_size
    jpegs = synth_jpegs(n)
    df = pd.DataFrame({"key": [f"{i:06d}" for i in range(n)], "image": jpegs,
                       "label": [str(i % 10) for i in range(n)]})
    args = decoder_args(cfg, size)

    def one_process():
        dec = DecodeImages(*args)
        for i in range(0, len(df), IMAGE_BATCH):
            dec(df.iloc[i : i + IMAGE_BATCH])

    sizes = [len(j) for j in jpegs]
    return {"images": n, "image_size": size,
            "jpeg_kb_median": round(statistics.median(sizes) / 1e3, 1),
            **compare(df, decode_batch, args, IMAGE_BATCH, one_process, _decode_warm, rounds)}
