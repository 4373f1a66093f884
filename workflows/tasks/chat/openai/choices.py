"""One choice of an answer in OpenAI's shapes: its text (or, for a request with tools, its text and tool
calls), its finish reason, and its tokens' logprobs; as one JSON choice at the end, or as the choice
part of each streamed chunk.

Chat logprobs are OpenAI's `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`; text
completions' the legacy `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token's text and bytes: workflows.tasks.chat.grammar.token_text. The end-of-sequence token is not reported (it has no
text); a logprob of -inf (a token a grammar or logit_bias ruled out) is reported as -9999.0, JSON having
no infinity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workflows.tasks.chat.grammar import TokenText
from workflows.tasks.chat.openai.tools import ToolCallReader

MIN_LOGPROB = -9999.0


@dataclass
class AnswerShape:
    """How a request's answer is shaped (the same for each of its choices)."""

    logprobs: bool = False  # report each token's logprob (the engine computes them: params.logprobs)
    tools: set[str] | None = None  # read tool calls of these functions out of the text
    parallel_tool_calls: bool = True
    echo: list[str] | None = None  # text completions: each prompt's text, before its choices' text
    token_text: TokenText | None = None
    eos: frozenset[int] = frozenset()
    choices_per_prompt: int = 1
    obfuscation: bool = False


def lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


@dataclass
class Choice:
    """The state of one choice as its deltas come."""

    index: int
    kind: str  # "chat" | "text"
    shape: AnswerShape
    prompt_text: str = ""
    text: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    chat_logprobs: list[dict] = field(default_factory=list)
    text_logprobs: dict = field(default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                         "text_offset": []})
    offset: int = 0
    reader: ToolCallReader | None = None

    def __post_init__(self):
        if self.shape.tools is not None:
            self.reader = ToolCallReader(self.shape.tools, self.shape.parallel_tool_calls)
        self.offset = len(self.prompt_text)

    # --- one delta -------------------------------------------------------------------------------------
    def take(self, delta) -> tuple[str, list[dict], dict | None]:
        """(text to show, tool calls completed, logprobs of its tokens in OpenAI's shape or None)."""
        text, calls = delta.text, list[dict]()
        if self.reader is not None:
            text, calls = self.reader.feed(text)
            if delta.finish_reason is not None:
                rest, more = self.reader.finish()
                text, calls = text + rest, calls + more
        self.text.append(text)
        self.calls += calls
        return text, calls, self._logprobs(delta)

    def _logprobs(self, delta) -> dict | None:
        if not self.shape.logprobs:
            return None
        entries = [e for e in (getattr(delta, "logprobs", None) or []) if e[0] not in self.shape.eos]
        words = self.shape.token_text
        assert words is not None
        if self.kind == "chat":
            def entry(token: int, value: float) -> dict:
                text, raw = words.get(token)
                return {"token": text, "logprob": lp(value), "bytes": list(raw)}

            content = [{**entry(token, value), "top_logprobs": [entry(t, v) for t, v in top]}
                       for token, value, top in entries]
            self.chat_logprobs += content
            return {"content": content, "refusal": None}
        part: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, value, top in entries:
            text = words.get(token)[0]
            part["tokens"].append(text)
            part["token_logprobs"].append(lp(value))
            part["top_logprobs"].append({words.get(t)[0]: lp(v) for t, v in top})
            part["text_offset"].append(self.offset)
            self.offset += len(text)
        for key, values in part.items():
            self.text_logprobs[key] += values
        return part

    # --- the answer ------------------------------------------------------------------------------------
    def reason(self, finish_reason: str | None) -> str | None:
        """OpenAI's finish reason: a generation that stopped after tool calls ended with "tool_calls"."""
        return "tool_calls" if finish_reason == "stop" and self.calls else finish_reason

    def final(self, finish_reason: str | None) -> dict:
        """The whole choice (a JSON answer's)."""
        text = "".join(self.text)
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text, "refusal": None}
            if self.calls:
                message["content"] = text.strip() or None
                message["tool_calls"] = self.calls
            logprobs = {"content": self.chat_logprobs, "refusal": None} if self.shape.logprobs else None
            return {"index": self.index, "message": message, "logprobs": logprobs,
                    "finish_reason": self.reason(finish_reason)}
        return {"index": self.index, "text": self.prompt_text + text,
                "logprobs": self.text_logprobs if self.shape.logprobs else None,
                "finish_reason": self.reason(finish_reason)}

    def chunk(self, text: str, calls: list[dict], logprobs: dict | None, finish_reason: str | None) -> dict:
        """The choice part of a streamed chunk."""
        reason = self.reason(finish_reason) if finish_reason is not None else None
        if self.kind == "text":
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        # a token's chunk carries its content, "" while its text is held back; the last chunk none
        delta: dict = {"content": text} if text or (not calls and finish_reason is None) else {}
        if calls:
            first = len(self.calls) - len(calls)
            delta["tool_calls"] = [{"index": first + k, **c} for k, c in enumerate(calls)]
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
