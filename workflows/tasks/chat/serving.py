"""Serving a chat model: what the chat task's `predictor` and `http_contract` return.

`chat_predictor(model_dir, card, cfg)` loads a registered causal LM (safetensors weights, its tokenizer
and chat template) into a continuous-batching `Engine` (workflows.tasks.chat.engine);
`chat_http_contract(card, cfg)` is its HTTP contract: the OpenAI-compatible routes of
workflows.tasks.chat.openai_api, mounted on the replica's app, and no /predict. Both read `serve.generate`
(workflows.config.serve.GenerateConfig: max_tokens cap, batch, queue, adapters).

LoRA adapters: a request whose "model" is another registered version, NAME:VERSION, is answered by the
served base with that adapter. Its version directory holds peft's `adapter_config.json` and
`adapter_model.safetensors` (no pickle is read), and its card names the base it was trained on,
`"base_model": "<base name>:<base version>"`, which must be the served one. Adapters load on first use
through Ray Serve's model multiplexing (`serve.multiplexed`, at most `max_adapters` per replica, least
recently used unloaded; a client may send the `serve_multiplexed_model_id` header too, so Serve routes it
to a replica that has the adapter), and are deleted from the model only once no request uses them.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from workflows.tasks.base import Predictor
from workflows.tasks.chat.engine import Engine, Generation, ModelNotFound

if TYPE_CHECKING:
    from workflows.config import WorkflowConfig
    from workflows.config.serve import GenerateConfig
    from workflows.model_card import ModelCard

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# a registered version as a request names it (registry names: workflows.config.check_name)
MODEL_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?::v?(\d{1,9}))?$")


def load_causal_lm(model_dir: str, precision: str = "fp32", threads: int | None = None):
    """(model, tokenizer) of a registered causal LM: safetensors weights only, no remote code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if precision not in dtypes:
        raise ValueError(f"serve.precision={precision}: a chat model is served in fp32 or bf16")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtypes[precision], use_safetensors=True)
    return model.eval(), tokenizer


class ChatPredictor(Predictor):
    """A registered causal LM in a decode thread (`engine`), its prompts rendered and tokenized in a
    thread of their own (never on the event loop), and the LoRA adapters it holds."""

    def __init__(self, model_dir: str, card: ModelCard, gen: GenerateConfig, threads: int | None = None,
                 precision: str = "fp32"):
        model, self.tokenizer = load_causal_lm(model_dir, precision, threads)
        self.card, self.gen, self.input_columns = card, gen, ["prompt"]
        self.engine = Engine(model, self.tokenizer, max_batch=gen.max_batch, max_queue=gen.max_queue,
                             retry_after_s=gen.retry_after_s)
        self._tokenize = ThreadPoolExecutor(1, "tokenize")
        self.adapters: dict[str, str] = {}  # model id -> peft adapter name, loaded (or loading)
        self._using: Counter[str] = Counter()  # model id -> requests using it (event loop only)
        self._retiring: set[str] = set()  # unloaded by Serve, deleted once unused
        self._lock = threading.Lock()
        self._count = 0

    @property
    def base_id(self) -> str:
        return f"{self.card.name}:{self.card.version}"

    # --- prompts -------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict]) -> list[int]:
        """A conversation rendered by the model's chat template, ending where the assistant answers."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use /v1/completions")
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except TemplateError as e:  # the template's own check (e.g. roles out of order)
            raise ValueError(f"messages: {e}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    async def encode(self, fn, arg) -> list[int]:
        """`fn(arg)` (chat_ids or prompt_ids) in the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, arg)

    # --- adapters ------------------------------------------------------------------------------------
    def resolve(self, model: str) -> str | None:
        """None for the served base model (its name, or NAME:VERSION), else the adapter's model id
        NAME:VERSION; ModelNotFound for what cannot name a registered version."""
        m = MODEL_ID.match(model)
        if not m:
            raise ModelNotFound(f"model {model[:80]!r} is not a registered model NAME:VERSION")
        name, version = m.group(1), m.group(2)
        if name == self.card.name and (version is None or int(version) == self.card.version):
            return None
        if version is None:
            raise ModelNotFound(f"model {name!r}: name an adapter with its version, {name}:VERSION")
        return f"{name}:{int(version)}"

    def check_adapter(self, model_id: str, model_dir: str, card: Any) -> None:
        """A registered version this replica may load as an adapter of its base, or ModelNotFound."""
        missing = [f for f in ADAPTER_FILES if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelNotFound(f"model {model_id} is not a LoRA adapter (no {', '.join(missing)})")
        base = getattr(card, "base_model", None)
        if base != self.base_id:
            raise ModelNotFound(f"model {model_id} is an adapter of {base or 'an unnamed base'}, not of the "
                                f"served {self.base_id}")

    def add_adapter(self, model_id: str, model_dir: str):
        """Load an adapter in the decode thread, between steps (a Future of its peft name)."""
        with self._lock:
            self._count += 1
            name = self.adapters.setdefault(model_id, f"adapter{self._count}")
        self._retiring.discard(model_id)

        def load():
            from peft import PeftModel

            model = self.engine.model
            if name in getattr(model, "peft_config", {}):
                return name
            if isinstance(model, PeftModel):
                model.load_adapter(model_dir, adapter_name=name, is_trainable=False, use_safetensors=True)
            else:
                self.engine.model = PeftModel.from_pretrained(model, model_dir, adapter_name=name,
                                                              is_trainable=False, use_safetensors=True)
            self.engine.model.eval()
            return name

        return self.engine.call(load)

    def using(self, model_id: str | None, delta: int) -> None:
        """A request starts (+1) or stops (-1) using an adapter; on the event loop."""
        if model_id is None:
            return
        self._using[model_id] += delta
        if self._using[model_id] <= 0:
            del self._using[model_id]
            if model_id in self._retiring:
                self._delete(model_id)

    def retire(self, model_id: str) -> None:
        """Serve unloaded the adapter (on the event loop): delete it now, or when its last request ends."""
        if model_id not in self.adapters:
            return
        if self._using[model_id] > 0:
            self._retiring.add(model_id)
        else:
            self._delete(model_id)

    def _delete(self, model_id: str) -> None:
        self._retiring.discard(model_id)
        with self._lock:
            name = self.adapters.pop(model_id, None)

        def delete():
            model = self.engine.model
            if name in getattr(model, "peft_config", {}):
                model.delete_adapter(name)

        self.engine.call(delete)

    # --- batch work -----------------------------------------------------------------------------------
    def predict(self, instances) -> list[dict]:
        """Greedy answers for instances {"prompt": text} or {"messages": [{"role", "content"}]}, up to
        serve.generate.max_tokens each, decoded together by the engine (blocking; no event loop):
        [{"text", "finish_reason", "completion_tokens"}]."""
        from workflows.tasks.chat.engine import QueueFull
        from workflows.tasks.chat.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.gen.max_tokens, temperature=0)
        order: list[Generation] = []
        in_flight: list[Generation] = []
        texts: dict[int, str] = {}
        for inst in instances:
            ids = self.chat_ids(list(inst["messages"])) if "messages" in inst else self.prompt_ids(inst["prompt"])
            while True:
                try:
                    gen = self.engine.submit(ids, params)
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
        """`predict` over a pandas batch's `prompt` (or `messages`) column; adds `prediction` (the text)."""
        column = "messages" if "messages" in batch and "prompt" not in batch else "prompt"
        answers = self.predict([{column: v} for v in batch[column]])
        batch["prediction"] = [a["text"] for a in answers]
        batch["finish_reason"] = [a["finish_reason"] for a in answers]
        return batch

    def close(self) -> None:
        self.engine.close()
        self._tokenize.shutdown(wait=False)


def chat_predictor(model_dir: str, card: ModelCard, cfg: WorkflowConfig, threads: int | None = None,
                   precision: str | None = None) -> ChatPredictor:
    """What the chat task's `predictor(model_dir, card, threads, precision)` returns (precision: the
    caller's, else serve.precision; fp32 or bf16)."""
    return ChatPredictor(model_dir, card, cfg.serve.generate, threads=threads,
                         precision=precision or cfg.serve.precision)


def chat_http_contract(card: ModelCard, cfg: WorkflowConfig):
    """What the chat task's `http_contract` returns: the OpenAI-compatible routes."""
    from workflows.tasks.chat.openai_api import OpenAIContract

    return OpenAIContract(card, cfg.serve.generate)
