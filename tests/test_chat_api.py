"""The chat API's request surface (#61) without a server: every OpenAI field honoured or refused by name,
grammars (llguidance) that hold a tiny random Llama to a JSON schema or to tool calls, alone or in a
batch, logprobs from the distribution a token was drawn from, penalties and logit_bias, and tool calls
written into a chat template and read back out of streamed text. Over HTTP with the `openai` client:
tests/test_chat_serve.py."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from tests.chat_model import chat_texts, tiny_chat_model
from workflows.preprocess import chat_data
from workflows.tasks.chat.engine import Engine, SamplingParams
from workflows.tasks.chat.grammar import grammars as grammar
from workflows.tasks.chat.openai import tools

torch.set_num_threads(1)

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                   "verified": {"type": "boolean"}},
                  "required": ["age", "verified"]},
    },
    "required": ["name", "kind", "tags", "owner"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["paris", "rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, grammars) of a tiny random Llama with a byte-level BPE tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tiny_chat_model(tmp_path_factory.mktemp("api") / "tiny", chat_texts(chat_data.build(60)))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    return model, tokenizer, grammar.Grammars(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny[0], tiny[1], max_batch=4)
    yield e
    e.close()


def prompt(tokenizer, text: str = "hello, what is the cat's name?") -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=False))


def constrained(grammars, text: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 200), constraint=grammars.constraint(text, "x"), **kw)


# --- grammars -------------------------------------------------------------------------------------------------


def test_a_random_models_constrained_answers_validate_against_a_nested_schema(tiny, engine):
    """Objects, arrays, enums, bounds and required keys, greedy and sampled: every answer is JSON that
    the schema validates (its objects closed to other keys); without the grammar the model says no JSON."""
    model, tokenizer, grammars = tiny
    p = prompt(tokenizer)
    free = engine.submit(p, SamplingParams(max_tokens=40, temperature=0)).result(60)[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    text = grammar.schema_grammar(PET, strict=False)
    gens = [engine.submit(p, constrained(grammars, text, temperature=0))] + [
        engine.submit(p, constrained(grammars, text, temperature=1.0, seed=s)) for s in range(5)]
    answers = [g.result(120) for g in gens]
    for answer, reason in answers:
        assert reason == "stop", answer
        value = json.loads(answer)
        jsonschema.validate(value, grammar.closed(PET))
        assert set(value) == set(PET["properties"]) and set(value["owner"]) == {"age", "verified"}
    assert len({a for a, _ in answers}) > 1  # sampling still samples, within the grammar
    obj = engine.submit(p, constrained(grammars, grammar.object_grammar(), temperature=0)).result(60)
    assert obj[1] == "stop" and isinstance(json.loads(obj[0]), dict)


def test_greedy_tokens_with_grammars_are_the_same_alone_and_in_a_batch(tiny, engine):
    """Rows with a grammar (each its own state), with logprobs, and plain rows share steps: each decodes
    what it decodes alone, its logprobs included."""
    model, tokenizer, grammars = tiny
    schema = grammar.schema_grammar(PET, strict=False)

    def requests():
        return [(prompt(tokenizer), constrained(grammars, schema, temperature=0)),
                (prompt(tokenizer, "the dog sat"), SamplingParams(max_tokens=30, temperature=0, logprobs=3)),
                (prompt(tokenizer, "red blue"), constrained(grammars, tools.call_grammar([ADD], False),
                                                            temperature=0, logprobs=2)),
                (prompt(tokenizer, "one two"), SamplingParams(max_tokens=25, temperature=0))]

    alone = []
    for p, params in requests():
        g = engine.submit(p, params)
        g.result(120)
        alone.append((g.tokens, g.finish_reason))
    together = [engine.submit(p, params) for p, params in requests()]
    for g in together:
        g.result(120)
    assert [(g.tokens, g.finish_reason) for g in together] == alone


def test_a_named_function_or_required_tools_give_valid_calls(tiny, engine):
    model, tokenizer, grammars = tiny
    p = prompt(tokenizer, "add two and three")
    named = engine.submit(p, constrained(grammars, tools.call_grammar([ADD], parallel=False), temperature=0))
    text, reason = named.result(120)
    reader = tools.ToolCallReader({"add", "get_weather"})
    shown, calls = reader.feed(text)
    rest, more = reader.finish()
    assert reason == "stop" and (shown + rest).strip() == "" and len(calls + more) == 1, text
    call = (calls + more)[0]["function"]
    assert call["name"] == "add"
    jsonschema.validate(json.loads(call["arguments"]), ADD["function"]["parameters"])
    for seed in range(2):  # one or more calls of either function, each valid for its own parameters
        g = engine.submit(p, constrained(grammars, tools.call_grammar([WEATHER, ADD], parallel=True),
                                         temperature=1.0, seed=seed, max_tokens=300))
        text, reason = g.result(120)
        reader = tools.ToolCallReader({"add", "get_weather"})
        found = reader.feed(text)[1] + reader.finish()[1]
        assert found, text
        for c in found:
            spec = {"add": ADD, "get_weather": WEATHER}[c["function"]["name"]]["function"]["parameters"]
            jsonschema.validate(json.loads(c["function"]["arguments"]), grammar.closed(spec))


def test_a_schema_strict_mode_refuses_what_it_cannot_enforce(tiny):
    """strict: an unknown keyword is a 400 naming the field; not strict: ignored, the rest enforced."""
    _, _, grammars = tiny
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(grammar.GrammarError, match="Unknown format") as e:
        grammars.constraint(grammar.schema_grammar(schema, strict=True), "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    grammars.constraint(grammar.schema_grammar(schema, strict=False), "x")
    with pytest.raises(grammar.GrammarError, match="type"):
        grammars.constraint(grammar.schema_grammar({"type": 5}, strict=False), "x")
    assert grammar.closed({"properties": {"a": {"properties": {}}, "b": {"enum": [{"properties": 1}]}}}) == {
        "properties": {"a": {"properties": {}, "additionalProperties": False}, "b": {"enum": [{"properties": 1}]}},
        "additionalProperties": False}


def test_a_tokenizer_llguidance_cannot_read_is_described_to_it_token_by_token(tmp_path):
    """The serving tests' word-level tokenizer (no byte fallback, a Fuse decoder): its vocabulary is handed
    to llguidance token by token, text it cannot spell word by word spelled by its characters."""
    from transformers import AutoTokenizer

    from tests.chat_serve_task import build_tiny_chat

    model, _ = build_tiny_chat(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    grammars = grammar.Grammars(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    vocab = grammar.Vocabulary(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    assert b"".join(vocab.tokens[i] for i in vocab("false")) == b"false" and tokenizer.encode("false") == [0]
    assert vocab("the cat") == tokenizer.encode("the cat", add_special_tokens=False)  # the tokenizer where it can
    e = Engine(model, tokenizer)
    try:
        text, reason = e.submit(prompt(tokenizer, "hello"), constrained(grammars, grammar.schema_grammar(PET, False),
                                                                          temperature=0)).result(120)
    finally:
        e.close()
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PET)


# --- logprobs, penalties, logit_bias -----------------------------------------------------------------------------


def test_logprobs_come_from_the_distribution_the_token_was_drawn_from(tiny, engine):
    """The first token's logprob and top alternatives: log_softmax of the model's logits for the prompt,
    at the request's temperature (1 when greedy), after the grammar's mask."""
    model, tokenizer, grammars = tiny
    p = prompt(tokenizer)
    with torch.no_grad():
        logits = model(torch.tensor([p])).logits[0, -1].double()
    for params, scaled in ((SamplingParams(max_tokens=3, temperature=0, logprobs=5), logits),
                           (SamplingParams(max_tokens=3, temperature=0.7, seed=3, logprobs=2), logits / 0.7)):
        g = engine.submit(p, params)
        token, value, top = _logprobs(g)[0]
        expected = torch.log_softmax(scaled, -1)
        assert token == g.tokens[0] and value == pytest.approx(float(expected[token]), abs=1e-5)
        assert [t for t, _ in top] == torch.topk(expected, params.logprobs).indices.tolist()
    g = engine.submit(p, constrained(grammars, grammar.object_grammar(), temperature=0, logprobs=3))
    token, value, top = _logprobs(g)[0]
    assert tokenizer.decode([token]) == "{" and value == pytest.approx(0.0)  # the one token the grammar allows
    assert top[0] == (token, value) and all(v == float("-inf") for _, v in top[1:])


def _logprobs(gen) -> list:
    """A generation's logprob entries, one per token (the end of sequence's, if any, left out), from its
    deltas (blocking until it ends)."""
    out = []
    eos = gen._engine.eos
    while True:
        item = gen._q.get(timeout=60)
        out += [e for e in item.logprobs or [] if e[0] not in eos]
        if item.finish_reason is not None:
            assert [t for t, _, _ in out] == [t for t in gen.tokens if t not in eos]
            return out


def test_penalties_and_logit_bias_are_openais(tiny, engine):
    """Two greedy tokens' logprobs against the model's own logits: logit_bias added, then (second token)
    count x frequency_penalty + presence_penalty subtracted for the token generated before; a bias of
    -100 bans a token, +100 forces one."""
    model, tokenizer, _ = tiny
    p = prompt(tokenizer)
    eos = tokenizer.eos_token_id
    bias = {7: 2.0, 9: -100.0, eos: -100.0}
    g = engine.submit(p, SamplingParams(max_tokens=2, temperature=0, logprobs=1, presence_penalty=0.5,
                                        frequency_penalty=0.25, logit_bias=bias))
    (t1, lp1, _), (t2, lp2, _) = _logprobs(g)
    with torch.no_grad():
        first, second = (model(torch.tensor([ids])).logits[0, -1].double() for ids in (p, p + [t1]))
    for logits in (first, second):
        for token, b in bias.items():
            logits[token] += b
    second[t1] -= 0.25 + 0.5
    assert t1 == int(first.argmax()) and lp1 == pytest.approx(float(torch.log_softmax(first, -1)[t1]), abs=1e-4)
    assert t2 == int(second.argmax()) and lp2 == pytest.approx(float(torch.log_softmax(second, -1)[t2]), abs=1e-4)
    plain = engine.submit(p, SamplingParams(max_tokens=12, temperature=0))
    plain.result(60)
    word = plain.tokens[0]
    banned = engine.submit(p, SamplingParams(max_tokens=12, temperature=0, logit_bias={word: -100}))
    forced = engine.submit(p, SamplingParams(max_tokens=12, temperature=0, logit_bias={7: 100}))
    for g in (banned, forced):
        g.result(60)
    assert word not in banned.tokens and forced.tokens == [7] * 12


# --- tools -------------------------------------------------------------------------------------------------------

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
WITH_TOOLS = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
              "CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endif %}\n{% endfor %}")


def test_tools_reach_a_template_its_own_way_or_in_the_hermes_format():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "tool", "tool_call_id": "call_2", "content": "warm"}]
    assert tools.template_reads_tools(WITH_TOOLS) and not tools.template_reads_tools(CHATML)
    messages, shown = tools.render(history, [WEATHER], native=True)
    assert shown == [WEATHER] and messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "paris", "days": 1}
    assert messages[3] == history[3]
    messages, shown = tools.render(history, [WEATHER], native=False)
    assert shown is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                           '{"city": "paris", "days": 1}}\n</tool_call>'}
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response>"
    assert tools.render(history[1:2], [WEATHER], native=False)[0][0]["role"] == "system"  # a system turn of its own


def test_tool_calls_are_read_out_of_text_however_it_is_split():
    """Streamed text in any pieces gives what the whole text gives: text before the call shown, the call
    once its block closes, a block that is not a call of a known tool left as text; `parallel` false
    keeps the first call."""
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>\n<tool_call>\n'
            '{"name": "add", "parameters": {"a": 1, "b": 2}}')
    rng = random.Random(0)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12))) if trial else []
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        reader = tools.ToolCallReader({"get_weather", "add"})
        shown, calls = "", []
        for piece in pieces:
            s, c = reader.feed(piece)
            assert "<tool_call>\n" not in s
            shown, calls = shown + s, calls + c
        s, c = reader.finish()
        shown, calls = shown + s, calls + c
        assert shown == 'Let me check. <tool_call>{"name": "nope", "arguments": {}}</tool_call>\n', shown
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "rome", "days": 2}), ("add", {"a": 1, "b": 2})]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    one = tools.ToolCallReader({"get_weather", "add"}, parallel=False)
    assert len(one.feed(text)[1] + one.finish()[1]) == 1
    plain = tools.ToolCallReader({"add"})
    assert plain.feed("a <tool") == ("a ", []) and plain.feed("box>") == ("<toolbox>", [])


# --- the request surface -------------------------------------------------------------------------------------------


def _refusal(body: dict, kind: str = "chat"):
    from pydantic import ValidationError

    from workflows.tasks.chat.openai.protocol import ChatRequest, CompletionRequest
    from workflows.tasks.chat.openai.routes import validation_error

    model = ChatRequest if kind == "chat" else CompletionRequest
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else \
        {"model": "m", "prompt": "hi"}
    try:
        model.model_validate_json(json.dumps({**base, **body}))
    except ValidationError as e:
        err = validation_error(e)
        return err.param, str(err)
    return None


@pytest.mark.parametrize("body,param", [
    ({"foo": 1}, "foo"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["audio"]}, "modalities.0"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"seed": 2**63}, "seed"),
])
def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(body, param):
    refused = _refusal(body)
    assert refused is not None and refused[0] == param, refused


@pytest.mark.parametrize("body,param", [
    ({"suffix": "x"}, "suffix"), ({"best_of": 3, "n": 2}, "best_of"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"prompt": []}, "prompt"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": [[1], "x"]}, "prompt.0"),
    ({"logprobs": 21}, "logprobs"),
])
def test_a_completion_field_that_cannot_be_honoured_is_a_400_naming_it(body, param):
    refused = _refusal(body, "text")
    assert refused is not None and refused[0] == param, refused


def test_null_means_the_default_and_legal_bodies_pass():
    assert _refusal({"temperature": None, "top_p": None, "n": None, "stream": None, "stop": None, "seed": -5,
                     "max_tokens": None, "logprobs": None, "tools": None, "tool_choice": None, "user": "u1",
                     "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "modalities": ["text"],
                     "parallel_tool_calls": None, "prompt_cache_key": "x", "safety_identifier": "y"}) is None
    assert _refusal({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}},
        "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}) is None
    for prompt_ in ("x", ["x", "y"], [1, 2, 3], [[1, 2], [3]]):
        assert _refusal({"prompt": prompt_, "echo": True, "best_of": 2, "n": 2}, "text") is None


# --- the answer's shapes -------------------------------------------------------------------------------------------


class _Gen:
    """A finished generation's deltas, replayed (as the engine would push them)."""

    def __init__(self, deltas, prompt_tokens: int = 5):
        self.deltas, self.finish_reason, self.cancelled = deltas, None, False
        tokens = sum(len(d.token_ids) for d in deltas)
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                      "total_tokens": prompt_tokens + tokens}

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        for d in self.deltas:
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason
            yield d


def _answer(kind: str, gens, shape, stream: bool):
    import asyncio
    from types import SimpleNamespace

    from workflows.tasks.chat.openai.streaming import Completion

    server = SimpleNamespace(in_flight=1)
    completion = Completion(kind, "tiny:1", gens, server, lambda: None, include_usage=stream, shape=shape)

    async def run():
        if stream:
            return [json.loads(e.removeprefix("data: ")) for e in [e async for e in completion.events()]
                    if e != "data: [DONE]\n\n"]
        return json.loads((await completion.json_response()).body)

    out = asyncio.run(run())
    assert server.in_flight == 0
    return out


def test_choices_carry_tool_calls_logprobs_and_usage_in_openais_shapes(tiny):
    """Two choices of one prompt: one calls a tool across three deltas, one answers text; logprobs per
    token (a token a grammar ruled out as -9999.0, the end of sequence left out), the prompt's tokens
    counted once, and the same streamed (each call one delta, OpenAI's last chunk without content, the
    obfuscation field when asked)."""
    from workflows.tasks.chat.engine import Delta
    from workflows.tasks.chat.grammar import TokenText
    from workflows.tasks.chat.openai.choices import AnswerShape

    _, tokenizer, _ = tiny
    eos, a, b = tokenizer.eos_token_id, *tokenizer.encode("hello world")[:2]
    lp = [(a, -0.5, [(a, -0.5), (b, float("-inf"))])]

    def gens():
        return [_Gen([Delta("Sure. <tool_", None, [a], lp), Delta('call>{"name": "add", "arguments": {"a": 1, ', None,
                                                                [b], [(b, -1.0, [(b, -1.0)])]),
                      Delta('"b": 2}}</tool_call>', "stop", [eos], [(eos, -0.1, [])])]),
                _Gen([Delta("hel", None, [a], lp), Delta("lo", "length", [b], [(b, -2.0, [])])])]

    shape = AnswerShape(logprobs=True, tools={"add"}, token_text=TokenText(tokenizer), eos=frozenset({eos}),
                        choices_per_prompt=2, obfuscation=True)
    whole = _answer("chat", gens(), shape, stream=False)
    first, second = whole["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == "Sure."
    (call,) = first["message"]["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'} and call["type"] == "function"
    assert [t["logprob"] for t in first["logprobs"]["content"]] == [-0.5, -1.0]  # no eos
    assert first["logprobs"]["content"][0]["top_logprobs"][1]["logprob"] == -9999.0
    assert first["logprobs"]["content"][0]["bytes"] == list(first["logprobs"]["content"][0]["token"].encode())
    assert second == {"index": 1, "message": {"role": "assistant", "content": "hello", "refusal": None},
                      "logprobs": second["logprobs"], "finish_reason": "length"}
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}

    chunks = _answer("chat", gens(), shape, stream=True)
    assert all("obfuscation" in c for c in chunks[:-1]) and chunks[-1]["usage"] == whole["usage"]
    by_choice = {0: [], 1: []}
    for c in chunks[:-1]:
        by_choice[c["choices"][0]["index"]].append(c["choices"][0])
    calls = [d["delta"]["tool_calls"] for d in by_choice[0] if "tool_calls" in d["delta"]]
    assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["id"] == calls[0][0]["id"]
    assert json.loads(calls[0][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert "".join(d["delta"].get("content") or "" for d in by_choice[0]) == "Sure. "
    assert by_choice[0][-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    assert "".join(d["delta"].get("content") or "" for d in by_choice[1]) == "hello"
    assert [t["token"] for d in by_choice[1] if d["logprobs"] for t in d["logprobs"]["content"]] == [
        t["token"] for t in second["logprobs"]["content"]]


def test_every_token_streams_its_chunk_even_while_its_text_is_held(tiny):
    """A token whose text is held back (a special token, a possible stop string's start) still gets its
    chunk, content "", when it is generated (as vLLM streams it): a client sees each token as it comes.
    Text a tool-call reader holds waits for its call; the last chunk carries no content."""
    from workflows.tasks.chat.engine import Delta
    from workflows.tasks.chat.openai.choices import AnswerShape

    _, tokenizer, _ = tiny
    a, b, c = tokenizer.encode("hello world again")[:3]

    def gen():
        return [_Gen([Delta("he", None, [a]), Delta("", None, [b]), Delta("", None, [c]), Delta("llo", "length", [a])])]

    chunks = _answer("chat", gen(), AnswerShape(), stream=True)[1:-1]  # the role's opening, the usage
    assert [c["choices"][0]["delta"] for c in chunks] == [{"content": "he"}, {"content": ""}, {"content": ""},
                                                          {"content": "llo"}, {}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    texts = _answer("text", gen(), AnswerShape(), stream=True)[:-1]
    assert [c["choices"][0]["text"] for c in texts] == ["he", "", "", "llo"]
    held = _answer("chat", gen(), AnswerShape(tools={"add"}), stream=True)[1:-1]
    assert [c["choices"][0]["delta"] for c in held] == [{"content": "he"}, {"content": "llo"}, {}]


def test_text_choices_echo_their_prompt_and_carry_legacy_logprobs(tiny):
    from workflows.tasks.chat.engine import Delta
    from workflows.tasks.chat.grammar import TokenText
    from workflows.tasks.chat.openai.choices import AnswerShape

    _, tokenizer, _ = tiny
    a, b = tokenizer.encode("hello world")[:2]
    ta, tb = tokenizer.decode([a]), tokenizer.decode([b])
    shape = AnswerShape(logprobs=True, token_text=TokenText(tokenizer), echo=["P1 ", "P2 "])
    gens = [_Gen([Delta(ta, None, [a], [(a, -0.5, [(a, -0.5)])]), Delta(tb, "length", [b], [(b, -1.5, [])])]),
            _Gen([Delta(tb, "stop", [b], [(b, -1.0, [(a, -0.2)])])], prompt_tokens=7)]
    whole = _answer("text", gens, shape, stream=False)
    first, second = whole["choices"]
    assert first["text"] == "P1 " + ta + tb and second["text"] == "P2 " + tb
    assert first["logprobs"] == {"tokens": [ta, tb], "token_logprobs": [-0.5, -1.5], "top_logprobs": [{ta: -0.5}, {}],
                                 "text_offset": [3, 3 + len(ta)]}
    assert whole["usage"]["prompt_tokens"] == 12  # each prompt's own
    chunks = _answer("text", gens, shape, stream=True)
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["P1 ", "P2 "]


def test_a_tokens_text_and_bytes_are_exact_even_inside_a_character(tiny):
    """A byte-level BPE tokenizer spells "é" (not in its training text) as two byte tokens: each token's
    bytes are its own, its text the \\x escape of an incomplete character."""
    from workflows.tasks.chat.grammar import TokenText

    _, tokenizer, _ = tiny
    words = TokenText(tokenizer)
    ids = tokenizer.encode("é", add_special_tokens=False)
    assert [words.get(i) for i in ids] == [("\\xc3", b"\xc3"), ("\\xa9", b"\xa9")]
    hello = tokenizer.encode(" hello", add_special_tokens=False)
    assert b"".join(words.get(i)[1] for i in hello) == b" hello"
    assert words.get(tokenizer.eos_token_id) == ("<|im_end|>", b"<|im_end|>")
