"""serve.generate.engine: vllm (#72): vLLM's engine (its CPU build, in the venv `make vllm` builds) behind the
chat task's OpenAI routes on Ray Serve, over real HTTP, serving SmolLM2-135M (the packaged base) and two
registered LoRA adapters of it: the same answers as the builtin engine, the official client's structured
output, tools, logprobs and n, and the limits.

SmolLM2, not the tests' tiny word-level model: vLLM builds its grammars' vocabulary from the tokenizer alone
(llguidance.hf), which misreads that tokenizer (its masks allow no letter inside a JSON key); ours wraps
such a vocabulary itself (workflows.tasks.chat.grammar).

Extended: the vLLM venv is a pip install of about 3 GB, and its engine takes tens of seconds to start."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest

from tests.chat_serve_task import build_lora, deploy_chat, register_chat_models
from tests.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.extended]
CHAT = ROOT / "configs" / "chat.yaml"
TOKEN = "vllm-s3cret"
MAX_TOKENS, DEADLINE_S = 64, 60
MESSAGES = [[{"role": "user", "content": text}] for text in ("is the cat big", "hello world", "the dog sat on a mat")]


def vllm_python() -> str:
    """The vLLM venv's Python, built first (`make vllm`) if it is not there."""
    import subprocess

    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not (ROOT / ".venv-vllm" / ".installed").exists():  # make's stamp: the install finished
        made = subprocess.run(["make", "vllm"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    return str(python)


@pytest.fixture(scope="module")
def vllm_server(ray_cluster, tmp_path_factory):
    from ray import serve

    from tests.helpers import free_port
    from workflows.config import load_config
    from workflows.storage.uri import StorageContext
    from workflows.tasks.chat.training.smollm2 import smollm2_dir

    tmp = tmp_path_factory.mktemp("chat-vllm")
    base = Path(smollm2_dir(load_config(CHAT).cache.resolved_dir()))  # converted once per machine
    for adapter, seed in (("support", 1), ("pirate", 2)):
        build_lora(base, tmp / adapter, seed)
    port = free_port()
    common = ["storage.embedded.enabled=false", "serve.enabled=true", f"storage.root={tmp}/store",
              f"cache.dir={tmp}/cache", "serve.auth_token_env=CHAT_TOKEN", "serve.generate.max_batch=4",
              "serve.generate.max_queue=2", f"serve.generate.max_tokens={MAX_TOKENS}",
              "serve.generate.max_prompt_tokens=512", f"serve.generate.timeout_s={DEADLINE_S}",
              f"serve.generate.vllm_python={vllm_python()}", "serve.generate.max_lora_rank=8"]
    cfg = load_config(CHAT, [*common, f"serve.port={port}", "serve.generate.engine=vllm"])
    register_chat_models(cfg, StorageContext.from_config(cfg.storage), base, tmp, "smol", "chat")
    url = deploy_chat(cfg, "smol:1", "chat-vllm", port, TOKEN, 600)
    builtin = load_config(CHAT, [*common, "serve.generate.engine=builtin"])
    yield SimpleNamespace(url=url, tmp=tmp, base=base, cfg=cfg, builtin=builtin)
    serve.delete("chat-vllm")
    serve.shutdown()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def _builtin_answers(server, model_dir: str, adapter_dir: str | None, n_tokens: int) -> list[list[int]]:
    """Greedy token ids of the builtin engine over the same model (and adapter) for MESSAGES."""
    from transformers import AutoTokenizer

    from workflows.tasks.chat import ChatTask
    from workflows.tasks.chat.adapters import load_adapter
    from workflows.tasks.chat.engine import Engine, SamplingParams
    from workflows.tasks.chat.serving.prompts import Prompts
    from workflows.tasks.chat.training.model import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = ChatTask(server.builtin)  # the served conversation's tokens: its system prompt, its template
    prompts = Prompts(model_dir, "smol:1", getattr(task.options, "system_prompt", None), lambda: None,
                      threading.RLock())
    model = load_causal_lm(model_dir)
    adapter = None
    if adapter_dir is not None:
        model, adapter = load_adapter(model, adapter_dir, "a"), "a"
    engine = Engine(model, tokenizer, max_batch=4, forward="eager")
    try:
        out = []
        for messages in MESSAGES:
            ids = prompts.chat_ids(messages)
            gen = engine.submit(ids, SamplingParams(max_tokens=n_tokens, temperature=0), adapter, deadline=False)
            gen.result(timeout=120)
            out.append([t for t in gen.tokens if t not in engine.eos])
        return out
    finally:
        engine.close()


def _served_answers(url: str, model: str, n_tokens: int) -> list[str]:
    """Greedy answers of the served model for MESSAGES."""
    client = _client(url)
    return [client.chat.completions.create(model=model, messages=messages, max_tokens=n_tokens, temperature=0)
            .choices[0].message.content for messages in MESSAGES]


def test_vllm_answers_as_the_builtin_engine_does_base_and_adapters(vllm_server):
    """Greedy answers over HTTP through vLLM's engine are the builtin engine's, token for token, for the base
    and for each registered adapter; two adapters and the base in one batch each answer as alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.base)
    url = vllm_server.url
    expected = {"smol:1": _builtin_answers(vllm_server, str(vllm_server.base), None, 12)}
    for adapter in ("support", "pirate"):
        expected[f"{adapter}:1"] = _builtin_answers(vllm_server, str(vllm_server.base),
                                                    str(vllm_server.tmp / adapter), 12)
    texts = {m: [tokenizer.decode(ids) for ids in answers] for m, answers in expected.items()}
    assert all(len(ids) >= 4 for answers in expected.values() for ids in answers)
    alone = {m: _served_answers(url, m, 12) for m in expected}
    assert alone == texts
    assert alone["support:1"] != alone["smol:1"] != alone["pirate:1"]  # the adapters change the answers
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # together: one batch of the base and both adapters
        together = dict(zip(expected, pool.map(lambda m: _served_answers(url, m, 12), expected)))
    assert together == alone


def test_the_openai_client_parses_calls_tools_and_reads_logprobs_on_vllm(vllm_server):
    from pydantic import BaseModel, Field

    class Answer(BaseModel):  # an enum: the object closes within a few tokens
        answer: Literal["yes", "no"]
        size: int = Field(ge=0, le=9)

    client = _client(vllm_server.url)
    messages = MESSAGES[0]
    parsed = client.chat.completions.parse(model="smol:1", messages=messages, response_format=Answer,
                                           temperature=0, max_tokens=60)
    assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Answer)
    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}
    asked = client.chat.completions.create(model="smol:1", messages=messages, tools=[tool],
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0, max_tokens=60)
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    chunks = list(client.chat.completions.create(model="smol:1", messages=messages, tools=[tool],
                                                 tool_choice={"type": "function", "function": {"name": "add"}},
                                                 temperature=0, max_tokens=60, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])] if chunks else []
    assert [d.function.name for d in deltas] == ["add"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)  # greedy: as above
    seen = client.chat.completions.create(model="smol:1", messages=messages, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = seen.choices[0].logprobs.content
    assert "".join(t.token for t in content) == seen.choices[0].message.content and content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    several = client.chat.completions.create(model="smol:1", messages=messages, max_tokens=8, n=2, seed=3,
                                             temperature=1.0)
    again = client.chat.completions.create(model="smol:1", messages=messages, max_tokens=8, n=2, seed=3,
                                           temperature=1.0)
    assert [c.index for c in several.choices] == [0, 1]
    assert [c.message.content for c in again.choices] == [c.message.content for c in several.choices]
    text = client.completions.create(model="smol:1", prompt=["the cat", "a dog"], max_tokens=3, temperature=0)
    assert [c.index for c in text.choices] == [0, 1]


def test_each_limit_answers_as_documented_on_vllm(vllm_server):
    import requests

    url, auth = vllm_server.url, {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": "smol:1", "messages": MESSAGES[0], "max_tokens": 4}
    assert requests.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 401
    long = {**body, "messages": [{"role": "user", "content": "cat " * 800}]}
    r = requests.post(f"{url}/v1/chat/completions", json=long, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": MAX_TOKENS + 1}, headers=auth,
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = requests.post(f"{url}/v1/chat/completions", json={**body, "model": "stranger:1"}, headers=auth, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    stop = requests.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
        **body, "max_tokens": 20, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["message"]["content"]
    cut = stop.split()[2] if len(stop.split()) > 2 else stop[-1]
    stopped = requests.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
        **body, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": [cut]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == stop[:stop.index(cut)]

    # a full replica: 4 running and 2 waiting (their streams begin at once), the next answered 429 with
    # Retry-After at once, by the engine's admission (Serve's own limit is above it)
    slow = {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    streams = [requests.post(f"{url}/v1/chat/completions", json=slow, headers=auth, timeout=120, stream=True)
               for _ in range(6)]
    assert all(s.status_code == 200 for s in streams)
    refused = requests.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
    assert refused.json()["error"]["code"] == "server_busy"
    for s in streams:  # each runs to its end
        lines = [ln for ln in s.iter_lines() if ln.startswith(b"data: {")]
        assert json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == "length"
