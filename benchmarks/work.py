"""The work inside a pipeline run, redone in one plain-PyTorch process: no Ray, no object store.

After `workflows pipeline` has run (bench quickstart, bench digits), its inputs and outputs are
copied out of the persisted embedded store to local files (not timed), and the same computations
are timed here, the way a user would write them in one script, whatever the task:
  preprocess  the copied raw shards read (the same readers) and every record encoded by
              `record_encoder`: the function the task's preprocess stage maps over them on Ray Data
              (text: load the tokenizer, clean, tokenize; images: decode + resize each image)
  tune        each trial's config (the same sampled params, rows and number of epochs it ran)
              trained and validated, one trial after another, on all the threads the trials had
  train       the final config (best params) trained and validated on all its rows, one process
              with the threads of all its workers (no FSDP: one process)
  evaluate    the registered model loaded by its task's predictor and run over the held-out rows
              (`predict_frame`, in batches of evaluate.batch_size), scored by the task
  serve       the demo requests the pipeline sent, each body parsed by the task's HTTP contract
              (an image is decoded there) and predicted, one at a time
The same functions as the pipeline (the preprocessing's record encoder, the training engine train.engine.Trainer,
the task's predictor and contract), so the difference between a stage's wall time and its work is
what the platform adds.

Threads: each training run, and the evaluation, runs with 1 thread and with the threads the stage
had (`fastest`), and the faster counts, with the thread count that gave it. On an idle machine more
threads win; on a shared one (other processes runnable) torch's OpenMP threads can each wait at
every barrier for the other to be scheduled, and 2 threads measured many times slower than 1 for
the same epoch. The work is then the least this machine needed, never more: the rest of the wall
time is not flattered by a slow baseline. A slower second run is abandoned once it passes the first.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workflows.config import WorkflowConfig


class _Slower(Exception):
    """A timed run passed the time it had to beat: abandoned."""


def fastest(run, threads: int) -> tuple[float, int]:
    """(seconds, thread count) of the faster of `run(1, None)` and `run(threads, limit)`, where
    `run(n, limit)` times the work on n threads and may give up (math.inf) once past `limit`."""
    best, used = run(1, None), 1
    if threads > 1:
        seconds = run(threads, best)
        if seconds < best:
            best, used = seconds, threads
    return best, used


def _within(batches, t0: float, limit: float | None):
    for batch in batches:
        if limit is not None and time.perf_counter() - t0 > limit:
            raise _Slower
        yield batch


def copy_out(cfg: WorkflowConfig, run_dir: Path, dest: Path) -> dict:
    """Raw shards, processed parquet files and the registered model, out of the persisted store;
    the pipeline's summary, with the registered version's evaluation metrics as `metrics`."""
    from workflows import registry
    from workflows.runtime import runtime
    from workflows.storage.uri import filesystem

    pipeline = json.loads((run_dir / "pipeline.json").read_text())
    model = pipeline["model"]
    spec = f"{model['name']}:{model['version']}"
    with runtime(cfg, ray_needed=False) as rt:
        for name, uri in (("raw", cfg.data.source), ("processed", pipeline["dataset"]["uri"])):
            fs, path = filesystem(uri, rt.storage)
            for remote in fs.find(path):
                local = dest / name / os.path.relpath(remote, path)
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, str(local))
        model_dir, _ = registry.fetch(cfg, rt.storage, spec)
        shutil.copytree(model_dir, dest / "model")
        pipeline["metrics"] = registry.model_card(cfg, rt.storage, spec).metrics or {}
    return pipeline


def _rows(files: list[str], columns, limit: int | None = None) -> dict:
    from workflows.storage.uri import StorageContext
    from workflows.train.standalone import read_rows

    return read_rows(files, StorageContext(), columns, limit)


def local_dataset(processed: Path):
    """The copied processed dataset, its files named by their local paths."""
    from workflows.dataset import ProcessedDataset

    m = json.loads((processed / "manifest.json").read_text())
    data = ProcessedDataset.from_manifest(m)
    data.uri = str(processed)
    data.files = {s: sorted(glob.glob(str(processed / f"split={s}" / "*.parquet"))) for s in data.files}
    return data


def raw_records(cfg: WorkflowConfig, raw_dir: Path):
    """The raw shards copied to `raw_dir`, listed and read as preprocessing lists and reads them
    (sources.list_shards, the shard readers of storage/shards.py), as one pandas frame."""
    import pyarrow as pa

    from workflows.preprocess.sources import list_shards
    from workflows.storage.shards import _read_local
    from workflows.storage.uri import StorageContext

    shards, fmt = list_shards(str(raw_dir), StorageContext(), cfg.data.format)
    tables = [_read_local(s.uri, fmt, s.uri) for s in shards]
    return pa.concat_tables(tables, promote_options="default").to_pandas()


def record_encoder(cfg: WorkflowConfig, data) -> Callable:
    """The function a built-in classification task's `preprocess` maps over raw records on Ray Data,
    built here in this process: a pandas batch of raw records (as storage.shards reads the raw
    shards) -> processed rows. `data`: the dataset `preprocess` made of them (its labels)."""
    from workflows.tasks import get_task

    task = get_task(cfg)
    if task.name == "image_classification":
        from workflows.preprocess.image_dataset import DecodeImages, decoder_args

        return DecodeImages(*decoder_args(cfg, task.options.image_size))
    if task.name == "classification":
        from workflows.preprocess.encoding import resolve_model_dir
        from workflows.preprocess.materialize import Tokenize, _clean, tokenize_args

        d = cfg.data
        tokenize = Tokenize(*tokenize_args(cfg, resolve_model_dir(cfg.preprocess.tokenizer), data.labels))
        return lambda batch: tokenize(_clean(batch, d.text_columns, d.label_column, None, d.split_seed))
    raise NotImplementedError(f"the plain-PyTorch work times the built-in classification tasks, not {task.name!r}")


def encode_raw(cfg: WorkflowConfig, raw_dir: Path, processed: Path) -> dict:
    """Seconds to read the raw shards and encode every record with `record_encoder`, in batches of
    preprocess.batch_size, as the stage's Ray Data actors do."""
    data = local_dataset(processed)
    t0 = time.perf_counter()
    records = raw_records(cfg, raw_dir)
    read = time.perf_counter() - t0
    encode = record_encoder(cfg, data)
    size = cfg.preprocess.batch_size
    rows = sum(len(encode(records.iloc[i : i + size])) for i in range(0, len(records), size))
    return {"seconds": time.perf_counter() - t0, "read_seconds": read, "rows": rows}


def train_run(cfg: WorkflowConfig, processed: Path, epochs: int, threads: int, limit: float | None = None) -> float:
    """Seconds to build the model and train+validate `epochs` epochs of `cfg` in this process
    (math.inf when abandoned past `limit` seconds)."""
    from workflows.tasks import get_task
    from workflows.train.engine import Trainer
    from workflows.train.standalone import batches, epoch_batches, row_count

    tc = cfg.train
    task, data = get_task(cfg), local_dataset(processed)
    torch.set_num_threads(threads)
    train_rows = task.dataset.prepare_rows(_rows(data.files["train"], task.columns, tc.max_train_rows))
    val_rows = task.dataset.prepare_rows(_rows(data.files["val"], task.columns, tc.max_val_rows))
    t0 = time.perf_counter()
    eval_batch = task.collate(data, train=False)

    class Source:  # the pipeline's batches, abandoned past `limit`
        def train(self, epoch: int, skip: int):
            return _within(epoch_batches(task, data, train_rows, tc.batch_size, tc.seed, epoch), t0, limit)

        def val(self):
            return _within(batches(val_rows, cfg.evaluate.batch_size, eval_batch), t0, limit)

        def probe(self):
            return batches(train_rows, cfg.evaluate.batch_size, eval_batch)

    trainer = Trainer(cfg, task, data, torch.device("cpu"), Source(), row_count(train_rows))
    try:
        trainer.build()
        trainer.fit(stop_after=epochs - 1)
    except _Slower:
        return math.inf
    return time.perf_counter() - t0


def request_bodies(instances: list[dict]) -> list[bytes]:
    """The JSON bodies the pipeline's demo requests sent: one instance each."""
    return [json.dumps({"instances": [inst]}).encode() for inst in instances]


def evaluate_and_serve(cfg: WorkflowConfig, model_dir: Path, processed: Path, instances: list[dict],
                       threads: int) -> dict:
    """The registered model through its task: loaded, run over the held-out split and scored; then
    each demo request's body parsed by the task's HTTP contract and predicted, one at a time."""
    import pandas as pd

    from workflows.model_card import ModelCard
    from workflows.tasks import task_for_card

    card = ModelCard.load(str(model_dir))
    task = task_for_card(cfg, card)
    test = pd.concat(pd.read_parquet(f) for f in sorted(glob.glob(str(processed / "split=test" / "*.parquet"))))
    test = test[[*task.serving.input_columns(card, set(test.columns)), card.label_column]].reset_index(drop=True)
    size = cfg.evaluate.batch_size
    t0 = time.perf_counter()
    predictor = task.serving.predictor(str(model_dir), card, threads, cfg.serve.precision)
    scored = pd.concat([predictor.predict_frame(test.iloc[i : i + size].copy()) for i in range(0, len(test), size)])
    metrics = task.evaluate_rows(scored[card.label_column].tolist(), scored["prediction"].tolist(), card)
    evaluate = time.perf_counter() - t0
    contract = task.serving.http_contract(card, cfg.serve.max_instances)
    bodies = request_bodies(instances)
    t0 = time.perf_counter()
    for body in bodies:
        rows = contract.parse("application/json", body)
        if isinstance(rows, tuple):
            raise RuntimeError(f"a demo request the pipeline sent does not parse: {rows}")
        predictor.predict(rows)
    return {"evaluate": evaluate, "serve": time.perf_counter() - t0, "weighted_f1": metrics["weighted"]["f1"],
            "accuracy": metrics["accuracy"], "test_rows": len(test)}


def measure(cfg: WorkflowConfig, run_dir: Path, scratch: Path) -> dict:
    """Seconds of the work of each stage of the pipeline run whose summaries are in `run_dir`."""
    from workflows.tune.search import trial_config

    pipeline = copy_out(cfg, run_dir, scratch)
    processed = scratch / "processed"
    cpus = os.cpu_count() or 1
    work: dict = {"preprocess": encode_raw(cfg, scratch / "raw", processed)}
    final = cfg
    if "tune" in pipeline:
        tune = json.loads((run_dir / "tune.json").read_text())
        t = cfg.tune
        threads = min(cpus, max(1, int(t.num_workers * cfg.train.cpus_per_worker * tune.get("concurrency", cpus))))
        runs = [fastest(lambda n, limit, trial=trial: train_run(trial_config(cfg, trial["params"]), processed,
                                                                trial["epochs"], n, limit), threads)
                for trial in tune["trials"] if trial["epochs"]]
        work["tune"] = {"seconds": sum(s for s, _ in runs), "trials": len(runs), "threads": threads,
                        "threads_used": [n for _, n in runs],
                        "epochs": sum(trial["epochs"] for trial in tune["trials"])}
        data = cfg.model_dump(mode="json")
        for key, value in pipeline["tune"]["best_params"].items():
            data["train"][key.removeprefix("train.")] = value
        final = WorkflowConfig.model_validate(data)
    tc = final.train
    # num_workers auto on one node: one worker with every CPU (workflows.train.layout)
    threads = cpus if tc.num_workers == "auto" else min(cpus, max(1, int(tc.max_workers * tc.cpus_per_worker)))
    seconds, used = fastest(lambda n, limit: train_run(final, processed, tc.epochs, n, limit), threads)
    work["train"] = {"seconds": seconds, "threads": threads, "threads_used": used, "epochs": tc.epochs}
    instances = [r["instance"] for r in pipeline.get("serve", {}).get("requests", [])]
    by_threads = {n: evaluate_and_serve(final, scratch / "model", processed, instances, n)
                  for n in sorted({1, threads})}  # both run whole: short, and F1 is checked on each
    ev = min(by_threads, key=lambda n: by_threads[n]["evaluate"])
    sv = min(by_threads, key=lambda n: by_threads[n]["serve"])
    served = by_threads[ev]
    work["evaluate"] = {
        "seconds": served["evaluate"],
        "threads_used": ev,
        "rows": served["test_rows"],
        "weighted_f1": served["weighted_f1"],
        "accuracy": served["accuracy"],
    }
    work["serve"] = {"seconds": by_threads[sv]["serve"], "threads_used": sv, "requests": len(instances)}
    work["registered_metrics"] = {k: pipeline["metrics"].get(k) for k in ("accuracy", "rows")}
    shutil.rmtree(scratch, ignore_errors=True)
    return work
