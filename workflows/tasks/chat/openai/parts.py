"""The parts of a chat request's body, as protocol.py's requests declare them: messages (their content
parts and tool calls), tools, tool_choice and response formats, and what every part of the protocol
shares: `Strict` (a field OpenAI does not define is a 400), `bounded` (a list's length checked before its
items), `unsupported` (a field OpenAI defines that this server does not honour) and `BadRequest`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# the bounds of a body's lists (OpenAI's own where it has one: 128 tools, 4 stop strings, 16 metadata keys,
# 300 logit_bias entries)
MAX_MESSAGES, MAX_PARTS, MAX_TOOLS, MAX_STOPS, MAX_LOGIT_BIAS, MAX_PROMPTS = 2048, 256, 128, 4, 300, 128
GUIDANCE_KEY = "x-guidance"  # llguidance reads a schema's own options (whitespace, separators) under this key


class BadRequest(ValueError):
    """A request this server refuses: an HTTP 4xx with OpenAI's error body naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def bounded(*fields: str, limit: int):
    """A check of `fields`' length before their items are validated (a union's every member would otherwise
    validate, and fail on, each of 100,000 items first): over `limit`, a ValueError naming the field."""
    def check(cls, v):
        if isinstance(v, (list, dict)) and len(v) > limit:
            raise ValueError(f"at most {limit} items, not {len(v)}")
        return v
    return field_validator(*fields, mode="before")(check)


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
    content: str | Annotated[list[Part], Field(max_length=MAX_PARTS)] | None = Field(
        None, description="text, or text parts (no images: a text model)")
    name: str | None = Field(None, description="the participant's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None

    _audio = field_validator("audio")(unsupported("audio is not supported (a text model)"))
    _function_call = field_validator("function_call")(unsupported("deprecated by OpenAI: use tool_calls"))
    _parts = bounded("content", limit=MAX_PARTS)
    _calls = bounded("tool_calls", limit=MAX_TOOLS)

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


def _no_guidance(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """A client's schema without llguidance's own options: this server sets them (compact JSON, no padding)."""
    if v is not None and GUIDANCE_KEY in v:
        raise ValueError(f"{GUIDANCE_KEY} (llguidance's grammar options) is set by this server, not by a request")
    return v


Schema = Annotated[dict[str, Any], AfterValidator(_no_guidance)]


def _name(v: str) -> str:
    if not NAME.match(v):
        raise ValueError("letters, digits, _ and -, at most 64")
    return v


Name = Annotated[str, AfterValidator(_name), Field(description="^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(Strict):
    name: Name
    description: str | None = None
    parameters: Schema | None = Field(None, description="a JSON schema of the arguments object")
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
    tools: list[NamedToolChoice] = Field(..., min_length=1, max_length=MAX_TOOLS)

    _tools = bounded("tools", limit=MAX_TOOLS)


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JsonSchemaSpec(Strict):
    name: Name
    description: str | None = None
    schema_: Schema | None = Field(None, alias="schema", description="a JSON schema (absent: any JSON)")
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
