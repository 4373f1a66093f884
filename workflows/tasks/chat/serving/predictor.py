"""The chat task's predictor and HTTP contract: one `ChatPredictor` for every use of a registered chat
model, each loading what it needs on first use.

- HTTP (workflows.serve.app): `chat_http_contract(card, cfg)` mounts the OpenAI-compatible routes of
  workflows.tasks.chat.openai on the replica's app (no /predict); they load the continuous-batching
  `engine` (`start_http`) when the app builds them, before the replica reports healthy, and answer with
  its `prompts` (token ids, grammars) and its `adapters` (the LoRA adapters it serves beside its base).
- Batch inference (`workflows predict` on prompts or conversations): `predict_frame` decodes the rows
  through the same engine, greedy, up to serve.generate.max_tokens each.
- Evaluation of processed rows (token loss, greedy answers, the base model's figures): `predict_frame`
  hands them to the training side's scorer (workflows.tasks.chat.training.scoring.ChatScorer).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from workflows.tasks.chat.engine import Engine, Generation, QueueFull, SamplingParams
from workflows.tasks.chat.openai.routes import OpenAIContract
from workflows.tasks.chat.serving.loading import load_engine
from workflows.tasks.chat.serving.metrics import ServeMetrics
from workflows.tasks.chat.serving.prompts import Prompts
from workflows.tasks.chat.serving.served_adapters import ServedAdapters
from workflows.tasks.chat.training.scoring import PROCESSED, ChatScorer
from workflows.tasks.predictor import Predictor

if TYPE_CHECKING:
    from workflows.model_card import ModelCard


class ChatPredictor(Predictor):
    """A registered chat model: its engine (a decode thread), its prompts (rendered and tokenized in a
    thread of their own, never on the event loop) and the LoRA adapters it holds, or the evaluation's
    scorer."""

    def __init__(self, task, model_dir: str, card: ModelCard, threads: int | None = None,
                 precision: str | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.task, self.cfg, self.model_dir, self.card, self.threads = task, task.cfg, model_dir, card, threads
        self.gen = self.cfg.serve.generate
        self.precision = precision or self.cfg.serve.precision  # the engine's; the scorer's is fp32
        self.input_columns = ["prompt"]
        self._engine: Engine | None = None
        self._scorer: ChatScorer | None = None
        self._lock = threading.RLock()  # each part loads once, whichever thread asks first
        self.adapters = ServedAdapters(model_dir, card, lambda: self.engine, self._lock)
        self.base_id, self.served_adapter = self.adapters.base_id, self.adapters.served_adapter
        self.prompts = Prompts(model_dir, self.base_id, getattr(task.options, "system_prompt", None),
                               lambda: self.engine, self._lock)

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine over the model (`load_engine`), loaded on first use."""
        with self._lock:
            if self._engine is None:
                self._engine = load_engine(self.model_dir, self.card, self.cfg, self.precision, self.prompts.tokenizer,
                                           self.threads)
            return self._engine

    def start_http(self) -> Engine:
        """What the OpenAI routes need before the replica reports healthy: the engine loaded, its figures
        on Prometheus per model (serving.metrics), and llguidance's view of the vocabulary (about a
        second) built in the background."""
        engine = self.engine
        engine.metrics = ServeMetrics(self.base_id, self.adapters.model_id)
        self.prompts.warm_grammars()
        return engine

    def scorer(self) -> ChatScorer:
        """The training side's scorer (evaluation of processed rows), loaded on first use."""
        with self._lock:
            if self._scorer is None:
                self._scorer = ChatScorer(self.task, self.model_dir, self.card, self.threads,
                                          self.cfg.evaluate.batch_size)
            return self._scorer

    # --- batch work -----------------------------------------------------------------------------------
    def predict(self, instances) -> list[dict]:
        """Greedy answers for instances {"prompt": text} or {"messages": [{"role", "content"}]}, up to
        serve.generate.max_tokens each, decoded together by the engine (blocking; no event loop):
        [{"text", "finish_reason", "completion_tokens"}]."""
        params = SamplingParams(max_tokens=self.gen.max_tokens, temperature=0)
        engine = self.engine
        order: list[Generation] = []
        in_flight: list[Generation] = []
        texts: dict[int, str] = {}
        for inst in instances:
            ids = (self.prompts.chat_ids(list(inst["messages"])) if "messages" in inst
                   else self.prompts.prompt_ids(inst["prompt"]))
            while True:
                try:
                    gen = engine.submit(ids, params, self.served_adapter, deadline=False)  # rows wait their turn
                    break
                except QueueFull:  # as many in flight as the engine takes: wait for the oldest
                    oldest = in_flight.pop(0)
                    texts[oldest.id] = oldest.result()[0]
            order.append(gen)
            in_flight.append(gen)
        for gen in in_flight:
            texts[gen.id] = gen.result()[0]
        return [{"text": texts[g.id], "finish_reason": g.finish_reason, "completion_tokens": g.completion_tokens}
                for g in order]

    def predict_frame(self, batch):
        """Processed rows (evaluation): the scorer's answers, token loss and base figures. Raw rows:
        `predict` over the `prompt` (or `messages`) column, adding `prediction` (the text) and
        `finish_reason`."""
        if set(PROCESSED) <= set(batch.columns):
            return self.scorer().predict_frame(batch)
        column = "messages" if "messages" in batch and "prompt" not in batch else "prompt"
        answers = self.predict([{"messages": _conversation(v)} for v in batch[column]])
        batch["prediction"] = [a["text"] for a in answers]
        batch["finish_reason"] = [a["finish_reason"] for a in answers]
        return batch

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self.prompts.close()


def _conversation(value) -> list[dict]:
    """A row's conversation: a list of {role, content} (or its JSON text, as a processed row's `prompt`),
    a final assistant turn (the reference answer of a labelled row) left out; other text is a user's turn."""
    if isinstance(value, str):
        text = value
        try:
            value = json.loads(text) if text.lstrip().startswith("[") else None
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list):
            return [{"role": "user", "content": text}]
    turns = [dict(t) for t in value]
    return turns[:-1] if turns and turns[-1].get("role") == "assistant" else turns


def chat_http_contract(card: ModelCard, cfg):
    """What the chat task's `http_contract` returns: the OpenAI-compatible routes."""
    return OpenAIContract(card, cfg.serve.generate)
