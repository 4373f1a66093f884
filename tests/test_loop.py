"""The plain training loop: gradient accumulation and activation checkpointing change memory and
communication, never the result (one process and 2 ranks under FSDP2/DDP, a tiny BERT)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port
from workflows.loader.order import STAND_IN
from workflows.parallel import parallelize
from workflows.train.loop import make_optimizer, make_scheduler, micro_batch_groups, steps_per_epoch, train_epoch

ROWS, SEQ, VOCAB, LABELS = 32, 12, 50, 3


def tiny_bert(checkpointing: bool = False):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def rows(rank: int = 0, world_size: int = 1):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, SEQ // 2:] = 0  # some padded rows
    labels = torch.randint(0, LABELS, (ROWS,), generator=g)
    per = ROWS // world_size
    sl = slice(rank * per, (rank + 1) * per)
    return ids[sl], mask[sl], labels[sl]


def batches(batch_size: int, rank: int = 0, world_size: int = 1):
    ids, mask, labels = rows(rank, world_size)
    for i in range(0, len(labels), batch_size):
        yield {"input_ids": ids[i:i + batch_size], "attention_mask": mask[i:i + batch_size],
               "labels": labels[i:i + batch_size]}


def run(batch_size: int, accum: int, *, checkpointing: bool = False, strategy: str = "ddp",
        rank: int = 0, world_size: int = 1, epochs: int = 2):
    device = torch.device("cpu")
    model = parallelize(tiny_bert(checkpointing), strategy, device)
    opt = make_optimizer(model, 1e-3, 0.01)
    sched = make_scheduler(opt, steps_per_epoch(ROWS, world_size, batch_size, accum) * epochs, 0.1)
    out = [train_epoch(model, batches(batch_size, rank, world_size), opt, sched, device, 1.0, accum_steps=accum)
           for _ in range(epochs)]
    return [s for e in out for s in e["step_losses"]], [e["steps"] for e in out]


def test_micro_batch_groups_keep_a_short_last_group():
    assert [len(g) for g in micro_batch_groups(range(7), 3)] == [3, 3, 1]
    assert steps_per_epoch(rows=70, world_size=2, batch_size=4, accum_steps=3) == 3  # 9 micro-batches


def test_accumulated_steps_equal_one_big_batch():
    big, big_steps = run(batch_size=8, accum=1)
    acc, acc_steps = run(batch_size=4, accum=2)
    assert big_steps == acc_steps == [4, 4]
    assert acc == pytest.approx(big, abs=1e-5)


def test_a_short_last_group_is_weighted_by_its_rows():
    # 32 rows in micro-batches of 6, 3 per step: steps of 6+6+6 and 6+6+2 rows, as batches of 18 would be
    ref, _ = run(batch_size=18, accum=1)
    acc, steps = run(batch_size=6, accum=3)
    assert steps == [2, 2]
    assert acc == pytest.approx(ref, abs=1e-5)


def test_the_steady_rate_leaves_out_the_first_step():
    """samples_per_s_after_first_step: the rows of the steps after the first over the time after it,
    as the loader benchmarks count after their first batch; a slow first batch (a cold loader) is
    in samples_per_s, not in it."""
    import time

    def slow_first(batch_size):
        for i, b in enumerate(batches(batch_size)):
            time.sleep(1.0 if i == 0 else 0.0)
            yield b

    device = torch.device("cpu")
    model = tiny_bert()
    opt = make_optimizer(model, 1e-3, 0.01)
    out = train_epoch(model, slow_first(8), opt, make_scheduler(opt, 4, 0.1), device, 1.0)
    assert out["steps"] == 4 and out["samples"] == ROWS and out["samples_after_first_step"] == ROWS - 8
    assert out["first_step_seconds"] >= 1.0
    steady = out["epoch_seconds"] - out["first_step_seconds"]
    assert out["samples_per_s_after_first_step"] == pytest.approx((ROWS - 8) / steady)
    assert out["epoch_seconds"] - steady >= 1.0  # the 1 s wait is outside the steady window
    assert out["samples_per_s"] == pytest.approx(ROWS / out["epoch_seconds"])  # ... and inside the whole one


def test_activation_checkpointing_gives_the_same_losses():
    plain, _ = run(batch_size=8, accum=1)
    recomputed, _ = run(batch_size=8, accum=1, checkpointing=True)
    assert recomputed == pytest.approx(plain, abs=1e-6)


def _ranks(rank: int, world_size: int, port: int, strategy: str, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        big, _ = run(batch_size=8, accum=1, strategy=strategy, rank=rank, world_size=world_size)
        acc, _ = run(batch_size=4, accum=2, strategy=strategy, rank=rank, world_size=world_size, checkpointing=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump([big, acc], f)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # Results are on disk. Skip the interpreter's teardown: once (1 in ~3 full-suite runs) gloo's
    # threads aborted it ("terminate called without an active exception") after all work was done.
    os._exit(0)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_ranks_sync_once_per_accumulated_step(strategy, tmp_path):
    # spawned ranks (never forked: this process may hold a Ray driver); results come back as files
    mp.spawn(_ranks, args=(2, free_port(), strategy, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    big, acc = results[0]
    assert len(big) == 4  # 16 rows per rank, 8 per step, 2 epochs
    assert acc == pytest.approx(big, abs=1e-5)
    assert results[1] == results[0]  # step losses are averaged over ranks


# ---------------------------------------- a rank with no sample left in a step (loader/order.py)
def bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def bn_batch(seed: int, rows: int = 6, stand_in: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {"x": torch.randn(rows, 4, generator=g) * (1 + seed), "labels": torch.randint(0, 3, (rows,), generator=g)}
    if stand_in:
        batch[STAND_IN] = torch.ones(())
    return batch


def bn_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def bn_epoch(model, batches, accum: int = 1, losses: list | None = None) -> dict:
    def loss_fn(m, b):
        loss = bn_loss(m, b)
        if losses is not None:
            losses.append(loss.item())
        return loss

    opt = make_optimizer(model, 1e-2, 0.01)
    return train_epoch(model, batches, opt, make_scheduler(opt, 4, 0.0), torch.device("cpu"), 1.0,
                       accum_steps=accum, loss_fn=loss_fn)


def test_a_stand_in_batch_trains_nothing():
    """A stand-in in a step adds no gradient, no BatchNorm statistics and no sample: the step is the
    one its real batches make alone."""
    ref, with_stand_in = bn_model(), bn_model()
    a = bn_epoch(ref, [bn_batch(1)])
    b = bn_epoch(with_stand_in, [bn_batch(1), bn_batch(2, stand_in=True)], accum=2)
    assert (a["steps"], a["samples"]) == (b["steps"], b["samples"]) == (1, 6)
    assert b["step_losses"] == pytest.approx(a["step_losses"], abs=1e-6)
    for (name, x), y in zip(ref.state_dict().items(), with_stand_in.state_dict().values()):
        assert torch.equal(x, y), name  # weights and BatchNorm running statistics alike


def _stand_in_ranks(rank: int, world_size: int, port: int, strategy: str, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = parallelize(bn_model(), strategy, torch.device("cpu"))
        # rank 1 has no sample left in the second step: its batch is a stand-in
        batches = [bn_batch(0), bn_batch(1)] if rank == 0 else [bn_batch(2), bn_batch(3, stand_in=True)]
        losses: list[float] = []
        out = bn_epoch(model, batches, losses=losses)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({k: out[k] for k in ("steps", "samples", "step_losses")} | {"losses": losses}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as _ranks: skip the interpreter's teardown


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_rank_with_a_stand_in_takes_the_step_with_the_others(strategy, tmp_path):
    mp.spawn(_stand_in_ranks, args=(2, free_port(), strategy, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["steps"] == r1["steps"] == 2 and r0["samples"] == r1["samples"] == 18  # 3 real batches of 6
    assert r0["step_losses"] == r1["step_losses"]
    assert r0["step_losses"][1] == pytest.approx(r0["losses"][1], abs=1e-6)  # the second step: rank 0's batch only


def _probe(rank: int = 0, world_size: int = 1, l2: float = 1e-2):
    from workflows.tasks.text.model import linear_probe

    model = tiny_bert()
    stats = linear_probe(model, batches(5, rank, world_size), torch.device("cpu"), l2)
    return model, stats


def test_linear_probe_fits_the_head_as_a_logistic_regression():
    from sklearn.linear_model import LogisticRegression

    l2 = 1e-2
    model, stats = _probe(l2=l2)
    assert stats["rows"] == ROWS
    ids, mask, labels = rows()
    with torch.no_grad():  # the head's input, computed independently of the probe's hook
        feats = model.bert(input_ids=ids, attention_mask=mask).pooler_output.double().numpy()
        probs = torch.softmax(model(input_ids=ids, attention_mask=mask).logits, -1).double().numpy()
    # sklearn minimizes 0.5*|W|^2 + C * sum(CE); the probe mean(CE) + l2*|W|^2, i.e. C = 1 / (2 * l2 * n)
    ref = LogisticRegression(C=1 / (2 * l2 * ROWS), tol=1e-10, max_iter=10_000).fit(feats, labels.numpy())
    assert probs == pytest.approx(ref.predict_proba(feats), abs=2e-3)
    assert stats["train_accuracy"] == pytest.approx(float((probs.argmax(-1) == labels.numpy()).mean()))


def _probe_ranks(rank: int, world_size: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model, stats = _probe(rank, world_size)
        head = model.classifier
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"weight": head.weight.tolist(), "bias": head.bias.tolist(), "rows": stats["rows"]}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as _ranks: skip the interpreter's teardown


def test_linear_probe_on_two_ranks_fits_one_head_on_all_rows(tmp_path):
    mp.spawn(_probe_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]  # identical heads: the ranks start fine-tuning from the same weights
    assert results[0]["rows"] == ROWS  # each rank saw its half; the fit used both
    single, _ = _probe()
    assert torch.tensor(results[0]["weight"]) == pytest.approx(single.classifier.weight.detach(), abs=1e-3)
    assert torch.tensor(results[0]["bias"]) == pytest.approx(single.classifier.bias.detach(), abs=1e-3)


def test_validation_scores_are_sklearns_on_the_rows_of_the_confusion_matrix():
    from sklearn.metrics import accuracy_score, f1_score

    from workflows.tasks.classify import scores_from_confusion

    rng = np.random.default_rng(0)
    confusion = rng.integers(0, 20, (5, 5)).astype(np.float64)
    confusion[3, :] = 0  # a class never gold
    confusion[:, 1] = 0  # a class never predicted
    gold, pred = np.divmod(np.repeat(np.arange(25), confusion.reshape(-1).astype(int)), 5)
    scores = scores_from_confusion(confusion)
    assert scores["rows"] == len(gold)
    assert scores["accuracy"] == accuracy_score(gold, pred)
    assert scores["f1"] == f1_score(gold, pred, labels=range(5), average="weighted", zero_division=0)
    # the hand-written F1 it replaced: 2PR/(P+R) per class, weighted by support
    tp, support, predicted = np.diag(confusion), confusion.sum(1), confusion.sum(0)
    p = np.divide(tp, predicted, out=np.zeros(5), where=predicted > 0)
    r = np.divide(tp, support, out=np.zeros(5), where=support > 0)
    f = np.divide(2 * p * r, p + r, out=np.zeros(5), where=p + r > 0)
    assert scores["f1"] == pytest.approx((f * support).sum() / support.sum(), rel=1e-12)
    assert scores_from_confusion(np.zeros((3, 3))) == {"accuracy": 0.0, "f1": 0.0, "rows": 0}


def test_bf16_autocast_trains_as_fp32_with_each_step_on_the_new_weights(monkeypatch):
    """amp=bf16 autocasts each forward (loop.autocast). One autocast context held around the epochs, as
    the torchrun path held it on a GPU, keeps its first bf16 casts of the weights (autocast's cast cache)
    until it exits: every step's forward ran on the step-0 weights, and the quickstart's loss stayed at
    chance (val F1 0.38 against 0.89 in fp32 on an H200, benchmarks/gpu/README.md). The loop refuses
    to run inside one."""
    import workflows.train.loop as loop

    device = torch.device("cpu")
    same = next(batches(8))  # one batch, again at every step: its loss falls only if the weights move

    def losses(amp=None) -> list[float]:
        model = tiny_bert()
        opt = make_optimizer(model, 1e-2, 0.0)
        return train_epoch(model, iter([same] * 6), opt, make_scheduler(opt, 6, 0.0), device, amp=amp)["step_losses"]

    fp32, bf16 = losses(), losses(torch.bfloat16)
    assert fp32[0] - fp32[-1] > 0.3
    assert bf16 == pytest.approx(fp32, abs=0.05)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(RuntimeError, match="inside an autocast context"):
        losses()
    monkeypatch.setattr(loop, "check_no_outer_autocast", lambda device: None)
    with torch.autocast("cpu", torch.bfloat16):  # the old way: the forward never sees the steps' updates
        stale = losses()
    assert stale[0] - stale[-1] < 0.2 * (fp32[0] - fp32[-1])
