"""A generated sequence's text as its tokens come: incremental detokenization, stop strings, and the text
held back while it may still become a stop string. Plain Python and a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PENDING = 8  # tokens without new text before they are read anyway: a UTF-8 character is at most 4 bytes


@dataclass
class TextState:
    """A sequence's generated text, built token by token. Detokenizing the new tokens alone can split a
    character made of several tokens (a byte-level BPE's UTF-8 pieces), so each step decodes a short
    window (from `prefix` to the end) and keeps its new characters once they no longer end in U+FFFD.
    `emitted` counts the characters handed out: text that may still be the start of a stop string waits.

    Bounded per token: the window is a few tokens (tokens that give no text, such as special tokens
    skipped, or bytes that never complete a character, are read anyway once MAX_PENDING of them wait:
    as text, U+FFFD included, or as nothing), a stop string is searched for only where it could end in
    the new text, and the text held back is at most the longest stop string (whose length the server
    caps: serve.generate.max_stop_chars)."""

    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    prefix: int = 0  # window start (tokens)
    read: int = 0  # tokens whose text is in `text`
    stopped: bool = False

    def add(self, token: int, tokenizer) -> None:
        """Append a token; finds a stop string in the text (then `stopped`, and the text ends before it)."""
        self.ids.append(token)
        before = tokenizer.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        window = tokenizer.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if (len(window) <= len(before) or window.endswith("\ufffd")) and len(self.ids) - self.read < MAX_PENDING:
            return  # a character still incomplete (or a special token): wait for the next token
        start = len(self.text)
        self.text += window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        cut = min((i for s in self.stop if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True

    def delta(self, final: bool) -> str:
        """The text not yet handed out, less (unless `final`) the end that may begin a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self.held_back()
        out, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return out

    def held_back(self) -> int:
        """Characters at the end of the text that are a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:  # O(len(s)²) characters compared at most: bounded by the cap on stop strings
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
