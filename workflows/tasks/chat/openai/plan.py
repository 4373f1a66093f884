"""What one request asks of the engine: its prompts' token ids, each choice's SamplingParams, the grammar
its choices are constrained by (text, and the field it comes from), and how its answer is shaped. Built
off the event loop, in the tokenizing thread of the served model's `prompts`
(workflows.tasks.chat.serving.prompts, which `prompts` below stands for): rendering a template and
tokenizing take milliseconds. The grammar is compiled after, in a thread of its own (`prompts.constraints`),
so that a request without one never waits behind another's compile; its schemas are at most
serve.generate.max_schema_bytes (each, and together), which bounds that compile.

Choices: n per prompt, each a row of its own (prompt-major: prompt p's choice j is choice p * n + j),
choice j seeded with seed + j (modulo 2^64), so one seed gives n different samples and the same n again.
A request's rows are at most serve.generate.max_n.

Constraints (workflows.tasks.chat.grammar), in order:
- tool_choice "required", a named function, or allowed_tools in mode "required": the Hermes tool calls
  of those functions (one call for a named function or parallel_tool_calls false, else one or more);
- response_format json_schema or json_object: that JSON, or, with tools the model may call (tool_choice
  auto), that JSON or tool calls;
- otherwise none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from workflows.tasks.chat.engine import SamplingParams
from workflows.tasks.chat.grammar import schema_grammar
from workflows.tasks.chat.openai.choices import AnswerShape
from workflows.tasks.chat.openai.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedToolChoice,
)
from workflows.tasks.chat.openai.tools import call_grammar

if TYPE_CHECKING:
    from workflows.config.serve import GenerateConfig


@dataclass
class Plan:
    prompts: list[list[int]]  # token ids, one list per prompt
    params: list[SamplingParams]  # one per choice (row), prompt-major
    shape: AnswerShape
    grammar: tuple[str, str] | None = None  # (llguidance grammar, the request field it comes from)


def base_params(req: GenerateRequest, gen: GenerateConfig, vocab: int, logprobs: int | None) -> SamplingParams:
    """A choice's settings from the request (null: the default), checked against the server's limits."""
    asked, field = req.asked_tokens()
    if asked is not None and asked > gen.max_tokens:
        raise BadRequest(f"{field}: {asked} is over this server's limit of {gen.max_tokens} "
                         "(serve.generate.max_tokens)", field)
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if int(key) >= vocab:
            raise BadRequest(f"logit_bias: token {key} is not in this model's vocabulary of {vocab}", "logit_bias")
        bias[int(key)] = value
    top_p = 1.0 if req.top_p is None else req.top_p
    temperature = 1.0 if req.temperature is None else req.temperature
    if top_p == 0:  # only the most probable token: greedy
        top_p, temperature = 1.0, 0.0
    return SamplingParams(max_tokens=asked or gen.max_tokens, temperature=temperature, top_p=top_p, seed=req.seed,
                          stop=req.stops(gen.max_stop_chars), logprobs=logprobs,
                          presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                          logit_bias=bias, ignore_eos=bool(req.ignore_eos))


def rows(req: GenerateRequest, gen: GenerateConfig, prompts: int) -> int:
    n = req.choices()
    if prompts * n > gen.max_n:
        param, what = ("n", f"n={n}") if prompts == 1 else ("prompt", f"{prompts} prompts, n={n} each")
        raise BadRequest(f"{param}: {prompts * n} choices ({what}); this server's limit is {gen.max_n} "
                         "(serve.generate.max_n)", param)
    return n


def seeded(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j's settings: seeded with seed + j, as an unsigned 64-bit generator seed."""
    return params if params.seed is None else replace(params, seed=(params.seed + j) % 2**64)


def chat_plan(prompts, req: ChatRequest, gen: GenerateConfig) -> Plan:
    n = rows(req, gen, 1)
    check_schema_sizes(req, gen)
    mode, callable_ = req.tool_mode()
    shown = [t.model_dump(exclude_none=True) for t in req.tools or []] if mode != "none" else []
    ids = prompts.chat_ids([m.as_template_input() for m in req.messages], shown or None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = base_params(req, gen, prompts.vocab_size, logprobs)
    text = constraint_grammar(req, mode, callable_)
    shape = AnswerShape(logprobs=logprobs is not None, token_text=prompts.token_text if logprobs is not None
                        else None, eos=frozenset(prompts.eos), choices_per_prompt=n,
                        tools={t.function.name for t in callable_} if mode != "none" else None,
                        parallel_tool_calls=req.parallel_tool_calls is not False,
                        obfuscation=bool(req.stream_options and req.stream_options.include_obfuscation))
    return Plan([ids], [seeded(params, j) for j in range(n)], shape, text)


def check_schema_sizes(req: ChatRequest, gen: GenerateConfig) -> None:
    """Each schema of the request (response_format's, each tool's parameters), and all together, within
    serve.generate.max_schema_bytes as compact JSON, or a 400 naming the field."""
    limit, total = gen.max_schema_bytes, 0
    schemas = [(f"tools.{i}.function.parameters", t.function.parameters) for i, t in enumerate(req.tools or [])]
    if isinstance(req.response_format, JsonSchemaFormat):
        schemas.append(("response_format.json_schema.schema", req.response_format.json_schema.schema_))
    for field, schema in schemas:
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode()) if schema else 0
        total += size
        if size > limit:
            raise BadRequest(f"{field}: the schema is {size} bytes as compact JSON; this server takes at most "
                             f"{limit} (serve.generate.max_schema_bytes)", field)
    if total > limit:
        field = "tools" if req.tools else "response_format"
        raise BadRequest(f"{field}: the request's schemas are {total} bytes together as compact JSON; this server "
                         f"takes at most {limit} (serve.generate.max_schema_bytes)", field)


def constraint_grammar(req: ChatRequest, mode: str, callable_: list) -> tuple[str, str] | None:
    """(the llguidance grammar, the request field it comes from) of a chat request, or None."""
    fmt = req.response_format
    answer: tuple[dict, bool] | None = None
    if isinstance(fmt, JsonSchemaFormat):
        answer = (fmt.json_schema.schema_ or {}, bool(fmt.json_schema.strict))
    elif isinstance(fmt, JsonObjectFormat):
        answer = ({"type": "object"}, True)
    funcs = [t.model_dump(exclude_none=True) for t in callable_]
    if mode == "required":
        parallel = req.parallel_tool_calls is not False and not isinstance(req.tool_choice, NamedToolChoice)
        return call_grammar(funcs, parallel), "tools"
    if answer is None:
        return None
    param = "response_format.json_schema.schema" if isinstance(fmt, JsonSchemaFormat) else "response_format"
    if mode == "auto":
        return call_grammar(funcs, req.parallel_tool_calls is not False, answer), param
    return schema_grammar(*answer), param


def text_plan(prompts, req: CompletionRequest, gen: GenerateConfig) -> Plan:
    asked = req.prompts()
    n = rows(req, gen, len(asked))
    ids = []
    for p in asked:
        if isinstance(p, str):
            ids.append(prompts.prompt_ids(p))
        else:
            if any(not 0 <= t < prompts.vocab_size for t in p):
                raise BadRequest(f"prompt: token ids are between 0 and {prompts.vocab_size - 1}", "prompt")
            ids.append(list(p))
    params = base_params(req, gen, prompts.vocab_size, req.logprobs)
    echo = [p if isinstance(p, str) else prompts.tokenizer.decode(p) for p in asked] if req.echo else None
    shape = AnswerShape(logprobs=req.logprobs is not None,
                        token_text=prompts.token_text if req.logprobs is not None else None,
                        eos=frozenset(prompts.eos), choices_per_prompt=n, echo=echo,
                        obfuscation=bool(req.stream_options and req.stream_options.include_obfuscation))
    return Plan(ids, [seeded(params, j) for _ in asked for j in range(n)], shape)
