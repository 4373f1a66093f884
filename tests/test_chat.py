"""The chat task (#50): assistant-only labels with the eos that ends each turn, padding masked by the
attention mask (pad = eos), the seeded synthetic instruction set, exact-match scoring, and one
pipeline through the real CLI on a tiny random Llama (LoRA on 2 workers, registered adapter, card =
`evaluate --split val`, the adapter served OpenAI-compatible and streamed from with the `openai` client,
`workflows predict` on a prompts file). In `make test-all` only: full fine-tuning, the pipeline on
parquet prompt/completion rows with Tune over lr and the LoRA rank and 2 DDP workers, and a killed
DDP worker resuming its LoRA adapter."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.chat_model import chat_texts, tiny_chat_model
from tests.conftest import ROOT, run_cli, sets, shutdown_serve
from tests.helpers import tiny_overrides
from workflows.preprocess import chat_data

CHAT = ROOT / "configs" / "chat.yaml"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny_chat_model(tmp_path_factory.mktemp("chat") / "tiny", chat_texts(chat_data.build(60)))


@pytest.fixture(scope="module")
def encoder(tiny_dir):
    from workflows.tasks.chat.training.data import ChatEncoder

    return ChatEncoder(str(tiny_dir), 256)


def pieces(encoder, ids, labels) -> list[str]:
    return [encoder.tok.decode([i]) for i, lab in zip(ids, labels) if lab != -100]


def test_labels_are_the_assistant_turns_and_the_eos_ending_each(encoder):
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
                    {"role": "assistant", "content": "4"}, {"role": "user", "content": "Convert 3 km to m."},
                    {"role": "assistant", "content": "3000"}]
    row = encoder.encode(conversation)
    ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
    eos = encoder.tok.eos_token_id
    assert len(ids) == len(labels)
    # both answers and their closing eos are labels, as the ids they are; nothing else is
    assert "".join(pieces(encoder, ids, labels)) == "4<|im_end|>3000<|im_end|>"
    assert all(lab in (-100, tid) for tid, lab in zip(ids, labels))
    assert [tid for tid, lab in zip(ids, labels) if lab == eos] == [eos, eos]
    # eos also closes the system and user turns: those are not labels
    assert ids.count(eos) == 5 and labels.count(eos) == 2
    # what greedy decoding starts from is the template's generation prompt for the last turn
    assert row["prompt_ids"].tolist() == encoder.prompt_ids(conversation[:-1])
    assert encoder.tok.decode(row["answer_ids"].tolist()) == "3000"
    assert ids[: len(row["prompt_ids"])] == row["prompt_ids"].tolist()


def test_padding_is_masked_by_the_attention_mask_not_by_the_pad_id(encoder):
    """pad = eos here: the eos that ends an answer is a label and attended, the padding after a shorter
    row is neither, though both have the same id."""
    from workflows.tasks.chat.training.data import chat_collate, to_messages

    tok = encoder.tok
    assert tok.pad_token_id == tok.eos_token_id
    rows = [encoder.encode(to_messages({"prompt": p, "completion": c}))
            for p, c in (("What is 2 + 2?", "4"), ("Rewrite the date 2021-03-07 in the format DD/MM/YYYY.",
                                                   "07/03/2021"))]
    batch = chat_collate({k: np.array([r[k] for r in rows], dtype=object) for k in rows[0]}, tok.pad_token_id,
                         prompts=True)
    short, n = 0, len(rows[0]["input_ids"])
    ids, mask, labels = batch["input_ids"][short], batch["attention_mask"][short], batch["labels"][short]
    assert ids.shape[0] > n and (ids[n:] == tok.pad_token_id).all()  # padded with the eos id
    assert mask[:n].all() and not mask[n:].any()
    assert (labels[n:] == -100).all()
    assert labels[labels != -100][-1] == tok.eos_token_id  # the answer's eos is a label, padding is not
    # prompts for decoding are left-padded, their padding masked too
    p = len(rows[0]["prompt_ids"])
    assert batch["prompt_mask"][short, -p:].all() and not batch["prompt_mask"][short, :-p].any()
    assert batch["prompt_ids"][short, -p:].tolist() == rows[0]["prompt_ids"].tolist()
    # and the model's loss counts the labels only: padding more changes nothing
    import torch

    from workflows.tasks.chat.training.model import load_causal_lm
    from workflows.tasks.chat.training.scoring import token_nll

    model = load_causal_lm(str(encoder.tok.name_or_path)).eval()
    wide = {k: torch.nn.functional.pad(v, (0, 5), value=(-100 if k == "labels" else 0 if k == "attention_mask"
                                                         else tok.pad_token_id))
            for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        (nll, count), (nll_wide, count_wide) = token_nll(model, batch), token_nll(model, wide)
    assert count.tolist() == count_wide.tolist() == [len([x for x in r["labels"] if x != -100]) for r in rows]
    assert torch.allclose(nll, nll_wide, atol=1e-4)


def test_rows_without_a_final_answer_or_too_long_are_not_stored(encoder):
    from workflows.tasks.chat.training.data import ChatEncoder, to_messages

    assert to_messages({"messages": [{"role": "user", "content": "hi"}]}) is None
    assert to_messages({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}) is None
    assert to_messages({"messages": json.dumps([{"role": "user", "content": "a"},
                                                {"role": "assistant", "content": "b"}])})[1]["content"] == "b"
    assert to_messages({"prompt": "a", "completion": "b"}, system_prompt="S")[0] == {"role": "system", "content": "S"}
    short = ChatEncoder(str(encoder.tok.name_or_path), 12)
    assert short.encode(to_messages({"prompt": "What is 12 + 13? Answer with the number only.",
                                     "completion": "25"})) is None


def test_the_synthetic_set_is_seeded_and_answers_are_exact():
    rows = chat_data.build(25)
    assert rows == chat_data.build(25) and rows != chat_data.build(25, seed=1)
    assert len(rows) == 100 and len({r["messages"][0]["content"] for r in rows}) == 100
    assert {r["kind"] for r in rows} == set(chat_data.KINDS)
    for r in rows:
        prompt, answer = (m["content"] for m in r["messages"])
        if r["kind"] == "arithmetic":
            a, op, b = prompt.split("?")[0].removeprefix("What is ").split()
            assert int(answer) == eval(f"{int(a)} {op} {int(b)}")  # noqa: S307 (digits and one operator)
        elif r["kind"] == "extraction":
            assert answer in prompt


def test_exact_match_compares_stripped_answers():
    from workflows.tasks.chat.training.scoring import exact_match

    assert exact_match(["42", "07/03/2021", "Porto"], [" 42\n", "7/3/2021", "Porto"]) == pytest.approx(2 / 3)
    assert exact_match([], []) == 0.0


def test_tune_space_takes_task_options(tiny_dir):
    from workflows.config import load_config
    from workflows.pipeline.stages import apply_params
    from workflows.tune.search import trial_config

    cfg = load_config(CHAT, [f"model.name_or_path={tiny_dir}"])
    assert "model.options.lora_r" in cfg.tune.space
    trial = trial_config(cfg, {"train.lr": 1e-3, "model.options.lora_r": 8})
    assert trial.model.options["lora_r"] == 8 and trial.train.lr == 1e-3
    tuned = apply_params(cfg, {"model.options.lora_r": 4, "train.lr": 2e-3})
    assert tuned.model.options["lora_r"] == 4 and cfg.model.options["lora_r"] == 16
    from workflows.errors import UserError

    with pytest.raises(UserError, match="lora_r"):
        apply_params(cfg, {"model.options.lora_r": 0})


def chat_overrides(tmp: Path, base: Path) -> list[str]:
    """The chat config on the tiny model, with local storage (the test reads the manifest and the
    registered files), 160 conversations, answers of up to 8 tokens."""
    return [*tiny_overrides(tmp), f"storage.root={tmp}/store", "storage.embedded.enabled=false",
            f"data.source={tmp}/raw/chat/", "data.write_builtin=true", f"model.name_or_path={base}",
            "data.builtin_rows_per_class=40", "preprocess.max_length=96", "train.max_train_rows=null",
            "train.epochs=4", "train.batch_size=8", "train.lr=1e-2", "model.options.max_new_tokens=8",
            "model.options.lora_r=8", "train.checkpoint_select=last", "serve.generate.max_tokens=8"]


@pytest.mark.integration
# the gate runs LoRA, the demo's path, and serves it; full fine-tuning is in make test-all
@pytest.mark.parametrize("finetune", ["lora", pytest.param("full", marks=pytest.mark.extended)])
def test_chat_pipeline_on_two_fsdp2_workers_registers_the_validated_model(tiny_dir, tmp_path, finetune, request):
    """Data, preprocess, fine-tuning on 2 workers (FSDP2; LoRA: the adapter registered, full: the whole
    model), evaluation against the base model, then `evaluate --split val` gives the card's val figures.
    LoRA: the pipeline (in the session's cluster) also serves the adapter on its base, OpenAI-compatible,
    which the `openai` client streams from, and `workflows predict` writes completions of a prompts file."""
    overrides = [*chat_overrides(tmp_path, tiny_dir), f"model.options.finetune={finetune}", "train.strategy=fsdp"]
    ray_join = None
    if finetune == "full":
        overrides += ["train.lr=2e-3", "serve.enabled=false"]
        res = run_cli("pipeline", "--config", str(CHAT), *sets(overrides), timeout=900)
    else:
        # the session's cluster: Serve outlives the command, and the later commands start no Ray of their own
        ray_join = request.getfixturevalue("ray_join")
        try:
            res = run_cli("pipeline", "--config", str(CHAT), *sets([*overrides, *ray_join.overrides]),
                          env=ray_join.env, timeout=900)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
            served_answers_stream(tmp_path)
        finally:
            shutdown_serve()  # its replica holds a CPU of the session's cluster
        predict_writes_completions(tmp_path, overrides, ray_join)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "chat" / "pipeline.json").read_text())
    manifest = json.loads(Path(summary["dataset"]["uri"], "manifest.json").read_text())
    assert manifest["task"] == "chat" and manifest["label_column"] == "answer"
    assert sum(manifest["counts"].values()) == 160 and manifest["info"]["dropped"] == {"too_long": 0, "invalid": 0}

    # the card names the base model and the sha256 of its weights, and what was exported
    from workflows.tasks.chat.training.model import weights_sha256

    model_dir = Path(summary["model"]["uri"])
    card = json.loads((model_dir / "workflows.json").read_text())
    assert card["task"] == "chat" and card["export"] == ("adapter" if finetune == "lora" else "full")
    assert card["base"] == {"name_or_path": str(tiny_dir), "sha256": weights_sha256(str(tiny_dir))}
    weights = "adapter_model.safetensors" if finetune == "lora" else "model.safetensors"
    assert [p.name for p in model_dir.glob("*.safetensors")] == [weights]
    assert {"val_loss", "val_perplexity", "val_exact_match"} <= set(card["val_metrics"])

    # training lowered the loss below the random base model's, which evaluation reports beside it
    assert summary["evaluate"]["headline"]["name"] == "exact match"
    held_out_beats_the_base_and_val_is_the_card(tmp_path, model_dir, manifest, card, overrides, ray_join)

    if ray_join is not None:
        # resuming the finished run loads its last checkpoint into new LoRA adapters on 2 workers and
        # registers it again: the same adapter weights, not the new adapters' initial ones
        from safetensors.torch import load_file

        res = run_cli("train", "--config", str(CHAT), "--resume", *sets([*overrides, *ray_join.overrides]),
                      env=ray_join.env, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        again = model_dir.parent / "v2"
        first, second = (load_file(d / "adapter_model.safetensors") for d in (model_dir, again))
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)


def held_out_beats_the_base_and_val_is_the_card(tmp: Path, model_dir: Path, manifest: dict, card: dict,
                                                overrides: list[str], ray_join=None) -> None:
    """The held-out loss is below the base model's (evaluation reports both), and `workflows evaluate
    --split val` (in the session's cluster when `ray_join` is given) gives the card's val figures."""
    held_out = json.loads((model_dir / "evaluation.json").read_text())
    assert held_out["rows"] == manifest["counts"]["test"]
    assert held_out["loss"] < held_out["baseline"]["loss"] - 0.02, held_out
    val_out = tmp / "val.json"
    joined = ray_join.overrides if ray_join else []
    res = run_cli("evaluate", "--config", str(CHAT), "--model", "chat", "--split", "val", "--output", str(val_out),
                  *sets([*overrides, *joined]), env=ray_join.env if ray_join else None, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    val = json.loads(val_out.read_text())
    assert val["rows"] == manifest["counts"]["val"]
    for key in ("loss", "perplexity", "exact_match"):
        assert val[key] == pytest.approx(card["val_metrics"][f"val_{key}"], abs=0.005), (key, val, card)


def served_answers_stream(tmp: Path) -> None:
    """The pipeline's own requests streamed answers; the `openai` client streams one more."""
    import openai

    summary = json.loads((tmp / "runs" / "chat" / "pipeline.json").read_text())
    serve = summary["serve"]
    assert serve["model"] == "chat:1" and len(serve["requests"]) == 2
    for sent in serve["requests"]:
        assert sent["prediction"]["chunks"] >= 2 and sent["prediction"]["finish_reason"] in ("stop", "length")
        # the same asked for as JSON (a schema of one string): an answer that ended parses to it
        structured, reason = sent["prediction"]["json"], sent["prediction"]["json_finish_reason"]
        assert reason in ("stop", "length") and (reason == "stop") == (set(structured or {}) == {"answer"})
    client = openai.OpenAI(base_url=f"{serve['url']}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["chat:1"]
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    chunks = list(client.chat.completions.create(model="chat:1", messages=question, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    again = client.chat.completions.create(model="chat:1", messages=question, temperature=0)
    assert again.choices[0].message.content == text and again.usage.completion_tokens <= 8


def predict_writes_completions(tmp: Path, overrides: list[str], ray_join) -> None:
    """`workflows predict` on a JSONL file of prompts: a completion per row, through the engine."""
    import pandas as pd

    prompts = tmp / "prompts.jsonl"
    rows = ["What is 2 + 2?", "Convert 3 km to m.", "Rewrite the date 2021-03-07 in the format DD/MM/YYYY."]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    out = tmp / "completions"
    res = run_cli("predict", "--config", str(CHAT), "--model", "chat", "--data", str(prompts), "--output", str(out),
                  "--concurrency", "1", *sets([*overrides, *ray_join.overrides]), env=ray_join.env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    table = pd.concat([pd.read_parquet(f) for f in sorted(out.glob("*.parquet"))])
    assert sorted(table["prompt"]) == sorted(rows)
    assert set(table["finish_reason"]) <= {"stop", "length"} and table["prediction"].map(type).eq(str).all()


def prompt_completion_parquet(out: Path, rows_per_kind: int) -> list[dict]:
    """The synthetic set as a user would bring their own: parquet rows of `prompt` and `completion`
    (plus a column the task ignores), in two shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": r["messages"][0]["content"], "completion": r["messages"][1]["content"], "kind": r["kind"]}
            for r in chat_data.build(rows_per_kind)]
    out.mkdir(parents=True)
    half = len(rows) // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.Table.from_pylist(part), out / f"part-{i}.parquet")
    return rows


@pytest.mark.integration
# extended: variants of the gated LoRA pipeline (DDP for FSDP2, tuning, parquet prompt/completion rows)
@pytest.mark.extended
def test_chat_pipeline_tunes_lora_rank_under_ddp_on_prompt_completion_parquet(tiny_dir, tmp_path, ray_join):
    """`workflows pipeline --config chat` on parquet rows of prompt/completion, tuning train.lr and
    the LoRA rank (2 trials, ASHA), then fine-tuning the best on 2 DDP workers: the rows are read as
    one user turn and its answer, the registered adapter has the chosen rank (card and adapter), and
    it is the validated model (card = `evaluate --split val`)."""
    from safetensors.torch import load_file

    rows = prompt_completion_parquet(tmp_path / "raw" / "pc", 40)
    space = ('{"train.lr": {"loguniform": [5.0e-3, 2.0e-2]}, '
             '"model.options.lora_r": {"grid": [2, 4]}}')  # one trial per rank: 2 trials
    overrides = [*chat_overrides(tmp_path, tiny_dir), f"data.source={tmp_path}/raw/pc/", "data.builtin=null",
                 "data.write_builtin=false", "train.strategy=ddp", "serve.enabled=false",
                 "tune.enabled=true", "tune.scheduler=asha", "tune.num_samples=1", f"tune.space={space}",
                 "tune.max_epochs=2", "tune.grace_period=1"]
    # in the session's cluster, as the gated pipeline: no second Ray to start on a small machine
    res = run_cli("pipeline", "--config", str(CHAT), *sets([*overrides, *ray_join.overrides]), env=ray_join.env,
                  timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-4000:]
    summary = json.loads((tmp_path / "runs" / "chat" / "pipeline.json").read_text())

    # the parquet rows, read as prompt -> user turn, completion -> the assistant's answer
    manifest = json.loads(Path(summary["dataset"]["uri"], "manifest.json").read_text())
    assert manifest["task"] == "chat" and manifest["format"] == "parquet", manifest
    assert sum(manifest["counts"].values()) == len(rows) and manifest["info"]["dropped"] == {"too_long": 0,
                                                                                          "invalid": 0}
    import pandas as pd

    val = pd.concat([pd.read_parquet(f.removeprefix("file://")) for f in manifest["files"]["val"]])
    by_prompt = {r["prompt"]: r["completion"] for r in rows}
    assert len(val) == manifest["counts"]["val"]
    for prompt, answer in zip(val["prompt"], val["answer"]):
        assert json.loads(prompt)[0]["role"] == "user" and by_prompt[json.loads(prompt)[0]["content"]] == answer

    # tuning ran 2 trials (ASHA, on val_loss), and the pipeline trained the best one's values
    tune = json.loads((tmp_path / "runs" / "chat" / "tune.json").read_text())
    assert len(tune["trials"]) == 2 and sorted(t["params"]["model.options.lora_r"] for t in tune["trials"]) == [2, 4]
    assert tune["config"]["tune"]["scheduler"] == "asha" and tune["config"]["tune"]["metric"] == "val_loss"
    assert all(1 <= t["epochs"] <= 2 and t["error"] is None for t in tune["trials"])
    best = summary["tune"]["best_params"]
    assert best == tune["best_params"] and summary["tune"]["trials"] == 2
    chosen = best["model.options.lora_r"]
    finished = [t for t in tune["trials"] if t["value"] is not None]
    assert min(finished, key=lambda t: t["value"])["params"] == best

    # trained on 2 DDP workers with the tuned values
    trained = json.loads((tmp_path / "runs" / "chat" / "train.json").read_text())["config"]
    assert trained["train"]["strategy"] == "ddp" and trained["train"]["num_workers"] == 2
    assert trained["train"]["lr"] == best["train.lr"] and trained["model"]["options"]["lora_r"] == chosen

    # the registered adapter has the chosen rank, in its card and in its weights
    model_dir = Path(summary["model"]["uri"])
    card = json.loads((model_dir / "workflows.json").read_text())
    assert card["export"] == "adapter" and card["options"]["lora_r"] == chosen
    assert json.loads((model_dir / "adapter_config.json").read_text())["r"] == chosen
    weights = load_file(model_dir / "adapter_model.safetensors")
    lora_a = [v for k, v in weights.items() if "lora_A" in k]
    assert lora_a and all(v.shape[0] == chosen for v in lora_a)
    # no DDP wrapper's name in what was saved
    assert not any(".module." in k or k.startswith("module.") for k in weights)

    # fine-tuning under DDP lowered the held-out loss below the base model's, and the registered
    # model is the one validated on 2 DDP ranks
    held_out_beats_the_base_and_val_is_the_card(tmp_path, model_dir, manifest, card, overrides, ray_join)


@pytest.mark.integration
# extended: a variant of the gated LoRA resume (`train --resume` under FSDP2), here a killed DDP worker
@pytest.mark.extended
def test_a_killed_chat_worker_resumes_its_lora_adapter_from_the_last_checkpoint(tiny_dir, tmp_path, ray_cluster):
    """LoRA on 2 DDP workers, worker rank 1 SIGKILLed in the middle of epoch 1 (as test_train_resume
    does for the text task): Ray Train restarts the group from epoch 0's checkpoint, which must load
    that checkpoint's adapter (and optimizer) into the new adapters, not train on from their fresh
    initial weights. The run then reproduces an uninterrupted one, step losses and adapter alike."""
    import torch
    from safetensors.torch import load_file

    from reliability.faults import TrainFault
    from workflows.config import load_config
    from workflows.pipeline.stages import export_artifact, stage_preprocess
    from workflows.runtime import runtime
    from workflows.train.checkpoint import consolidated_model_state, read_state
    from workflows.train.export import download_checkpoint
    from workflows.train.trainer import fit, latest_checkpoint

    cfg = load_config(CHAT, [*chat_overrides(tmp_path, tiny_dir), "train.strategy=ddp", "train.epochs=2",
                             "train.max_train_rows=48", "train.num_to_keep=2", "serve.enabled=false"])
    assert cfg.train.max_failures >= 1 and cfg.model.options["finetune"] == "lora"
    marker = tmp_path / "killed-once"
    with runtime(cfg) as rt:
        data = stage_preprocess(rt)
        reference = fit(cfg, rt.storage, data, run_prefix="reference")
        # SIGKILL worker rank 1 before its second step of epoch 1, once
        killed = fit(cfg, rt.storage, data, run_prefix="killed",
                     on_step=TrainFault(epoch=1, step=1, rank=1, action="kill", once=str(marker)))
        assert marker.exists(), "the fault never fired"

        def losses(outcome, epoch):
            (row,) = [h for h in outcome.history if h["epoch"] == epoch]
            return row["step_losses"]

        # each epoch once, the restarted group from epoch 0's checkpoint
        assert [h["epoch"] for h in killed.history] == [0, 1]
        assert [h["resumed_from_epoch"] for h in killed.history] == [None, 0]
        assert [len(h["step_losses"]) for h in reference.history] == [3, 3]  # 48 rows / 2 workers / batch 8
        # epoch 1, trained again after the restart, is the uninterrupted run's: the adapter and the
        # optimizer were restored (fresh adapters would start epoch 1 at the base model's loss)
        for epoch in (0, 1):
            np.testing.assert_allclose(losses(killed, epoch), losses(reference, epoch), rtol=1e-4, atol=1e-5)
        assert losses(killed, 1)[0] < losses(killed, 0)[0] - 0.05

        # the last checkpoint holds epoch 1's adapter, the same as the uninterrupted run's
        states = {}
        for name in ("reference", "killed"):
            with tempfile.TemporaryDirectory() as d:
                local = download_checkpoint(latest_checkpoint(cfg, rt.storage, name), rt.storage, d)
                assert read_state(local)["epoch"] == 1
                states[name] = consolidated_model_state(local)
        lora = sorted(k for k in states["reference"] if "lora_" in k)
        assert lora and states["killed"].keys() == states["reference"].keys()
        for k in lora:
            torch.testing.assert_close(states["killed"][k], states["reference"][k], rtol=1e-4, atol=1e-5)
        assert any(states["killed"][k].abs().max() > 0 for k in lora if "lora_B" in k)  # B starts at zero

        # and the adapter it exports (what `workflows train` registers) is that adapter
        exported = {}
        for name, outcome in (("reference", reference), ("killed", killed)):
            out = tmp_path / "export" / name
            out.mkdir(parents=True)
            export_artifact(cfg, rt.storage, data, outcome.best_checkpoint_uri, str(out), {})
            exported[name] = load_file(out / "adapter_model.safetensors")
        assert exported["killed"].keys() == exported["reference"].keys() and exported["killed"]
        for k in exported["killed"]:
            torch.testing.assert_close(exported["killed"][k], exported["reference"][k], rtol=1e-4, atol=1e-5)
