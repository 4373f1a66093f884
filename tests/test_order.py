"""Correct whatever the source's order (issue #37): rows are stored shuffled, every rank validates
and exports the same buffers, and the registered model scores on `evaluate --split val` what its
card says it scored in training."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from tests.helpers import free_port
from workflows.pipeline.stages import stage_preprocess
from workflows.runtime import runtime


def class_sorted_csv(path: Path, per_class: int = 100) -> Path:
    """A two-class CSV listed class by class, as exports and folder listings come."""
    lines = ["text,label"]
    for label in ("alpha", "beta"):
        lines += [f"{label} sample number {i} with some words,{label}" for i in range(per_class)]
    path.write_text("\n".join(lines) + "\n")
    return path


def stored_labels(data, split: str, storage) -> list[str]:
    """The split's labels in stored order: the manifest's files in order, each file's rows in order
    (what preserve_order ingest and torchrun's contiguous rank shares read)."""
    from workflows.train.standalone import read_rows

    return [str(v) for v in read_rows(data.files[split], storage, ["label"])["label"]]


def test_preprocessing_stores_a_class_sorted_source_in_a_seeded_mixed_order(ray_cluster, tiny_cfg, tmp_path):
    src = class_sorted_csv(tmp_path / "sorted.csv")
    orders = []
    for store in ("s3a", "s3b"):  # two stores: the second preprocesses again, it reuses nothing
        cfg = tiny_cfg(f"data.source={src}", "data.builtin=null", "data.max_rows=null",
                       f"storage.embedded.data_dir={tmp_path / store}")
        with runtime(cfg) as rt:
            data = stage_preprocess(rt)
            assert not data.reused
            orders.append(stored_labels(data, "train", rt.storage))
    train = orders[0]
    assert len(train) > 120
    half = len(train) // 2
    for share in (train[:half], train[half:]):  # each of two ranks' contiguous shares holds both classes
        assert 0.3 < share.count("alpha") / len(share) < 0.7, share
    runs = 1 + sum(a != b for a, b in zip(train, train[1:]))
    assert runs > len(train) / 4, f"{runs} runs of one class in {len(train)} rows: not shuffled"
    assert orders[1] == train  # seeded: the same order every time


# ------------------------------------------------------------------ buffers equal on every rank
N, FEATURES = 32, 4


def rank_rows(rank: int) -> np.ndarray:
    """Each rank's rows come from another distribution (as a class-sorted shard would)."""
    return np.random.default_rng(rank).normal(loc=5.0 * rank, scale=1.0 + rank, size=(N, FEATURES)).astype(np.float32)


def _sync_ranks(rank: int, world_size: int, port: int, strategy: str, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from workflows.parallel import parallelize, sync_buffers

        torch.manual_seed(0)
        # momentum=None: the running statistics are the cumulative mean of the batches seen
        model = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.BatchNorm1d(FEATURES, momentum=None), nn.Linear(4, 2))
        with torch.no_grad():
            model[0].weight.copy_(torch.eye(FEATURES))  # the BatchNorm sees the rows themselves
            model[0].bias.zero_()
        model = parallelize(model, strategy, torch.device("cpu"))
        model.train()
        model(torch.from_numpy(rank_rows(rank))).sum().backward()
        sync_buffers(model)
        bn = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)][0]
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"mean": bn.running_mean.tolist(), "var": bn.running_var.tolist(),
                       "batches": int(bn.num_batches_tracked)}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_loop's ranks: skip the interpreter's teardown (gloo's threads)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_ranks_validate_and_export_the_same_pooled_batchnorm_statistics(strategy, tmp_path):
    mp.spawn(_sync_ranks, args=(2, free_port(), strategy, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # bit for bit: validation and the exported model see one set
    rows = [rank_rows(r).astype(np.float64) for r in range(2)]
    means = np.stack([x.mean(0) for x in rows])
    variances = np.stack([x.var(0, ddof=1) for x in rows])  # what BatchNorm keeps: unbiased
    pooled_mean = means.mean(0)
    pooled_var = (variances + means**2).mean(0) - pooled_mean**2  # within ranks + between them
    assert np.array(ranks[0]["mean"]) == pytest.approx(pooled_mean, abs=1e-4)
    assert np.array(ranks[0]["var"]) == pytest.approx(pooled_var, rel=1e-4)
    assert ranks[0]["batches"] == 1


# ------------------------------------------------- the registered model scores what its card says
def registered_card(config, overrides: list[str], model: str) -> dict:
    """The registered `model`'s card, read from the run's persisted embedded store."""
    from workflows import registry
    from workflows.config import load_config
    from workflows.storage.embedded import EmbeddedS3
    from workflows.storage.uri import StorageContext

    cfg = load_config(config, overrides)
    with EmbeddedS3(cfg.storage.embedded.data_dir) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        return registry.model_card(cfg, ctx, model).model_dump()


def card_and_val(config, overrides: list[str], cli, model: str, out: Path) -> tuple[dict, dict]:
    """The registered `model`'s card and `evaluate --split val` of it (`cli`: a command on its store)."""
    res = cli("evaluate", "--model", model, "--split", "val", "--output", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return registered_card(config, overrides, model), json.loads(out.read_text())


def assert_card_is_evaluate(card: dict, evaluation: dict) -> None:
    val = card["val_metrics"]
    assert val["val_f1"] == pytest.approx(evaluation["weighted"]["f1"], abs=0.005), (val, evaluation["weighted"])
    assert val["val_accuracy"] == pytest.approx(evaluation["accuracy"], abs=0.005)


@pytest.mark.integration
def test_the_quickstart_models_card_is_its_val_evaluation(quickstart_run, ray_join):
    from tests.conftest import QUICKSTART

    card, evaluation = card_and_val(
        QUICKSTART, quickstart_run.overrides,
        lambda *a: quickstart_run.cli(*a, extra=ray_join.overrides, env=ray_join.env),
        "quickstart", quickstart_run.tmp / "order-val.json")
    assert_card_is_evaluate(card, evaluation)


@pytest.mark.integration
def test_the_digits_models_card_is_its_val_evaluation(digits_run, ray_join):
    from tests.conftest import DIGITS

    card, evaluation = card_and_val(
        DIGITS, digits_run.overrides, lambda *a: digits_run.cli(*a, extra=ray_join.overrides, env=ray_join.env),
        "digits", digits_run.tmp / "order-val.json")
    assert_card_is_evaluate(card, evaluation)


# ----------------------------------------------- the README's own-images command, class-sorted input
README = Path(__file__).resolve().parents[1] / "README.md"
OWN_IMAGES = "tests/test_order.py runs this command"


def readme_own_images_command() -> list[str]:
    """The arguments of the README's own-images pipeline block, exactly as printed."""
    import re
    import shlex

    m = re.search(r"<!-- readme-test: skip: " + re.escape(OWN_IMAGES) + r"[^>]*-->\n```bash\n(.*?)```",
                  README.read_text(), re.S)
    assert m, "the README's own-images block is gone"
    args = shlex.split(m.group(1).replace("\\\n", " "))
    assert args[:2] == ["workflows", "pipeline"], args
    return args[1:]


def class_sorted_photos(root: Path, per_class: int = 150, classes: int = 2) -> Path:
    """A class-per-folder set of photo-like crops (synth_images' painter), downscaled to 64 px wide:
    `root/<label>/<n>.jpg`, so a listing returns them class by class."""
    import io

    from PIL import Image

    from workflows.preprocess.synth_images import Painter, SynthSpec

    painter = Painter(SynthSpec(classes=classes, seed=7))
    rng = np.random.default_rng(7)
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            img = Image.open(io.BytesIO(painter.image(rng, label)))
            img.resize((64, max(1, round(64 * img.height / img.width)))).save(folder / f"{i:04d}.jpg", quality=90)
    return root


# an image pipeline of its own with an accuracy bar; the gate checks a user's bucket beside the embedded
# store in test_storage and runs a README block on a second endpoint (test_readme)
@pytest.mark.extended
def test_the_readme_own_images_command_on_a_class_sorted_folder(tmp_path, ray_join):
    """The README's own-images command as printed, its `data.source=s3://my-bucket/pets/train/` a
    bucket on a second S3 endpoint (moto's server, named as a user names theirs: AWS_ENDPOINT_URL and
    credentials in the environment) while the digits config's embedded store holds storage.root: the
    class-sorted folder is read from the user's bucket, the model registered in the embedded store,
    and nothing is written into the user's bucket or created in the embedded one under its name."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.conftest import run_cli, sets

    args = readme_own_images_command()
    assert "data.source=s3://my-bucket/pets/train/" in args, args
    photos = class_sorted_photos(tmp_path / "photos")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        url = f"http://127.0.0.1:{server._server.server_port}"
        user_env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_REGION": "us-east-1"}
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
        s3.create_bucket(Bucket="my-bucket")
        for f in sorted(photos.rglob("*.jpg")):
            s3.put_object(Bucket="my-bucket", Key=f"pets/train/{f.relative_to(photos).as_posix()}", Body=f.read_bytes())
        uploaded = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="my-bucket")["Contents"])
        # where it writes, and the stages this check does not need (tuning, serving): training,
        # evaluation and registration run as the README's command sets them (num_workers auto, ray_data).
        # A Ray of its own (RAY_ADDRESS=local), as a user's command starts: the credentials reach its
        # workers through the environment, which the session's cluster cannot get.
        test_only = [f"storage.embedded.data_dir={tmp_path}/s3", f"output_dir={tmp_path}/runs",
                     f"cache.dir={tmp_path}/cache", "tune.enabled=false", "serve.enabled=false",
                     "tracking.enabled=false"]
        res = run_cli(*args, *sets(test_only), env={**user_env, "RAY_ADDRESS": "local"}, timeout=900)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        assert sorted(o["Key"] for o in s3.list_objects_v2(Bucket="my-bucket")["Contents"]) == uploaded
    finally:
        server.stop()
    run_dir = tmp_path / "runs" / "pets"
    summary = json.loads((run_dir / "pipeline.json").read_text())
    held_out = summary["evaluate"]["headline"]
    assert held_out["name"] == "weighted F1" and held_out["value"] >= 0.9, held_out
    store = tmp_path / "s3"  # the embedded store's persisted buckets: storage.root's only
    persisted = {e["bucket"] for e in json.loads((store / "manifest.json").read_text()).values()}
    if (store / "buckets.json").exists():
        persisted |= set(json.loads((store / "buckets.json").read_text()))
    assert persisted == {"workflows"}, persisted

    overrides = [*(x for flag, x in zip(args, args[1:]) if flag == "--set"), *test_only, *ray_join.overrides]
    card, evaluation = card_and_val(
        "digits", overrides, lambda *a: run_cli(*a, "--config", "digits", *sets(overrides), env=ray_join.env),
        "pets", tmp_path / "val.json")
    assert_card_is_evaluate(card, evaluation)


def test_every_validation_row_is_scored():
    """A small val split is scored whole by every rank (its metrics, ratios of all-reduced sums, are
    then the split's exactly); a large one in disjoint strided shares of equal length."""
    from workflows.train.worker_setup import VAL_SHARE_MIN_ROWS_PER_RANK, val_positions

    rows = np.arange(13)
    assert all((rows[val_positions(13, r, 2)] == rows).all() for r in range(2))  # not 12 of them
    n = VAL_SHARE_MIN_ROWS_PER_RANK * 3 + 2
    big = np.arange(n)
    shares = [big[val_positions(n, r, 3)] for r in range(3)]
    assert len({len(s) for s in shares}) <= 2 and sum(map(len, shares)) == n
    assert sorted(np.concatenate(shares).tolist()) == big.tolist()
    assert (big[val_positions(n, 0, 1)] == big).all()


def test_the_stored_order_does_not_follow_which_task_finished_first(ray_cluster, tmp_path):
    """The same shards and seed give the same shuffled rows whichever read task finished first (a
    processed dataset's version names only its inputs): a dataset read from shards hands its blocks
    on in their order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workflows.dataset import shuffled
    from workflows.preprocess.sources import list_shards, read_dataset
    from workflows.storage.uri import StorageContext

    def slow_block(batch, slow: int):  # defined here: Ray's workers cannot import a test module
        import time

        if int(batch["shard"][0]) == slow:
            time.sleep(1.5)  # this shard's task finishes last
        return batch

    for s in range(4):
        pq.write_table(pa.table({"shard": [s] * 100, "row": [s * 100 + i for i in range(100)]}),
                       tmp_path / f"part-{s}.parquet")
    shards, fmt = list_shards(str(tmp_path), StorageContext())
    orders = []
    for slow in (0, 3):
        ds = read_dataset(shards, fmt, StorageContext()).map_batches(
            slow_block, fn_args=(slow,), batch_size=None, batch_format="pandas").materialize()
        orders.append([r["row"] for r in shuffled(ds, seed=7).take_all()])
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(400))
    assert orders[0] == orders[1]
