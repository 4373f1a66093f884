"""A token's text and bytes, as OpenAI's logprobs report them and as a grammar matches them.

Byte-level BPE tokenizers (GPT-2's scheme: SmolLM2, Llama 3, Qwen) map each byte to a printable
character; inverting that map gives a token's exact bytes, a character's UTF-8 pieces included. Other
tokenizers' tokens are decoded one by one. The text is the bytes decoded, invalid UTF-8 (part of a
character) as \\x escapes.
"""

from __future__ import annotations

from functools import lru_cache


class TokenText:
    """A token id's (text, bytes) for logprobs, from the tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = None
        if type(decoder).__name__ == "ByteLevel":  # GPT-2's byte-to-character map, inverted
            from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

            self._bytes_of = {c: b for b, c in bytes_to_unicode().items()}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.get = lru_cache(maxsize=1 << 16)(self._get)

    def _get(self, token: int) -> tuple[str, bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if self._bytes_of is not None and token not in self._special and piece is not None \
                and all(c in self._bytes_of for c in piece):
            raw = bytes(self._bytes_of[c] for c in piece)
        else:
            raw = self.tokenizer.decode([token]).encode()
        return raw.decode("utf-8", errors="backslashreplace"), raw
