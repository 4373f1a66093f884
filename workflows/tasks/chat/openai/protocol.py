"""OpenAI's chat and text completion request bodies, as this server reads them: every field of OpenAI's
API is declared, and is either honoured or refused with a 400 that names it; a field OpenAI does not
define is a 400 too (never dropped). `null` means the default wherever OpenAI allows it. What each field
does here: docs/guides/serve.md (chat models). Messages, tools and response formats: parts.py.

Every list a body may hold is bounded (messages, content parts, tools, allowed tools, tool calls, stop
strings, logit_bias, prompts) before its items are validated, so that a body costs about what parsing its
JSON costs, whatever it holds (docs/guides/serve.md). Limits that depend on the server (serve.generate:
max_tokens, max_n, max_schema_bytes; the vocabulary for logit_bias and token-id prompts) are checked by
the route, workflows.tasks.chat.openai.routes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from workflows.tasks.chat.engine import MAX_LOGPROBS
from workflows.tasks.chat.openai.parts import (
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_STOPS,
    MAX_TOOLS,
    AllowedToolsChoice,
    BadRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    Message,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Strict,
    Tool,
    ToolChoice,
    bounded,
    unsupported,
)

__all__ = ["AllowedToolsChoice", "BadRequest", "ChatRequest", "CompletionRequest", "GenerateRequest",
           "JsonObjectFormat", "JsonSchemaFormat", "Message", "NamedToolChoice", "Tool"]

INT64 = 2**63
TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit() takes '²' and '٣' too


# --- requests ------------------------------------------------------------------------------------------------


class GenerateRequest(Strict):
    """The fields both routes read."""

    model: str = Field(..., min_length=1, description="the served NAME:VERSION (or NAME), or an adapter's "
                       "(NAME:VERSION, or NAME@ALIAS: the version the alias holds now)")
    max_tokens: int | None = Field(None, ge=1, description="at most serve.generate.max_tokens (above it: a 400); "
                                   "absent, that cap")
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0 (or below 1e-5) is greedy")
    top_p: float | None = Field(None, ge=0, le=1, description="default 1; 0 keeps the most probable token only")
    n: int | None = Field(None, ge=1, description="choices, each its own row (at most serve.generate.max_n)")
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="repeatable sampling; choice i is seeded "
                             "with seed + i")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS,
                                                description="token id (as text) -> bias, -100..100")
    user: str | None = Field(None, description="an end-user id; does not change the answer")
    ignore_eos: bool | None = Field(None, description="not OpenAI's (vLLM's and llama.cpp's): generate past the "
                                    "end-of-sequence token, up to max_tokens or a stop string (fixed lengths, for "
                                    "benchmarks)")

    _lists = bounded("stop", limit=MAX_STOPS)
    _bias_entries = bounded("logit_bias", limit=MAX_LOGIT_BIAS)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys are token ids (ASCII digits), not {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are between -100 and 100, not {bias}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self

    def stops(self, max_chars: int) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s or len(s) > max_chars for s in stops):
            raise BadRequest(f"stop: up to 4 non-empty strings of at most {max_chars} characters each", "stop")
        return tuple(stops)

    def choices(self) -> int:
        return self.n if self.n is not None else 1

    def asked_tokens(self) -> tuple[int | None, str]:
        """(the max new tokens the request asks for, the field that asks)."""
        return self.max_tokens, "max_tokens"


class ChatRequest(GenerateRequest):
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")
    logprobs: bool | None = Field(None, description="each content token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: that many most "
                                     "likely alternatives per token")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="default true; false: at most one call")
    store: bool | None = Field(None, description="false only: completions are not stored")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="tags for a stored completion; does "
                                            "not change the answer")
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    safety_identifier: str | None = Field(None, description="an end-user id; does not change the answer")
    prompt_cache_key: str | None = Field(None, description="a caching hint; does not change the answer")
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    _audio = field_validator("audio")(unsupported("audio output is not supported (a text model)"))
    _prediction = field_validator("prediction")(unsupported("predicted outputs are not supported"))
    _reasoning = field_validator("reasoning_effort")(unsupported("not a reasoning model"))
    _verbosity = field_validator("verbosity")(unsupported("not supported: use max_tokens"))
    _search = field_validator("web_search_options")(unsupported("web search is not supported"))
    _functions = field_validator("functions")(unsupported("deprecated by OpenAI: use tools"))
    _function_call = field_validator("function_call")(unsupported("deprecated by OpenAI: use tool_choice"))
    _messages = bounded("messages", limit=MAX_MESSAGES)
    _tools = bounded("tools", limit=MAX_TOOLS)
    _metadata_keys = bounded("metadata", limit=16)

    @field_validator("store")
    @classmethod
    def _store(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("stored completions are not supported")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 keys of up to 64 characters, values up to 512")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_completion_tokens: differs from max_tokens (send one)")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        wanted = [choice.function.name] if isinstance(choice, NamedToolChoice) else (
            [t.function.name for t in choice.allowed_tools.tools] if isinstance(choice, AllowedToolsChoice) else [])
        if missing := [n for n in wanted if n not in names]:
            raise ValueError(f"tool_choice: {missing[0]!r} is not among tools")
        return self

    def asked_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def tool_mode(self) -> tuple[str, list[Tool]]:
        """("none" | "auto" | "required", the tools the model is shown): tool_choice resolved."""
        tools, choice = self.tools or [], self.tool_choice
        if not tools or choice == "none":
            return "none", []
        if isinstance(choice, NamedToolChoice):
            return "required", [t for t in tools if t.function.name == choice.function.name]
        if isinstance(choice, AllowedToolsChoice):
            allowed = {t.function.name for t in choice.allowed_tools.tools}
            return choice.allowed_tools.mode, [t for t in tools if t.function.name in allowed]
        return (choice or "auto"), tools


class CompletionRequest(GenerateRequest):
    prompt: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | list[int] | Annotated[
            list[list[int]], Field(max_length=MAX_PROMPTS)] = Field(
        ..., description="a prompt, or several (n choices each): text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each token's logprob and that many "
                                 "most likely alternatives")
    echo: bool | None = Field(None, description="the prompt's text before each choice's")
    best_of: int | None = Field(None, ge=1, description="equal to n (or null) only")
    suffix: Any = None

    _suffix = field_validator("suffix")(unsupported("insertion (suffix) is not supported"))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v):
        """Several prompts at most MAX_PROMPTS; one prompt of token ids (bounded by the body's size) all
        integers, checked here once rather than by each member of the union, item by item."""
        if not isinstance(v, list) or not v:
            return v
        if isinstance(v[0], int) and not isinstance(v[0], bool):
            if not all(type(t) is int for t in v):
                raise ValueError("a prompt of token ids holds integers only")
        elif len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts, not {len(v)}")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("no empty prompt lists")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.choices():
            raise ValueError("best_of: only equal to n (candidates ranked on the server are not supported)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: with logprobs, the prompt's logprobs would be needed, which are not computed")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
