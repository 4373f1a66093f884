"""Tools (function calling): how `tools` and a conversation's tool calls reach the model's chat template,
how the model's answer is read back into OpenAI's `tool_calls` (streamed too), and the grammar that
`tool_choice` "required" or a named function imposes.

The template decides first. A chat template that reads `tools` (Qwen2.5's, Llama 3.1's, Hermes') gets
them as transformers passes them (`apply_chat_template(tools=...)`), with the history's assistant
`tool_calls` (arguments as objects) and `tool` messages as they are. A template that does not (SmolLM2's
ChatML template, and most small models') would drop them silently, as transformers and vLLM then do; here
they are written in the Hermes format instead, which Qwen2.5's and NousResearch's Hermes templates use
on ChatML and which vLLM's `hermes` parser reads:
- the tools, one JSON object each inside <tools></tools>, and the instruction to answer a call as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, in the system message (after its text);
- an assistant's earlier tool calls as such <tool_call> blocks after its text;
- `tool` messages as a user turn of <tool_response></tool_response> blocks (consecutive ones together).

The answer is read in that format whatever the template: each <tool_call> block whose JSON names one of
the request's tools becomes a tool call ("arguments" or "parameters" as the arguments); a block that does
not parse stays in the text. Streamed, text that may begin a block waits, and each call is sent as one
delta (id, name and arguments) once its block closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from workflows.tasks.chat.grammar import lark_grammar, lark_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template uses the `tools` variable (else tools are written in the Hermes format)."""
    if not template:
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template


def function(tool: dict) -> dict:
    return tool["function"]


def hermes_system(tools: list[dict]) -> str:
    """The tools' part of the system message, as Qwen2.5's template writes it."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{CLOSE}")


def arguments(call: dict) -> dict:
    """An OpenAI tool call's arguments (JSON text, checked by the request model) as an object."""
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args


def call_block(name: str, arguments: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def render(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for `apply_chat_template`: the template's own way when it reads tools (`native`),
    else the Hermes format written into plain messages (tools None). Messages are OpenAI's, assistant
    tool calls' arguments JSON text; the result has them as objects (transformers' convention)."""
    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{"id": c.get("id"), "type": "function",
                                          "function": {"name": c["function"]["name"], "arguments": arguments(c)}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return out, tools or None
    out = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_responses": True})
        elif m.get("tool_calls"):
            blocks = [call_block(c["function"]["name"], arguments(c)) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
            out.append({k: v for k, v in {**m, "content": text}.items() if k != "tool_calls"})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_responses", None)
    if tools:
        part = hermes_system(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{part}" if out[0]["content"] else part}
        else:
            out.insert(0, {"role": "system", "content": part})
    return out, None


def call_grammar(tools: list[dict], parallel: bool, answer: tuple[dict, bool] | None = None) -> str:
    """The llguidance grammar of tool calls in the Hermes format: one (or, with `parallel`, one or more)
    <tool_call> blocks whose JSON is {"name": one of `tools`, "arguments": valid for its parameters},
    each function's `strict` deciding how its schema is compiled; with `answer` (a JSON schema and its
    strictness), a JSON answer in that schema instead of the calls is allowed too."""
    rules = []
    for i, tool in enumerate(tools):
        f = function(tool)
        schema = {"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or EMPTY_PARAMETERS},
                  "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"fn{i}: {lark_json(schema, bool(f.get('strict')))}")
    calls = 'call ("\\n" call)*' if parallel else "call"
    start = f"start: answer | {calls}" if answer else f"start: {calls}"
    lines = [start, f"call: {json.dumps(OPEN + chr(10))} ({' | '.join(f'fn{i}' for i in range(len(tools)))}) "
                    f"{json.dumps(chr(10) + CLOSE)}", *rules]
    if answer:
        lines.append(f"answer: {lark_json(*answer)}")
    return lark_grammar("\n".join(lines) + "\n")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(body: str, names: set[str]) -> dict | None:
    """A <tool_call> block's JSON as {"name", "arguments" (JSON text)}, or None if it is not a call of a
    known tool."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


@dataclass
class ToolCallReader:
    """Reads tool calls out of an answer's text as it comes: `feed(text)` and, at the end, `finish()`
    return (text to show, [calls completed]); text that may begin a <tool_call> block waits, and so does
    whitespace after a call (dropped if another call or the end follows). With `parallel` False only the
    first call is kept."""

    names: set[str]
    parallel: bool = True
    calls: list[dict] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _gap: str | None = None  # whitespace after a call, held (None: not after a call)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        shown: list[str] = []
        new: list[dict] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = next((n for n in range(min(len(OPEN) - 1, len(self._buf)), 0, -1)
                                 if self._buf.endswith(OPEN[:n])), 0)
                    self._show(self._buf[:len(self._buf) - keep], shown)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._show(self._buf[:i], shown)
                self._buf, self._in_call = self._buf[i + len(OPEN):], True
            else:
                i = self._buf.find(CLOSE)
                if i < 0:
                    break
                body, self._buf, self._in_call = self._buf[:i], self._buf[i + len(CLOSE):], False
                self._take(body, shown, new)
        return "".join(shown), new

    def finish(self) -> tuple[str, list[dict]]:
        """The rest: an unclosed last block is a call if its JSON is complete (a model that ended there)."""
        shown: list[str] = []
        new: list[dict] = []
        if self._in_call:
            self._take(self._buf, shown, new, closed=False)
        else:
            self._show(self._buf, shown)
        self._buf, self._in_call = "", False
        return "".join(shown), new

    def _take(self, body: str, shown: list[str], new: list[dict], closed: bool = True) -> None:
        call = parse_call(body, self.names)
        if call is None:
            self._show(OPEN + body + (CLOSE if closed else ""), shown)
            return
        self._gap = ""
        if self.parallel or not self.calls:
            call = {"id": new_call_id(), "type": "function", "function": call}
            self.calls.append(call)
            new.append(call)

    def _show(self, text: str, shown: list[str]) -> None:
        if self._gap is not None:
            text = self._gap + text
            if not text.strip():
                self._gap = text
                return
            text, self._gap = text.lstrip(), None
        shown.append(text)
