"""Batch inference: `workflows predict --model M --data URI --output URI`.

Ray Data reads the input shards through the shard cache, an actor pool runs the same predictor
as online serving (the model is loaded once per actor), and the rows come out as parquet with
`prediction` and `score` columns added. `manifest.json` is written last and lists the files:
output without it is an interrupted run, never a result.
"""

from __future__ import annotations

import time

from workflows import registry
from workflows.cluster_state import cluster_resources
from workflows.errors import UserError, surface_user_errors
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.serve.predictor import BatchPredictor
from workflows.storage.uri import filesystem, join, pyarrow_filesystem, with_protocol, write_json
from workflows.tasks import check_card_task, task_for_card


def check_predict(cfg, ctx, model_spec: str, output_uri: str) -> str:
    """The model is registered and the output is new (never mixed with an earlier run's files):
    NAME:VERSION of the model."""
    ref = registry.resolve(cfg, ctx, model_spec)
    check_card_task(cfg, registry.model_card(cfg, ctx, model_spec))
    fs, out_path = filesystem(output_uri, ctx)
    if fs.exists(out_path) and fs.ls(out_path):
        raise UserError(f"{output_uri} is not empty; give predict a new output URI")
    return f"{ref.name}:{ref.version}"


@surface_user_errors()
def predict_batch(rt, model_spec: str, data_uri: str, output_uri: str, concurrency: int | None = None) -> dict:
    import pyarrow.parquet as pq
    import ray

    cfg, ctx = rt.cfg, rt.storage
    spec = check_predict(cfg, ctx, model_spec, output_uri)
    card = registry.model_card(cfg, ctx, spec)
    shards, fmt = list_shards(data_uri, ctx)
    ds = read_dataset(shards, fmt, ctx, cfg.cache)

    names = set(ds.schema().names)
    missing = [c for c in task_for_card(cfg, card).serving.input_columns(card, names) if c not in names]
    if missing:
        raise UserError(f"{data_uri} lacks column(s) {missing} that model {spec} reads (has {sorted(names)})")

    t0 = time.time()
    workers = concurrency or max(1, min(4, int(cluster_resources().get("CPU", 1))))
    scored = ds.map_batches(BatchPredictor, fn_constructor_args=(cfg.model_dump(mode="json"), spec),
                            batch_format="pandas", batch_size=cfg.evaluate.batch_size,
                            compute=ray.data.ActorPoolStrategy(size=workers))
    pa_fs, pa_path = pyarrow_filesystem(output_uri, ctx)
    scored.write_parquet(pa_path, filesystem=pa_fs)
    fs, out_path = filesystem(output_uri, ctx)
    files = sorted(with_protocol(output_uri, f) for f in fs.glob(f"{out_path.rstrip('/')}/*.parquet"))
    rows, columns = 0, list[str]()
    for f in files:
        with fs.open(filesystem(f, ctx)[1], "rb") as fh:
            meta = pq.ParquetFile(fh)
            rows += meta.metadata.num_rows
            columns = columns or meta.schema_arrow.names
    result = {"model": spec, "precision": cfg.serve.precision, "data": data_uri, "output": output_uri,
              "rows": rows, "files": files, "columns": sorted(columns),
              "seconds": round(time.time() - t0, 2)}
    write_json(join(output_uri, "manifest.json"), result, ctx)  # last: marks the output complete
    rt.persist()
    return result
