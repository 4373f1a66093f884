"""A LoRA adapter read back from the store (issue #63, findings 2 and 5): its config rebuilt from an
allow-list, its weights from safetensors only, and one that fails to load leaves nothing behind. Unit
tests without Ray, on the tiny random Llama of tests/chat_serve_task.py."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from tests.chat_serve_task import build_lora, build_tiny_chat, served
from tests.test_chat_faults import prompt
from workflows.errors import UserError
from workflows.tasks.chat.engine import SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, tokenizer, a good adapter's dir)."""
    out = tmp_path_factory.mktemp("tinychat")
    _, tokenizer = build_tiny_chat(out)
    build_lora(out, out / "lora", seed=1)
    return str(out), tokenizer, out / "lora"


def _edited(tmp_path, good, **changes):
    """A copy of the good adapter, its adapter_config.json edited by `changes` (None: key removed)."""
    out = tmp_path / "edited"
    shutil.copytree(good, out)
    doc = json.loads((out / "adapter_config.json").read_text())
    for k, v in changes.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    (out / "adapter_config.json").write_text(json.dumps(doc))
    return out


@pytest.fixture(scope="module")
def replica(tiny):
    """One serving predictor for the refusals, as one replica takes request after request: (it, the
    base's answer, its modules), checked unchanged after each."""
    predictor = served(tiny[0])
    try:
        yield predictor, _answer(predictor), [n for n, _ in predictor.engine.model.named_modules()]
    finally:
        predictor.close()


def _answer(predictor, adapter=None):
    gen = predictor.engine.submit(prompt(predictor.prompts.tokenizer), GREEDY, adapter)
    gen.result(60)
    return gen.tokens


HOSTILE_CONFIGS = [
    ("megatron_config", {"tensor_model_parallel_size": 1}),  # peft imports megatron_core for it
    ("layer_replication", [[0, 2], [0, 2]]),  # rebuilds the shared base's layers
    ("modules_to_save", ["lm_head"]),  # a trainable copy of the shared head
    ("use_dora", True),
    ("rank_pattern", {"q_proj": 64}),
    ("layers_to_transform", [0]),
    ("peft_type", "IA3"),
    ("r", 10**9),
    ("r", "4"),
    ("lora_alpha", "16"),
    ("lora_dropout", 5),
    ("target_modules", ".*"),  # a string is a regex to peft
    ("target_modules", ["../../x"]),
    ("target_modules", ["q_proj"] * 5000),
    ("target_modules", ["layers..q_proj"]),
    ("bias", "all"),
    ("task_type", "SEQ_CLS"),
]


@pytest.mark.parametrize(("key", "value"), HOSTILE_CONFIGS)
def test_an_adapters_config_is_rebuilt_from_an_allow_list(tiny, replica, tmp_path, monkeypatch, key, value):
    """peft applied every key of a served adapter's config: megatron_core names a module it imports,
    layer_replication and modules_to_save change the base every client of the replica shares (and stay
    after the adapter is deleted). Each is refused in one line naming the key, and the replica's base
    answers as before, its modules unchanged."""
    _, _, good = tiny
    predictor, base, modules = replica
    marker = tmp_path / "imported"
    (tmp_path / "planted_megatron.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = {"megatron_core": "planted_megatron"} if key == "megatron_config" else {}
    adapter = _edited(tmp_path, good, **{key: value}, **extra)
    with pytest.raises(UserError) as e:
        predictor.adapters.add("hostile:1", str(adapter)).result(60)
    assert len(str(e.value).splitlines()) == 1 and key in str(e.value), str(e.value)
    assert str(tmp_path) not in str(e.value)  # names the file, not where it lies
    assert not marker.exists() and "planted_megatron" not in sys.modules
    assert [n for n, _ in predictor.engine.model.named_modules()] == modules
    assert _answer(predictor) == base and predictor.adapters == {}


def test_an_adapter_loads_from_safetensors_only(tiny, replica, tmp_path, monkeypatch):
    """With no adapter_model.safetensors, peft fell back to adapter_model.bin (a pickle)."""
    from safetensors.torch import load_file

    _, _, good = tiny
    predictor, base, _ = replica
    adapter = _edited(tmp_path, good)
    weights = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(weights, adapter / "adapter_model.bin")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    with pytest.raises(UserError, match="safetensors only"):
        predictor.adapters.add("pickled:1", str(adapter)).result(60)
    assert loads == [] and _answer(predictor) == base and predictor.adapters == {}


def test_a_good_adapter_answers_as_peft_loads_it(tiny):
    """The rebuilt config and the safetensors weights give the adapter peft's own loader gives."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, tokenizer, good = tiny
    ids = torch.tensor([prompt(tokenizer)])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(good)).eval()
    predictor = served(model_dir)
    try:
        name = predictor.adapters.add("good:1", str(good)).result(60)
        model = predictor.engine.model
        assert not any(p.requires_grad for n, p in model.named_parameters() if f".{name}." in n)
        model.set_adapter(name)
        with torch.no_grad():
            assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)
    finally:
        predictor.close()


@pytest.mark.parametrize("damage", ["truncated", "a matrix missing", "a matrix for no module"])
def test_a_failed_hot_load_leaves_neither_a_listed_id_nor_a_loaded_adapter(tiny, tmp_path, damage):
    """An adapter whose weights failed to load stayed listed (/v1/models lists `predictor.adapters`),
    and its half-registered peft adapter (zero lora_B) was served by the next load of the same id. Now
    the failed load leaves nothing, and the same id, once its files are good, loads and answers as a
    fresh replica's."""
    from safetensors.torch import load_file, save_file

    model_dir, _, good = tiny
    adapter = _edited(tmp_path, good)
    weights_file = adapter / "adapter_model.safetensors"
    if damage == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[:100])
    else:
        weights = load_file(weights_file)
        first = sorted(weights)[0]
        if damage == "a matrix missing":
            del weights[first]
        else:
            weights[first.replace("layers.0.", "layers.7.")] = weights[first].clone()
        save_file(weights, weights_file)
    predictor, fresh = served(model_dir), served(model_dir)
    try:
        base = _answer(predictor)
        with pytest.raises(UserError):
            predictor.adapters.add("flaky:1", str(adapter)).result(60)
        assert predictor.adapters == {} and _answer(predictor) == base
        assert not hasattr(predictor.engine.model, "peft_config")  # a whole model, unwrapped again
        shutil.copy(good / "adapter_model.safetensors", weights_file)
        name = predictor.adapters.add("flaky:1", str(adapter)).result(60)
        expected = _answer(fresh, fresh.adapters.add("flaky:1", str(good)).result(60))
        assert predictor.adapters == {"flaky:1": name} and _answer(predictor, name) == expected != base
    finally:
        predictor.close()
        fresh.close()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_an_adapter_the_chat_task_exports_passes_the_allow_list(tiny, tmp_path, targets):
    """What `with_lora` trains and save_pretrained writes (task CAUSAL_LM, every linear layer or named
    ones, bias none) loads through load_adapter with every matrix of it."""
    from transformers import AutoModelForCausalLM

    from workflows.tasks.chat import ChatOptions
    from workflows.tasks.chat.adapters import load_adapter
    from workflows.tasks.chat.training.model import with_lora

    model_dir, tokenizer, _ = tiny
    trained = with_lora(AutoModelForCausalLM.from_pretrained(model_dir), ChatOptions(lora_target_modules=targets))
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    trained.save_pretrained(tmp_path / "exported")
    loaded = load_adapter(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "exported"), "default")
    ids = torch.tensor([prompt(tokenizer)])
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits, atol=1e-5)


def test_error_bodies_name_the_model_never_a_storage_uri_or_local_path(tiny, tmp_path, monkeypatch):
    """A 404 for a model the replica cannot serve carried the registry's message (the storage root URI,
    a card's URI, an adapter base's path) and a library ValueError passed through as a 400. Now each
    answer names the model, and what lies where stays in the replica's log."""
    import asyncio
    import json as jsonlib
    from types import SimpleNamespace

    from tests.conftest import ROOT
    from workflows import registry
    from workflows.config import load_config
    from workflows.model_card import CARD_FILE
    from workflows.serve.app import ModelServer
    from workflows.storage.uri import StorageContext
    from workflows.tasks.chat.engine import ModelNotFound
    from workflows.tasks.chat.openai.routes import Adapters
    from workflows.tasks.chat.training.model import weights_sha256

    model_dir, _, good = tiny
    root = tmp_path / "store"
    cfg = load_config(ROOT / "configs" / "chat.yaml", [f"storage.root={root}", "storage.embedded.enabled=false",
                                                      f"cache.dir={tmp_path / 'c'}"])
    ctx = StorageContext()
    base = {"name_or_path": f"{root}/secret/base", "sha256": weights_sha256(model_dir)}
    adapter_card = {"task": "chat", "export": "adapter", "base": base}
    registry.register(cfg, ctx, str(good), "good", adapter_card)
    registry.register(cfg, ctx, str(_edited(tmp_path, good, modules_to_save=["lm_head"])), "hostile", adapter_card)
    registry.register(cfg, ctx, str(good), "otherbase", {**adapter_card, "base": {**base, "sha256": "0" * 64}})
    edited = registry.register(cfg, ctx, str(good), "edited", adapter_card)
    card_file = root / "models" / "edited" / "v1" / CARD_FILE
    card_file.write_text(jsonlib.dumps({**jsonlib.loads(card_file.read_text()), "artifact_id": "../../x"}))
    server_class = ModelServer.func_or_class
    fake = SimpleNamespace(cfg=cfg, storage=ctx)
    predictor = served(model_dir)
    try:
        predictor.card.name = "tiny"
        adapters = Adapters(SimpleNamespace(predictor=predictor,
                                            read_card=lambda spec: server_class.read_card(fake, spec),
                                            fetch_model=lambda spec: server_class.fetch_model(fake, spec)))
        for spec in ("nope:1", "good:7", "edited:1", "otherbase:1", "hostile:1"):
            with pytest.raises(ModelNotFound) as e:
                asyncio.run(adapters.load(spec))
            message = str(e.value)
            assert spec.split(":")[0] in message and str(tmp_path) not in message and "store" not in message, \
                (spec, message)
        assert edited.version == 1 and asyncio.run(adapters.load("good:1")).name in predictor.adapters.values()

        def broken(*a, **k):
            raise ValueError(f"cannot read {tmp_path}/secret/tokenizer.json")

        monkeypatch.setattr(predictor.prompts.tokenizer, "apply_chat_template", broken)
        with pytest.raises(ValueError) as e:
            asyncio.run(predictor.prompts.encode(predictor.prompts.chat_ids, [{"role": "user", "content": "hi"}]))
        assert "tiny:1" in str(e.value) and str(tmp_path) not in str(e.value), str(e.value)
    finally:
        predictor.close()


def test_vllm_reads_the_adapter_the_checks_read_never_the_buckets_files(tiny, tmp_path):
    """engine=vllm: vLLM loads adapter folders itself, so it gets one rebuilt from what the checks passed
    (the allow-listed config, the rank-checked safetensors matrices); a rank above the engine's buffers
    (serve.generate.max_lora_rank) is refused naming the setting, before anything is written. No vLLM needed."""
    from safetensors.torch import load_file

    from workflows.tasks.chat.vllm_engine.model_files import checked_adapter

    _, _, good = tiny
    adapter = _edited(tmp_path, good, revision="main", inference_mode=True)
    (adapter / "README.md").write_text("a file vLLM never sees")
    out = tmp_path / "vllm"
    out.mkdir()
    folder = checked_adapter(str(adapter), str(out), max_rank=8)
    assert sorted(p.name for p in out.joinpath(folder).iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
    doc = json.loads((out / folder / "adapter_config.json").read_text())
    source = json.loads((good / "adapter_config.json").read_text())
    assert set(doc) == {"peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias"}
    assert (doc["r"], doc["lora_alpha"], doc["target_modules"]) == (source["r"], source["lora_alpha"],
                                                                     sorted(source["target_modules"]))
    theirs, ours = load_file(good / "adapter_model.safetensors"), load_file(out / folder / "adapter_model.safetensors")
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)

    with pytest.raises(UserError, match=r"r: 4 is above this server's serve.generate.max_lora_rank \(1\)"):
        checked_adapter(str(adapter), str(out), max_rank=1)
    assert len(list(out.iterdir())) == 1  # only the first folder
