"""A token's text and bytes, as OpenAI's logprobs report them and as a grammar matches them.

Byte-level BPE tokenizers (GPT-2's scheme: SmolLM2, Llama 3, Qwen) map each byte to a printable
character; inverting that map gives a token's exact bytes, a character's UTF-8 pieces included. Other
tokenizers' tokens are decoded one by one. The text is the bytes decoded, invalid UTF-8 (part of a
character) as \\x escapes.
"""

from __future__ import annotations

from functools import lru_cache


def byte_characters() -> dict[int, str]:
    """GPT-2's byte-level BPE map of each byte to a printable character: printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in order. Written here because transformers
    keeps it in no stable public place (its GPT-2 tokenizer module lost it in 5.x)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class TokenText:
    """A token id's (text, bytes) for logprobs, from the tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = None
        if type(decoder).__name__ == "ByteLevel":  # GPT-2's byte-to-character map, inverted
            self._bytes_of = {c: b for b, c in byte_characters().items()}
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
