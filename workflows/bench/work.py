"""The work inside a pipeline run, redone in one plain-PyTorch process: no Ray, no object store.

After `workflows pipeline` has run (bench quickstart), its inputs and outputs are copied out of the
persisted embedded store to local files (not timed), and the same computations are timed here, the
way a user would write them in one script:
  preprocess  load the tokenizer, tokenize every raw row
  tune        each trial's config (the same sampled params, rows and number of epochs it ran)
              trained and validated, one trial after another, on all the threads the trials had
  train       the final config (best params) trained and validated on all its rows, one process
              with the threads of all its workers (no FSDP: one process)
  evaluate    the registered model loaded and run over the held-out rows, F1 computed
  serve       the demo requests' rows predicted one at a time
The same functions as the pipeline (loop.build_training, loop.run_epochs, Predictor), so the
difference between a stage's wall time and its work is what the platform adds.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from pathlib import Path

import torch

from workflows.config import WorkflowConfig


class _Stop(Exception):
    pass


def copy_out(cfg: WorkflowConfig, run_dir: Path, dest: Path) -> dict:
    """Raw shards, processed parquet files and the registered model, out of the persisted store."""
    from workflows import registry
    from workflows.runtime import runtime
    from workflows.storage.uri import filesystem

    pipeline = json.loads((run_dir / "pipeline.json").read_text())
    model = pipeline["model"]
    with runtime(cfg, ray_needed=False) as rt:
        for name, uri in (("raw", cfg.data.source), ("processed", pipeline["dataset"]["uri"])):
            fs, path = filesystem(uri, rt.storage)
            for remote in fs.find(path):
                local = dest / name / os.path.relpath(remote, path)
                local.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(remote, str(local))
        model_dir, _ = registry.fetch(cfg, rt.storage, f"{model['name']}:{model['version']}")
        shutil.copytree(model_dir, dest / "model")
    return pipeline


def _rows(files: list[str], columns, limit: int | None = None) -> dict:
    from workflows.storage.uri import StorageContext
    from workflows.train.standalone import read_rows

    return read_rows(files, StorageContext(), columns, limit)


def local_dataset(processed: Path):
    """The copied processed dataset, its files named by their local paths."""
    from workflows.preprocess.materialize import ProcessedDataset

    m = json.loads((processed / "manifest.json").read_text())
    data = ProcessedDataset.from_manifest(m)
    data.uri = str(processed)
    data.files = {s: sorted(glob.glob(str(processed / f"split={s}" / "*.parquet"))) for s in data.files}
    return data


def tokenize(cfg: WorkflowConfig, raw_dir: Path) -> dict:
    import pandas as pd

    from workflows.preprocess.encoding import TextEncoder, compose_texts, resolve_model_dir

    frames = [pd.read_json(f, lines=True) for f in sorted(glob.glob(str(raw_dir / "**" / "*.jsonl"), recursive=True))]
    frames += [pd.read_parquet(f) for f in sorted(glob.glob(str(raw_dir / "**" / "*.parquet"), recursive=True))]
    frames += [pd.read_csv(f) for f in sorted(glob.glob(str(raw_dir / "**" / "*.csv"), recursive=True))]
    df = pd.concat(frames)
    texts = compose_texts({c: df[c].tolist() for c in cfg.data.text_columns}, cfg.data.text_columns)
    t0 = time.perf_counter()
    encoder = TextEncoder(resolve_model_dir(cfg.preprocess.tokenizer), cfg.preprocess.max_length, cfg.data.text_columns)
    encoder.encode_texts(texts)
    return {"seconds": time.perf_counter() - t0, "rows": len(texts)}


def train_run(cfg: WorkflowConfig, processed: Path, epochs: int, threads: int) -> float:
    """Seconds to build the model and train+validate `epochs` epochs of `cfg` in this process."""
    from workflows.tasks import get_task
    from workflows.train.loop import build_training, data_seed, run_epochs
    from workflows.train.standalone import batches, epoch_batches, row_count

    tc = cfg.train
    task, data = get_task(cfg), local_dataset(processed)
    torch.set_num_threads(threads)
    train_rows = task.prepare_rows(_rows(data.files["train"], task.columns, tc.max_train_rows))
    val_rows = task.prepare_rows(_rows(data.files["val"], task.columns, tc.max_val_rows))
    t0 = time.perf_counter()
    device = torch.device("cpu")
    eval_batch = task.collate(data, train=False)
    probe = batches(train_rows, cfg.evaluate.batch_size, eval_batch)
    model, optimizer, scheduler = build_training(cfg, task, data, device, row_count(train_rows), probe)

    def end_of_epoch(epoch: int, metrics: dict, history: list[dict]) -> None:
        if epoch + 1 >= epochs:
            raise _Stop

    try:
        run_epochs(cfg, task, data, model, optimizer, scheduler, device, start_epoch=0, history=[],
                   train_batches=lambda e: epoch_batches(task, data, train_rows, tc.batch_size, data_seed(tc.seed, e)),
                   val_batches=lambda: batches(val_rows, cfg.evaluate.batch_size, eval_batch),
                   end_of_epoch=end_of_epoch)
    except _Stop:
        pass
    return time.perf_counter() - t0


def evaluate_and_serve(cfg: WorkflowConfig, model_dir: Path, processed: Path, demo: int, threads: int) -> dict:
    import pandas as pd

    from workflows.evaluate import classification_metrics
    from workflows.serve.predictor import Predictor

    meta = json.loads((model_dir / "workflows.json").read_text())
    test = pd.concat(pd.read_parquet(f) for f in sorted(glob.glob(str(processed / "split=test" / "*.parquet"))))
    t0 = time.perf_counter()
    predictor = Predictor(str(model_dir), threads, cfg.serve.precision)
    probs = predictor.probabilities({c: test[c].tolist() for c in meta["text_columns"]}, cfg.evaluate.batch_size)
    predicted = [predictor.labels[i] for i in probs.argmax(1)]
    f1 = classification_metrics(test[meta["label_column"]].astype(str).tolist(), predicted, predictor.labels)[
        "weighted"
    ]["f1"]
    evaluate = time.perf_counter() - t0
    rows = test[meta["text_columns"]].head(demo).astype(str).to_dict("records")
    t0 = time.perf_counter()
    for row in rows:
        predictor.predict([row])
    return {"evaluate": evaluate, "serve": time.perf_counter() - t0, "weighted_f1": f1, "test_rows": len(test)}


def measure(cfg: WorkflowConfig, run_dir: Path, scratch: Path) -> dict:
    """Seconds of the work of each stage of the pipeline run whose summaries are in `run_dir`."""
    from workflows.tune.search import trial_config

    pipeline = copy_out(cfg, run_dir, scratch)
    processed = scratch / "processed"
    cpus = os.cpu_count() or 1
    work: dict = {"preprocess": tokenize(cfg, scratch / "raw")}
    final = cfg
    if "tune" in pipeline:
        tune = json.loads((run_dir / "tune.json").read_text())
        t = cfg.tune
        threads = min(cpus, max(1, int(t.num_workers * cfg.train.cpus_per_worker * tune.get("concurrency", cpus))))
        seconds = [train_run(trial_config(cfg, trial["params"]), processed, trial["epochs"], threads)
                   for trial in tune["trials"] if trial["epochs"]]
        work["tune"] = {"seconds": sum(seconds), "trials": len(seconds), "threads": threads,
                        "epochs": sum(trial["epochs"] for trial in tune["trials"])}
        data = cfg.model_dump(mode="json")
        for key, value in pipeline["tune"]["best_params"].items():
            data["train"][key.removeprefix("train.")] = value
        final = WorkflowConfig.model_validate(data)
    tc = final.train
    threads = min(cpus, max(1, int(tc.num_workers * tc.cpus_per_worker)))
    work["train"] = {"seconds": train_run(final, processed, tc.epochs, threads), "threads": threads,
                     "epochs": tc.epochs}
    served = evaluate_and_serve(
        final, scratch / "model", processed, len(pipeline.get("serve", {}).get("requests", [])), threads
    )
    work["evaluate"] = {
        "seconds": served["evaluate"],
        "rows": served["test_rows"],
        "weighted_f1": served["weighted_f1"],
    }
    work["serve"] = {"seconds": served["serve"], "requests": len(pipeline.get("serve", {}).get("requests", []))}
    shutil.rmtree(scratch, ignore_errors=True)
    return work
