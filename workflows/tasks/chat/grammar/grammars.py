"""Structured output: a grammar per request, enforced token by token (the engine's `TokenConstraint`).

The grammars come from llguidance (PyPI `llguidance`, the Rust library behind vLLM's and llama.cpp's
`guidance` backends and OpenAI's own Structured Outputs): a JSON schema (`response_format`
`json_schema`), any JSON object (`json_object`), or a Lark grammar that embeds JSON schemas (`%json`),
which the tool calls that `tool_choice` demands are written in (workflows.tasks.chat.openai.tools). It has no
dependencies (one abi3 wheel), computes a token mask in tens of microseconds, and covers JSON Schema
($ref/$defs, anyOf, enums, bounds, patterns); xgrammar, the other library vLLM ships, pulls in triton
on Linux.

JSON is generated compactly, Python's `json.dumps` style (", " and ": " between items and keys, no
other whitespace): a model cannot pad an answer with endless whitespace. An object that lists its
properties takes no others unless its schema says so (`closed`). `strict: true` compiles the
schema exactly (a keyword llguidance does not implement is a 400 naming it); otherwise unknown keywords
are ignored and the rest of the schema still constrains.

Each request (each choice of one) gets its own matcher, deep-copied from a compiled one kept per grammar
text (an app sends the same schema again and again); a grammar that failed to compile is kept too, so a
client resending it costs a lookup. Each grammar is compiled once, with llguidance's limits set below its
defaults (LIMITS: a mask step's lexer work and Earley items, the lexer's states, the grammar's size), and
llguidance releases the GIL while it compiles or computes a mask. Rows without a constraint are untouched.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from workflows.tasks.chat.grammar.token_text import TokenText

# llguidance's JSON options: compact, Python's separators
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_ERROR_CHARS = 300
# llguidance's ParserLimits (defaults in its docs): a mask step at most ~50k lexer fuel and 20k Earley items
# (a few ms, not the default's ~15 ms, in the decode thread beside every other row), 100k lexer states, a
# grammar of 200k symbols; verbose errors off (the message names the failure, not the parser's state)
LIMITS: dict[str, Any] = {"step_lexer_fuel": 50_000, "step_max_items": 20_000, "max_lexer_states": 100_000,
                          "max_grammar_size": 200_000, "verbose_errors": False}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def json_options(strict: bool) -> Any:
    """llguidance's JsonCompileOptions."""
    return {**JSON_OPTIONS, "lenient": not strict}


DATA_KEYWORDS = ("enum", "const", "default", "examples")  # their values are JSON data, not schemas


def closed(schema):
    """The schema with every object that lists its properties closed to others (additionalProperties
    false where it says nothing about other keys), as OpenAI's strict mode requires and vLLM's default
    grammar backend (xgrammar's strict mode) assumes: a model cannot invent keys."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in DATA_KEYWORDS else closed(v)) for k, v in schema.items()}
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def schema_grammar(schema: dict, strict: bool) -> str:
    """The grammar of JSON text valid for `schema` (closed)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(closed(schema), overrides=json_options(strict))


def object_grammar() -> str:
    """Any JSON object (OpenAI's json_object)."""
    return schema_grammar({"type": "object"}, strict=True)


def lark_json(schema: dict, strict: bool) -> str:
    """A Lark rule body for JSON text valid for `schema` (llguidance's `%json`), with our JSON options."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": json_options(strict)}, ensure_ascii=False)


def lark_grammar(lark: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


class Grammars:
    """The grammars of one tokenizer: llguidance's view of its vocabulary (built once, about a second for
    a 50k vocabulary) and the matchers compiled per grammar text (least recently used dropped)."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int], cache: int = 64):
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        try:  # llguidance reads a fast tokenizer's own description (its normalizer, its decoder)
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except (ValueError, RuntimeError):  # a slow tokenizer, or a decoder llguidance does not know
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary(tokenizer, vocab_size, eos)))
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> matcher, or its error text
        self._cache, self._lock = cache, threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache): for tests

    def compiled(self, grammar: str, param: str) -> Any:
        """`grammar`'s compiled matcher (from the cache, or compiled now, once); GrammarError naming `param`
        if it does not compile (kept as well: the same text is refused again without compiling)."""
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
        if matcher is None:
            from llguidance import LLMatcher, LLParserLimits

            self.compiles += 1
            compiled = LLMatcher(self.tokenizer, grammar, limits=LLParserLimits(**LIMITS), log_level=0)
            matcher = compiled.get_error()[:MAX_ERROR_CHARS] if compiled.is_error() else compiled
            with self._lock:
                self._compiled[grammar] = matcher
                while len(self._compiled) > self._cache:
                    self._compiled.popitem(last=False)
        if isinstance(matcher, str):
            raise GrammarError(f"{param}: {matcher}", param)
        return matcher

    def constraint(self, grammar: str, param: str) -> GrammarConstraint:
        """A fresh constraint (its own matcher state) for `grammar`; GrammarError if it does not compile."""
        return self.fresh(self.compiled(grammar, param))

    def fresh(self, matcher) -> GrammarConstraint:
        """A constraint of its own (a copy of the compiled matcher's start state)."""
        return GrammarConstraint(matcher.deep_copy(), self.vocab_size)


class Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer it cannot load itself: each token id's bytes
    (TokenText; ids past the tokenizer's, up to the logits' width, empty), the special ids, the
    end of sequence, and how text is tokenized: by the tokenizer where its tokens give the text back,
    else (a vocabulary without every byte's token, which maps unknown words to <unk>) longest match first
    over the tokens' bytes."""

    def __init__(self, tokenizer, vocab_size: int, eos: list[int]):
        words = TokenText(tokenizer)
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = eos[0], tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids) | set(eos))
        self.tokens = [words.get(i)[1] if i < len(tokenizer) else b"" for i in range(vocab_size)]
        special = set(self.special_token_ids)
        self._ids = {b: i for i, b in reversed(list(enumerate(self.tokens))) if b and i not in special}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if b"".join(self.tokens[i] for i in ids) == text.encode():
            return ids
        raw, out, at = text.encode(), [], 0
        while at < len(raw):
            n = next((n for n in range(min(self._longest, len(raw) - at), 0, -1) if raw[at:at + n] in self._ids), 0)
            if not n:
                raise ValueError(f"no token for the byte {raw[at]:#x}")
            out.append(self._ids[raw[at:at + n]])
            at += n
        return out


class GrammarConstraint:
    """One request's grammar state (the engine's TokenConstraint): masks its logits row, advances on the chosen
    token, and is done when the grammar admits nothing more."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, logits: torch.Tensor) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar: {self.matcher.get_error()[:MAX_ERROR_CHARS]}")
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)  # drops the GIL
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        if len(allowed) < logits.shape[-1]:  # logits wider than the vocabulary: the rest never allowed
            allowed = np.pad(allowed, (0, logits.shape[-1] - len(allowed)))
        if not allowed.any():
            raise RuntimeError("grammar: no token may follow")
        blocked = torch.from_numpy(allowed == 0)
        logits.masked_fill_(blocked.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"grammar: token {token} refused: {self.matcher.get_error()[:MAX_ERROR_CHARS]}")

    def done(self) -> bool:
        return bool(self.matcher.is_stopped())
