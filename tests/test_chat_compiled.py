"""The engine's compiled forward (#71) on tiny decoders, without Ray: the tokens the eager forward gives,
alone and batched; no step recompiles after warm-up (and one that would runs eagerly); LoRA adapter rows
beside base rows, and a lone base stream on the one-token graph; weights changed after compiling; the settings
that choose them."""

from __future__ import annotations

import pytest
import torch

from tests.chat_serve_task import WORDS, build_lora, build_tiny_chat
from workflows.tasks.chat.engine import Engine, SamplingParams
from workflows.tasks.chat.engine import compiled as compiled_forward

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, model, tokenizer) of the tiny chat model (GQA: 4 heads over 2 key/value heads)."""
    out = tmp_path_factory.mktemp("tinychat")
    model, tokenizer = build_tiny_chat(out)
    return str(out), model, tokenizer


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def words(tokenizer, n: int, shift: int = 0) -> list[int]:
    return tokenizer(" ".join(WORDS[(i * 7 + shift) % len(WORDS)] for i in range(n))).input_ids[:n]


def run(e: Engine, prompts: list[list[int]], n: int = 12, adapters=None, together: bool = True) -> list[list[int]]:
    """Greedy tokens of `prompts` on `e`: submitted together (one batch) or one after another (alone)."""
    adapters = adapters or [None] * len(prompts)
    if not together:
        return [run(e, [p], n, [a])[0] for p, a in zip(prompts, adapters)]
    gens = [e.submit(p, greedy(n), a) for p, a in zip(prompts, adapters)]
    for g in gens:
        g.result(120)
    return [g.tokens for g in gens]


def graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) + sum(counters["frames"].values())


def test_compiled_steps_give_the_eager_tokens_alone_and_batched_and_never_recompile(tiny):
    """Prompts of 3 to 140 tokens (the last grows the cache past its first 128 positions), prefilled 3 tokens a
    step beside decoding rows and then decoded together: every step runs compiled, each row's tokens are those
    of the eager forward alone, and no step after warm-up compiles anything; a call that would recompile (ids
    of another dtype) is refused and its step left to the eager forward."""
    _, model, tokenizer = tiny
    prompts = [words(tokenizer, n, shift) for shift, n in enumerate((3, 9, 40, 140))]
    eager = Engine(model, tokenizer, max_batch=4, forward="eager", prefill_chunk=3, mixed_step_ratio=None)
    compiled = Engine(model, tokenizer, max_batch=4, forward="compiled", prefill_chunk=3, mixed_step_ratio=None)
    try:
        for e in (eager, compiled):
            e.eos = set()
        assert eager.compiled is None and compiled.compiled is not None and compiled.compiled.warm
        before = graphs()
        alone = run(eager, prompts, together=False)
        assert run(compiled, prompts, together=False) == alone
        assert run(compiled, prompts) == alone
        stats = compiled.stats
        assert stats["compiled_steps"] == stats["steps"] > 4 * 12 and stats["max_rows"] == 4
        assert compiled.compiled.refused == 0 and graphs() == before  # nothing compiled after warm-up

        def int32_ids():
            with torch.inference_mode():
                plan = compiled.cache.plan([0], [0], [0], [])
                return compiled.compiled.logits(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
                                                plan, torch.zeros(1, dtype=torch.long))

        refused = compiled.call(int32_ids).result(60)
        assert refused is None and compiled.compiled.refused == 1 and graphs() == before

        def one_token_ops():  # a lone stream's step without the one-token graph (off for a model this small): the
            # dynamic graph, its matmuls oneDNN's packed op (not MKL's)
            from torch.profiler import ProfilerActivity, profile

            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                plan = compiled.cache.plan([0], [0], [0], [])
                assert compiled.compiled.logits(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                                plan, torch.zeros(1, dtype=torch.long)) is not None
            return {e.name for e in prof.events()}

        ops = compiled.call(one_token_ops).result(60)
        assert "mkldnn::_linear_pointwise" in ops and "mkl::_mkl_linear" not in ops, sorted(ops)
        assert compiled.compiled.refused == 1 and graphs() == before
    finally:
        eager.close()
        compiled.close()


def test_the_one_token_graph_is_on_where_a_model_s_layers_outgrow_the_caches(tiny):
    """one_token_graph auto: on for SmolLM2-135M's shape (425 MB of layers), off for the tiny model; on and off
    as set; a typo is a clear error (the graph's tokens and steps: the adapter tests, on `own`)."""
    _, model, _ = tiny
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):  # SmolLM2-135M's shape, no weights
        smollm2 = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3))
    assert compiled_forward.one_token_graph(smollm2, "auto") and not compiled_forward.one_token_graph(smollm2, "off")
    assert not compiled_forward.one_token_graph(model, "auto") and compiled_forward.one_token_graph(model, "on")
    with pytest.raises(ValueError, match="one_token 'yes'"):
        compiled_forward.build(model, "eager", None, "yes")


@pytest.fixture(scope="module")
def own(tiny):
    """A compiled engine over a model of its own (loaded from the tiny model's directory), with the one-token
    graph (a lone base stream's decode steps run it, any other step the dynamic graphs)."""
    from transformers import AutoModelForCausalLM

    model_dir, _, tokenizer = tiny
    e = Engine(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, max_batch=4, forward="compiled",
               prefill_chunk=3, mixed_step_ratio=None, one_token_graph="on")
    e.eos = set()
    yield e
    e.close()


def test_adapter_rows_run_compiled_beside_base_rows_with_peft_s_tokens(tiny, own, tmp_path):
    """Two LoRA adapters loaded into the compiled engine's model (peft wraps its layers): their rows run in the
    compiled graph (the adapters' matrices its lora op), alone and in one batch with base rows and each
    other, each with the tokens peft's own forward gives them; a DoRA adapter's rows are left to peft's
    forward (which refuses them in a mixed batch)."""
    from transformers import AutoModelForCausalLM

    from workflows.tasks.chat.adapters import load_adapter

    model_dir, _, tokenizer = tiny
    for seed, name in ((3, "one"), (4, "two")):
        build_lora(model_dir, tmp_path / name, seed=seed)

    def load():
        for name in ("one", "two"):
            own.model = load_adapter(own.model, str(tmp_path / name), name).eval()

    own.call(load).result(60)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    for name in ("one", "two"):
        reference = load_adapter(reference, str(tmp_path / name), name).eval()
    eager = Engine(reference, tokenizer, forward="eager")
    eager.eos = set()
    p = words(tokenizer, 11)
    try:
        alone = {a: run(eager, [p], adapters=[a])[0] for a in (None, "one", "two")}
    finally:
        eager.close()
    assert len({tuple(t) for t in alone.values()}) == 3  # the adapters change what the model says
    steps, before = own.stats["steps"], graphs()
    one_token_steps = []
    for a in alone:
        assert run(own, [p], adapters=[a])[0] == alone[a]
        one_token_steps.append(own.compiled.one_token_steps)
    assert one_token_steps[0] >= 11 and one_token_steps[0] == one_token_steps[-1]  # the base row's decode alone
    own.compiled.one_token = False  # switched off between steps: the dynamic graph runs them, with the same tokens
    try:
        assert run(own, [p])[0] == alone[None] and own.compiled.one_token_steps == one_token_steps[0]
    finally:
        own.compiled.one_token = True
    order = ["one", None, "two", "one"]
    assert run(own, [p] * 4, adapters=order) == [alone[a] for a in order]
    assert own.stats["compiled_steps"] == own.stats["steps"] > steps and own.compiled.refused == 0
    assert graphs() == before  # nothing compiled after warm-up, the one-token graph's steps included

    from peft import LoraConfig

    # DoRA (the platform's adapter loading refuses it: added with peft itself, as a user's own code could)
    own.call(lambda: own.model.add_adapter("dora", LoraConfig(r=4, target_modules=["q_proj"], use_dora=True,
                                                              init_lora_weights=False))).result(60)
    compiled_steps = own.stats["compiled_steps"]
    g = own.submit(p, greedy(4), "dora")
    with pytest.raises(ValueError, match="DoRA"):  # peft's forward ran it, and refuses DoRA in a mixed batch
        g.result(60)
    assert own.stats["compiled_steps"] == compiled_steps
    own.call(lambda: own.model.delete_adapter("dora")).result(60)


def test_adapters_of_other_ranks_and_modules_and_a_reloaded_one_run_compiled_with_peft_s_tokens(tiny, own, tmp_path):
    """Beside the adapters of the test above (rank 4 on q, v and o): one of rank 12 on all seven projections
    with a bias on B (added with peft itself: the platform's loading has no lora_bias), then the first one
    loaded again under its name with other weights: every step compiled, with no recompile, and each row's
    tokens those of peft's own forward alone; the reloaded adapter's rows compute its new weights."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from workflows.tasks.chat.adapters import load_adapter, remove_adapter

    model_dir, _, tokenizer = tiny
    for seed, name in ((3, "one"), (5, "again")):
        build_lora(model_dir, tmp_path / name, seed=seed)
    wide = LoraConfig(r=12, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"], lora_bias=True,
                      init_lora_weights=False)

    def add_wide(model):
        torch.manual_seed(6)
        model.add_adapter("wide", wide)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name and "wide" in name:
                    param.normal_(0, 0.3)
        return model.eval()

    def load():
        if "one" not in getattr(own.model, "peft_config", {}):  # (this test alone: the test above loads it)
            own.model = load_adapter(own.model, str(tmp_path / "one"), "one").eval()
        own.model = add_wide(own.model)

    own.call(load).result(60)
    reference = add_wide(load_adapter(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "one"), "one"))
    reference = load_adapter(reference, str(tmp_path / "again"), "again").eval()
    eager = Engine(reference, tokenizer, forward="eager")
    eager.eos = set()
    p = words(tokenizer, 9, shift=3)
    try:
        alone = {a: run(eager, [p], adapters=[a])[0] for a in (None, "one", "wide", "again")}
    finally:
        eager.close()
    assert len({tuple(t) for t in alone.values()}) == 4
    steps, compiled_steps, refused = own.stats["steps"], own.stats["compiled_steps"], own.compiled.refused
    order = ["wide", None, "one", "wide"]
    assert run(own, [p] * 4, adapters=order) == [alone[a] for a in order]
    assert run(own, [p], adapters=["wide"])[0] == alone["wide"]  # one token a step: the single-token graph

    def reload():  # "one" again, with the weights of "again"
        own.model = load_adapter(remove_adapter(own.model, "one", unwrap=False), str(tmp_path / "again"), "one")

    own.call(reload).result(60)
    assert run(own, [p, p], adapters=["one", "wide"]) == [alone["again"], alone["wide"]]
    assert own.stats["compiled_steps"] - compiled_steps == own.stats["steps"] - steps > 0
    assert own.compiled.refused == refused
    own.call(lambda: remove_adapter(own.model, "wide", unwrap=False)).result(60)


def test_weights_changed_after_compiling_are_computed_eagerly(tiny, own):
    """The compiled graph holds the weights as constants: once one is changed in place, steps run the eager
    forward, with the weights as they are now."""
    _, _, tokenizer = tiny
    p = words(tokenizer, 7, shift=2)
    before = run(own, [p])[0]
    assert own.compiled.current()

    def change():  # the base weight of a projection (peft may wrap it), in place
        base = own.model.get_base_model() if hasattr(own.model, "get_base_model") else own.model
        with torch.no_grad():
            compiled_forward._linear(base.model.layers[1].mlp.down_proj).weight.mul_(-3)

    own.call(change).result(60)
    compiled_steps = own.stats["compiled_steps"]
    after = run(own, [p])[0]
    assert not own.compiled.current() and own.stats["compiled_steps"] == compiled_steps
    assert after != before


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_the_other_llama_laid_decoders_compile_to_their_eager_tokens(tiny, kind):
    """Qwen2 (biases on q, k and v) and Mistral, laid out as Llama: compiled, the tokens of the eager forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, _, tokenizer = tiny
    torch.manual_seed(0)
    config = AutoConfig.for_model(kind, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, sliding_window=None, use_sliding_window=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    prompts = [words(tokenizer, n, n) for n in (5, 17)]
    engines = [Engine(model, tokenizer, max_batch=2, forward=f) for f in ("eager", "compiled")]
    try:
        for e in engines:
            e.eos = set()
        assert run(engines[1], prompts) == run(engines[0], prompts, together=False)
        assert engines[1].stats["compiled_steps"] == engines[1].stats["steps"]
    finally:
        for e in engines:
            e.close()


def test_the_forward_setting_chooses_compiled_eager_or_auto(tiny, tmp_path):
    """eager: none compiled; compiled: a model it does not know is a clear error naming the setting; auto:
    compiled only where measured (fp32 on a CPU), so bf16 weights run eagerly; a typo names the field."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.tasks.chat.engine.cache import SlotCache

    _, model, _ = tiny
    cache = SlotCache(model.config, 1, 16, torch.device("cpu"), torch.float32)
    assert compiled_forward.build(model, "eager", cache) is None
    with pytest.raises(ValueError, match="forward 'fast'"):
        compiled_forward.build(model, "fast", cache)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(NotImplementedError, match="serve.generate.forward=compiled: model_type 'gpt2'"):
        compiled_forward.build(gpt2, "compiled", cache)
    assert compiled_forward.build(gpt2, "auto", cache) is None
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert compiled_forward.build(bf16, "auto", cache) is None
    with pytest.raises(UserError, match="serve.generate.forward"):
        load_config("chat", ["serve.generate.forward=fast"])
    with pytest.raises(UserError, match="serve.generate.one_token_graph"):
        load_config("chat", ["serve.generate.one_token_graph=yes"])
    assert load_config("chat", []).serve.generate.forward == "auto"


def test_decode_attention_in_fp32_is_sdpa_s_over_the_slots_views_and_other_dtypes_run_sdpa():
    import torch.nn.functional as F

    from workflows.tasks.chat.engine.cache import decode_attention

    torch.manual_seed(0)
    keys, values = torch.randn(6, 2, 40, 16), torch.randn(6, 2, 40, 16)  # a layer's slots: 6 of 40 positions
    q = torch.randn(5, 2, 3, 16)  # 5 rows, 2 key/value heads of 3 query heads each
    k, v = keys[:5, :, :24], values[:5, :, :24]  # views over the slots' first 24 positions, as a step reads them
    lengths = torch.tensor([24, 3, 17, 1, 9])
    mask = (torch.arange(24)[None, :] < lengths[:, None])[:, None, None, :]
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    for m, b in ((mask, bias), (None, None)):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
        got = decode_attention(q, k, v, m, b, 0.3)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    # a row of one position attends to it alone: its value, whatever the query
    assert torch.allclose(decode_attention(q, k, v, mask, bias, 0.3)[3], values[3, :, :1].expand(2, 3, 16), atol=1e-6)
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    assert torch.equal(decode_attention(*half, mask, None, 0.3),
                       F.scaled_dot_product_attention(*half, attn_mask=mask, scale=0.3))
