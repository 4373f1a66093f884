"""The model lifecycle's goals (issue 64), end to end on real parts; each is `extended` (minutes: pipeline
runs, Serve rollovers under load), the gate covering the same paths faster: the quickstart run's gate
promotion and served alias (test_e2e), the MLflow alias and lineage (test_tracking), alias records and
concurrent moves, the follower and the config (test_registry_aliases), a chat adapter by alias
(test_chat_serve).

- A retrain on data with a fifth of its training labels shuffled registers a new version but does not
  move `production`; a clean retrain with more rows does; both decisions record both scores on the same rows.
- Under load at concurrency 32, an alias move rolls serving over with 0 failed requests, and only the new
  version answers within the stated bound (workflows.bench.serve_changes.ROLLOVER_BOUND_S) after the move.
- Scale to zero and back: every request answered, the cold start measured.
"""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import QUICKSTART, run_cli, sets
from tests.helpers import tiny_overrides

pytestmark = [pytest.mark.integration]


def _pipeline(overrides: list[str], ray_join) -> dict:
    res = run_cli("pipeline", "--config", str(QUICKSTART), *sets([*overrides, *ray_join.overrides]),
                  env=ray_join.env, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _store(cfg):
    from workflows.storage.embedded import EmbeddedS3

    return EmbeddedS3(cfg.storage.embedded.data_dir)


@pytest.mark.extended  # three pipeline runs (minutes); the gate runs the gate's first promotion (test_e2e)
def test_a_noisy_retrain_keeps_production_and_a_clean_bigger_one_takes_it(tmp_path, ray_join):
    from workflows import registry, registry_aliases
    from workflows.config import load_config
    from workflows.dataset import split_of
    from workflows.preprocess.encoding import compose_texts
    from workflows.preprocess.quickstart_data import build_dataset
    from workflows.storage.uri import StorageContext, filesystem

    # The gate set: the held-out texts of a larger build of the quickstart data (128 rows, in no run's
    # training split: the split is a hash of the text). On the 29 held-out rows of the first run alone,
    # a difference of one row decides (a noisy retrain measured +0.011 there), so the gate compares on
    # this set, with a margin of 0.02 (between 2 and 3 of its rows).
    gate = tmp_path / "gate"
    gate.mkdir()
    held_out = [r for r in build_dataset(150).rows if split_of(compose_texts({"text": [r["text"]]}, ["text"])[0],
                                                                     0, 0.1, 0.2) == "test"]
    (gate / "rows.jsonl").write_text("".join(json.dumps({"text": r["text"], "label": r["label"]}) + "\n"
                                             for r in held_out))
    base = [*tiny_overrides(tmp_path), "tune.enabled=false", "serve.enabled=false", "train.epochs=2",
            "train.batch_size=16", "train.max_train_rows=null", "data.builtin_rows_per_class=40",
            f"registry.gate_data={gate}/", "registry.promote.margin=0.02"]
    first = _pipeline(base, ray_join)
    assert "promote: quickstart@production -> v1: the first version to take it" in first.stderr

    # the same rows, a fifth of the training split's labels shuffled among themselves
    cfg = load_config(QUICKSTART, base)
    with _store(cfg) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        fs, path = filesystem(cfg.data.source, ctx)
        rows = [json.loads(line) for f in sorted(fs.find(path)) for line in fs.cat_file(f).decode().splitlines()
                if line.strip()]
    d = cfg.data
    texts = compose_texts({"text": [r["text"] for r in rows]}, d.text_columns)
    train = [i for i, t in enumerate(texts) if split_of(t, d.split_seed, d.val_fraction, d.test_fraction) == "train"]
    rng = random.Random(0)
    picked = rng.sample(train, len(train) // 5)
    labels = [rows[i]["label"] for i in picked]
    rng.shuffle(labels)
    for i, label in zip(picked, labels):
        rows[i] = {**rows[i], "label": label}
    noisy = tmp_path / "noisy"
    noisy.mkdir()
    (noisy / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = _pipeline([*base, f"data.source={noisy}/", "data.builtin=null"], ray_join)
    assert "promote: quickstart@production stays at v1: f1 " in second.stderr, second.stderr[-3000:]
    print(next(ln for ln in second.stderr.splitlines() if "promote: " in ln))

    # clean data with more rows (a new raw prefix the quickstart builds into)
    third = _pipeline([*base, "data.source=s3://workflows/raw/more/", "data.builtin_rows_per_class=100"], ray_join)
    assert "promote: quickstart@production -> v3: f1 " in third.stderr, third.stderr[-3000:]
    print(next(ln for ln in third.stderr.splitlines() if "promote: " in ln))

    with _store(cfg) as s3:
        ctx = StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)
        assert registry.versions(cfg, ctx, "quickstart") == [1, 2, 3]  # the noisy one is registered all the same
        assert registry_aliases.holder(cfg, ctx, "quickstart", "production") == 3
        cards = {v: registry.model_card(cfg, ctx, f"quickstart:{v}") for v in (2, 3)}
    for version, promoted in ((2, False), (3, True)):
        decision = cards[version].promotion
        test, on_gate = decision["scores"]["test"], decision["scores"]["gate"]
        assert decision["promoted"] is promoted and decision["holder"] == 1 and decision["candidate"] == version
        # both versions scored on the same rows, each score recorded: the candidate's held-out split
        # and the gate set, which decides
        assert test["rows"] == cards[version].metrics["rows"] and {"candidate", "holder"} <= set(test)
        assert test["candidate"] == cards[version].metrics["weighted"]["f1"]
        assert on_gate["rows"] == len(held_out) and decision["decided_on"] == "gate"
        assert (on_gate["candidate"] > on_gate["holder"] + 0.02) is promoted, decision
        print(f"v{version}: {decision['reason']}")
    history = run_cli("models", "history", "quickstart", "--config", str(QUICKSTART), *sets(base)).stdout
    assert "@production: nothing -> v1" in history and "@production: v1 -> v3" in history
    assert "v1 -> v2" not in history


@pytest.mark.extended  # two Serve deployments under load and eight cold starts (minutes); the gate serves
# quickstart@production (test_e2e) and checks the follower (test_registry_aliases)
def test_an_alias_move_rolls_serving_over_under_load_and_scale_to_zero_comes_back(quickstart_run, ray_join):
    from ray import serve

    from tests.conftest import shutdown_serve
    from workflows.bench.serve import _test_rows
    from workflows.bench.serve_changes import ROLLOVER_BOUND_S, rolling_update, scale_to_zero
    from workflows.config import load_config
    from workflows.runtime import runtime

    cfg = load_config(QUICKSTART, [*quickstart_run.overrides, *ray_join.overrides])
    try:
        with runtime(cfg) as rt:
            rows = _test_rows(rt, "quickstart:1", 128)
            rolled = rolling_update(rt, "quickstart:1", rows, concurrency=32)
            serve.delete("bench")
            zero = scale_to_zero(rt, "quickstart:1", rows, cycles=4, warm_requests=10)
            serve.delete("bench")
    finally:
        shutdown_serve()
    print(json.dumps({"rolling_update": rolled, "scale_to_zero": zero}, indent=2))
    assert rolled["concurrency"] == 32 and rolled["requests"] > 100
    assert rolled["failed"] == 0 and rolled["switched"], rolled
    assert rolled["last_old_version_s"] <= ROLLOVER_BOUND_S, rolled
    assert zero["failed"] == 0 and zero["requests"] == 4 * 11, zero
    assert zero["cold_p50_ms"] > zero["warm_p50_ms"] and zero["cold_p99_ms"] >= zero["cold_p50_ms"], zero
