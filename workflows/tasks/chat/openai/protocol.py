"""OpenAI's chat and text completion request bodies, as this server reads them: every field of OpenAI's
API is declared, and is either honoured or refused with a 400 that names it; a field OpenAI does not
define is a 400 too (never dropped). `null` means the default wherever OpenAI allows it. What each field
does here: docs/guides/serve.md (chat models).

Limits that depend on the server (serve.generate: max_tokens, max_n; the vocabulary for logit_bias and
token-id prompts) are checked by the route, workflows.tasks.chat.openai.routes.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from workflows.tasks.chat.engine import MAX_LOGPROBS

INT64 = 2**63
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class BadRequest(ValueError):
    """A request this server refuses: an HTTP 4xx with OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def unsupported(message: str):
    """A field OpenAI defines that this server does not honour: absent or null only."""
    def check(v):
        if v is not None:
            raise ValueError(message)
        return v
    return check


# --- messages ----------------------------------------------------------------------------------------------


class TextPart(Strict):
    type: Literal["text"]
    text: str


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class FunctionCall(Strict):
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="JSON text of an object")

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            value = json.loads(v)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError("must be the JSON text of an object")
        return v


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = Field(None, description="text, or text parts (no images: a text model)")
    name: str | None = Field(None, description="the participant's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None

    _audio = field_validator("audio")(unsupported("audio is not supported (a text model)"))
    _function_call = field_validator("function_call")(unsupported("deprecated by OpenAI: use tool_calls"))

    @model_validator(mode="after")
    def _roles(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id: only a tool message answers a call")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise ValueError("content: required (null only for an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)

    def as_template_input(self) -> dict:
        """The message as a chat template reads it (developer is system; tool calls as OpenAI's dicts)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# --- tools and structured output -----------------------------------------------------------------------------


def _name(v: str) -> str:
    if not NAME.match(v):
        raise ValueError("letters, digits, _ and -, at most 64")
    return v


Name = Annotated[str, AfterValidator(_name), Field(description="^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(Strict):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="compile the parameters schema exactly (else unknown keywords "
                                "are ignored)")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(..., min_length=1)


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JsonSchemaSpec(Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON schema (absent: any JSON)")
    strict: bool | None = Field(None, description="compile the schema exactly (else unknown keywords are ignored)")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StreamOptions(Strict):
    include_usage: bool | None = Field(None, description="a last chunk with the usage (and choices [])")
    include_obfuscation: bool | None = Field(None, description="each delta chunk carries an `obfuscation` field "
                                             "of random characters (normalizes payload sizes)")


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
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as text) -> bias, -100..100")
    user: str | None = Field(None, description="an end-user id; does not change the answer")
    ignore_eos: bool | None = Field(None, description="not OpenAI's (vLLM's and llama.cpp's): generate past the "
                                    "end-of-sequence token, up to max_tokens or a stop string (fixed lengths, for "
                                    "benchmarks)")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids, not {key[:20]!r}")
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
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name")
    logprobs: bool | None = Field(None, description="each content token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="with logprobs: that many most "
                                     "likely alternatives per token")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="default true; false: at most one call")
    store: bool | None = Field(None, description="false only: completions are not stored")
    metadata: dict[str, str] | None = Field(None, description="tags for a stored completion; does not change the "
                                            "answer")
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
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a prompt, or several (n choices each): text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each token's logprob and that many "
                                 "most likely alternatives")
    echo: bool | None = Field(None, description="the prompt's text before each choice's")
    best_of: int | None = Field(None, ge=1, description="equal to n (or null) only")
    suffix: Any = None

    _suffix = field_validator("suffix")(unsupported("insertion (suffix) is not supported"))

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
