"""A request's grammar as the vLLM engine hands it over: Lark text, for vLLM's guidance backend (llguidance,
the library our grammars are compiled by, so a grammar means the same on both engines).

Our grammars (workflows.tasks.chat.grammar) are llguidance's top-level grammar: either Lark text (tool
calls, `%json` rules inside), or a JSON document holding one JSON schema with its `x-guidance` options
(response_format). vLLM takes a grammar as Lark (or GBNF) text only, so a schema becomes the one-rule Lark
grammar `start: %json {schema}`, its options kept in the schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarText:
    """SamplingParams.constraint for the vLLM engine: the grammar's Lark text (vLLM enforces it)."""

    lark: str

    @classmethod
    def of(cls, grammar: str) -> GrammarText:
        """From one of our grammars (llguidance's top-level grammar text)."""
        if not grammar.lstrip().startswith("{"):
            return cls(grammar)
        grammars = json.loads(grammar)["grammars"]
        if len(grammars) != 1 or grammars[0].get("json_schema") is None:
            raise ValueError("a grammar document for vLLM holds one JSON schema")
        return cls("start: %json " + json.dumps(grammars[0]["json_schema"], ensure_ascii=False))
