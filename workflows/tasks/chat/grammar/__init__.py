"""The chat wing's structured output: grammars that llguidance enforces token by token, and the view of a
tokenizer they need.

It owns what turns a JSON schema or a Lark grammar into a per-request constraint on the model's tokens
(`Grammars.constraint`, a `GrammarConstraint` that the engine calls as its `TokenConstraint`), and a
token's exact text and bytes (`TokenText`), which a grammar matches and OpenAI's logprobs report.

It imports no other room of the wing: the engine's `TokenConstraint` is a protocol it fills without
importing it. The rooms above (`openai`, `serving`) import it.

Modules:
- `grammars`: grammars from JSON schemas and Lark, compiled once per text, one matcher per request;
- `token_text`: a token id's text and bytes (byte-level BPE's map inverted).
"""

from workflows.tasks.chat.grammar.grammars import (
    GrammarConstraint,
    GrammarError,
    Grammars,
    lark_grammar,
    lark_json,
    object_grammar,
    schema_grammar,
)
from workflows.tasks.chat.grammar.token_text import TokenText

__all__ = ["GrammarConstraint", "GrammarError", "Grammars", "TokenText", "lark_grammar", "lark_json",
           "object_grammar", "schema_grammar"]
