"""The chat task's data: raw chat rows -> token ids with assistant-only labels, on Ray Data, and the
batches training and validation read.

A raw row is `messages` (a list of {role, content}, the last an assistant's answer) or a `prompt`
and a `completion` (one user turn, one assistant turn). `ChatEncoder` applies the model's chat
template and tokenizes; a token is a label when it belongs to an assistant turn's content or to the
eos that ends that turn (so the model learns to stop), -100 everywhere else (system and user turns,
the template's role headers). Each turn's span is found from the template's own rendering of the
conversation up to it, with and without the generation prompt, so any template whose turns render
as prefixes of the whole conversation works, and one whose assistant turns do not end with eos is
refused. A conversation longer than preprocess.max_length tokens is dropped and counted (cutting it
would cut the answer the held-out score compares).

Stored per row: input_ids and labels (the whole conversation), prompt_ids (up to the last assistant
turn's content: what greedy decoding starts from), answer_ids (that turn's content tokens), answer
(its text: the evaluation's label column) and prompt (the messages before it, as JSON: what a served
request holds). Rows are never packed: a batch pads each row to the longest (right-padded), the
padding masked by the attention mask and -100 labels, never recognized by its id (pad = eos here).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np
import pandas as pd

from workflows.errors import UserError
from workflows.tasks.chat.training.model import load_tokenizer, pad_id, resolve_dir

FORMAT_VERSION = 1  # bump when the stored rows or their encoding change
ROLES = ("system", "user", "assistant")
STATUSES = ("ok", "too_long", "invalid")


def to_messages(row: dict, system_prompt: str | None = None) -> list[dict] | None:
    """A raw row's conversation as [{role, content}], or None when it has none that ends with an
    assistant's answer. `messages` may be a list, a numpy array (parquet/JSONL via pandas) or a JSON
    string; `system_prompt` is prepended when the conversation has no system turn."""
    raw = row.get("messages")
    if raw is not None and not (isinstance(raw, float) and np.isnan(raw)):
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError:
                return None
        try:
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(raw)]
        except (KeyError, TypeError):
            return None
    elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    else:
        return None
    if (not messages or messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip()
            or any(m["role"] not in ROLES for m in messages)):
        return None
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


class ChatEncoder:
    """The model's tokenizer and chat template, loaded once per process: conversations -> rows."""

    def __init__(self, model_dir: str, max_length: int, system_prompt: str | None = None):
        self.tok = load_tokenizer(model_dir)
        self.max_length, self.system_prompt = max_length, system_prompt
        self.eos = self.tok.eos_token

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant turn: its content and
        the eos ending it (what the labels count)."""
        text, spans = self.render(messages), []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before, through = self.render(messages[:i], True), self.render(messages[: i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise UserError("the chat template does not render a conversation's turns as prefixes of it; "
                                "the chat task cannot tell the assistant's tokens")
            end = through.find(self.eos, len(before))
            if end < 0:
                raise UserError(f"the chat template does not end an assistant turn with eos {self.eos!r}: a model "
                                "trained on it would not learn to stop")
            spans.append((len(before), end + len(self.eos)))
        return text, spans

    def encode(self, messages: list[dict]) -> dict | None:
        """One conversation -> the stored row's token columns; None when longer than max_length."""
        text, spans = self.assistant_spans(messages)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        if len(ids) > self.max_length:
            return None
        labels = [tid if any(a <= start < b for a, b in spans) else -100 for tid, (start, _) in zip(ids, offsets)]
        last = spans[-1][0]
        cut = next(j for j, (start, _) in enumerate(offsets) if start >= last)  # where the last answer begins
        answer = [tid for j, tid in enumerate(ids) if j >= cut and labels[j] != -100]
        if answer and answer[-1] == self.tok.eos_token_id:
            answer = answer[:-1]
        return {"input_ids": np.asarray(ids, np.int32), "labels": np.asarray(labels, np.int32),
                "prompt_ids": np.asarray(ids[:cut], np.int32), "answer_ids": np.asarray(answer, np.int32)}

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A served conversation (ending with a user turn) -> the ids greedy decoding starts from."""
        if self.system_prompt and messages and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tok(self.render(messages, True), add_special_tokens=False)["input_ids"]


def encode_batch(batch: pd.DataFrame, model_dir: str, max_length: int, system_prompt: str | None, seed: int,
                 val: float, test: float) -> pd.DataFrame:
    """Ray Data: raw rows -> stored rows with their `split` and `status` (ok, too_long, invalid)."""
    from workflows.dataset import split_of

    encoder = _encoder(model_dir, max_length, system_prompt)
    out: dict[str, list] = {k: [] for k in ("input_ids", "labels", "prompt_ids", "answer_ids", "prompt", "answer",
                                            "split", "status")}
    empty = np.zeros(0, np.int32)
    for row in batch.to_dict("records"):
        messages = to_messages(row, system_prompt)
        encoded = encoder.encode(messages) if messages is not None else None
        key = json.dumps(messages, sort_keys=True) if messages is not None else json.dumps(str(row))
        status = "invalid" if messages is None else "too_long" if encoded is None else "ok"
        for k in ("input_ids", "labels", "prompt_ids", "answer_ids"):
            out[k].append(encoded[k] if encoded else empty)
        out["prompt"].append(json.dumps(messages[:-1]) if messages else "")
        out["answer"].append(messages[-1]["content"] if messages else "")
        out["split"].append(split_of(key, seed, val, test))
        out["status"].append(status)
    return pd.DataFrame(out)


@functools.lru_cache(maxsize=2)
def _encoder(model_dir: str, max_length: int, system_prompt: str | None) -> ChatEncoder:
    return ChatEncoder(model_dir, max_length, system_prompt)


def status_counts(batch: pd.DataFrame) -> pd.DataFrame:
    return batch.groupby(["split", "status"], as_index=False).size().rename(columns={"size": "rows"})


def stored_rows(batch: pd.DataFrame) -> pd.DataFrame:
    return batch[batch["status"] == "ok"].drop(columns=["status"])


def tokenizer_identity(model_dir: str) -> str:
    """Hash of the tokenizer's files, chat template included: another vocabulary or template is
    another dataset version."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "chat_template.json", "vocab.json", "merges.txt"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            h.update(name.encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


def dataset_version(task, shards, model_dir: str) -> str:
    """What the stored rows depend on: the shards, the split settings, the tokenizer and its chat
    template, max_length and the options that preprocessing reads (`task.preprocess_options`)."""
    d = task.cfg.data
    key = {"task": "chat", "format_version": FORMAT_VERSION, "shards": [(s.uri, s.version, s.size) for s in shards],
           "val": d.val_fraction, "test": d.test_fraction, "split_seed": d.split_seed,
           "tokenizer": tokenizer_identity(model_dir), "template": _encoder_template(model_dir),
           "max_length": task.cfg.preprocess.max_length, "options": task.preprocess_options()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _encoder_template(model_dir: str) -> str:
    return str(load_tokenizer(model_dir).chat_template)


def preprocess_chat(task, ctx, say):
    """The raw chat shards of data.source -> the processed dataset (written once per version)."""
    import ray.data

    from workflows.dataset import SPLITS, ProcessedDataset, write_splits
    from workflows.preprocess.run import start_preprocess
    from workflows.preprocess.sources import read_dataset

    cfg, d = task.cfg, task.cfg.data
    if d.max_rows is not None:
        raise UserError("data.max_rows: not supported by the chat task")
    model_dir = resolve_dir(cfg.model.name_or_path, cfg)
    run = start_preprocess(cfg, ctx, say, lambda shards: dataset_version(task, shards, model_dir), "chat shard(s)")
    if run.done is not None:
        return run.done
    raw = read_dataset(run.shards, run.format, ctx, cfg.cache)
    columns = set(raw.schema().names)
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        raise UserError(f"{d.source}: chat rows need a `messages` column or `prompt` and `completion` "
                        f"(found {sorted(columns)})")
    args = (model_dir, cfg.preprocess.max_length, task.options.system_prompt, d.split_seed, d.val_fraction,
            d.test_fraction)
    encoded = raw.map_batches(encode_batch, batch_format="pandas", batch_size=cfg.preprocess.batch_size,
                              compute=ray.data.TaskPoolStrategy(size=cfg.preprocess.concurrency),
                              fn_args=args).materialize()
    table = encoded.map_batches(status_counts, batch_format="pandas").to_pandas()
    table = table.groupby(["split", "status"], as_index=False)["rows"].sum()
    by = {(r.split, r.status): int(r.rows) for r in table.itertuples(index=False)}
    counts = {s: by.get((s, "ok"), 0) for s in SPLITS}
    dropped = {st: sum(by.get((s, st), 0) for s in SPLITS) for st in STATUSES[1:]}
    if counts["train"] == 0 or counts["val"] == 0:
        raise UserError(f"{d.source}: chat rows per split {counts} (dropped: {dropped}); need train and val rows")
    tok = load_tokenizer(model_dir)
    files = write_splits(encoded.map_batches(stored_rows, batch_format="pandas"), run.uri, ctx,
                         cfg.preprocess.rows_per_shard, d.split_seed)
    info = {"model": cfg.model.name_or_path, "tokenizer": tokenizer_identity(model_dir), "pad_id": pad_id(tok),
            "eos_id": tok.eos_token_id, "dropped": dropped}
    data = run.finish(ProcessedDataset(uri=run.uri, version=run.version, labels=[], label_column="answer",
                                       files=files, counts=counts, label_counts={}, source=d.source,
                                       task=cfg.model.task, tokenizer=task.dataset.tokenizer(),
                                       max_length=cfg.preprocess.max_length, info=info))
    say(f"preprocess: {sum(counts.values())} chat rows ({counts}; dropped {dropped}) in {run.seconds():.1f}s")
    return data


def pad_right(rows, value: int) -> np.ndarray:
    width = max((len(r) for r in rows), default=1)
    out = np.full((len(rows), max(width, 1)), value, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def pad_left(rows, value: int) -> tuple[np.ndarray, np.ndarray]:
    width = max((len(r) for r in rows), default=1)
    ids = np.full((len(rows), max(width, 1)), value, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, -len(r):] = r
            mask[i, -len(r):] = 1
    return ids, mask


def chat_collate(batch: dict, pad: int, prompts: bool) -> dict:
    """Stored rows -> a batch: input_ids right-padded with `pad`, the attention mask (1 on the rows'
    tokens only) and labels (-100 on padding); `prompts` (validation): the left-padded prompt_ids and
    their mask, and answer_ids (-1 after each row's), for greedy decoding and exact match."""
    import torch

    ids, labels = list(batch["input_ids"]), list(batch["labels"])
    out = {"input_ids": torch.from_numpy(pad_right(ids, pad)), "labels": torch.from_numpy(pad_right(labels, -100))}
    mask = pad_right([np.ones(len(r)) for r in ids], 0)
    if not mask.all():  # rows of one length: no mask (a given one makes the model check it on the device)
        out["attention_mask"] = torch.from_numpy(mask)
    if prompts:
        prompt, mask = pad_left(list(batch["prompt_ids"]), pad)
        out.update(prompt_ids=torch.from_numpy(prompt), prompt_mask=torch.from_numpy(mask),
                   answer_ids=torch.from_numpy(pad_right(list(batch["answer_ids"]), -1)))
    return out
