"""The chat task's predictor and HTTP contract: one `ChatPredictor` for every use of a registered chat
model, each loading what it needs on first use.

- HTTP (workflows.serve.app): `chat_http_contract(card, cfg)` mounts the OpenAI-compatible routes of
  workflows.tasks.chat.openai_api on the replica's app (no /predict); they load the continuous-batching
  `engine` (workflows.tasks.chat.engine) when the app builds them, before the replica reports healthy.
- Batch inference (`workflows predict` on prompts or conversations): `predict_frame` decodes the rows
  through the same engine, greedy, up to serve.generate.max_tokens each.
- Evaluation of processed rows (token loss, greedy answers, the base model's figures): `predict_frame`
  hands them to the training side's scorer (workflows.tasks.chat.predictor.ChatScorer).

The model is loaded by the training side's `load_trained`: a whole model (full fine-tune, merged
adapter, or any from_pretrained directory), or a LoRA adapter on the base its card names (`base:
{name_or_path, sha256}`, checked by sha256), kept unmerged and served as the peft adapter "default".

LoRA adapters: a request whose "model" is another registered version, NAME:VERSION, is answered by the
served base with that adapter. Its version directory holds peft's `adapter_config.json` and
`adapter_model.safetensors` (no pickle is read), and its card's `base.sha256` must be the sha256 of the
served base's weights (the served model's own weights, or, for a served adapter, its card's base). Adapters
load on first use through Ray Serve's model multiplexing (`serve.multiplexed`, at most `max_adapters` per
replica, least recently used unloaded; a client may send the `serve_multiplexed_model_id` header too, so
Serve routes it to a replica that has the adapter), and are deleted from the model only once no request
uses them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from workflows.tasks.base import Predictor, serving_device
from workflows.tasks.chat.engine import Engine, Generation, ModelNotFound, QueueFull
from workflows.tasks.chat.grammar import GrammarError
from workflows.tasks.chat.protocol import BadRequest
from workflows.tasks.chat.sampling import SamplingParams

if TYPE_CHECKING:
    from workflows.model_card import ModelCard

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
SERVED_ADAPTER = "default"  # peft's name for the adapter a served adapter version loads as
log = logging.getLogger(__name__)
# a registered version as a request names it (registry names: workflows.config.check_name)
MODEL_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})(?::v?(\d{1,9}))?$")


class PromptError(ValueError):
    """A prompt this model cannot take, said in the platform's words (an HTTP 400's message)."""


def is_adapter(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, ADAPTER_FILES[0]))


def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX), where serving in bf16 reads
    half the bytes of fp32 at a higher matmul rate; elsewhere oneDNN emulates them."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


class ChatPredictor(Predictor):
    """A registered chat model: its engine (a decode thread; prompts rendered and tokenized in a thread of
    their own, never on the event loop) and the LoRA adapters it holds, or the evaluation's scorer."""

    def __init__(self, task, model_dir: str, card: ModelCard, threads: int | None = None,
                 precision: str | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.task, self.cfg, self.model_dir, self.card, self.threads = task, task.cfg, model_dir, card, threads
        self.gen = self.cfg.serve.generate
        self.precision = precision or self.cfg.serve.precision  # the engine's; the scorer's is fp32
        self.input_columns = ["prompt"]
        self.served_adapter = SERVED_ADAPTER if is_adapter(model_dir) else None  # the engine's adapter for it
        self._engine: Engine | None = None
        self._tokenizer: Any = None
        self._scorer: Any = None
        self._grammars: Any = None
        self._token_text: Any = None
        self._base_sha: str | None = None
        self._tokenize = ThreadPoolExecutor(1, "tokenize")
        self.adapters: dict[str, str] = {}  # model id -> peft adapter name, loaded (or loading)
        self._loaded: set[str] = set()  # peft names whose weights are all in (decode thread only)
        self._using: Counter[str] = Counter()  # model id -> requests using it (event loop only)
        self._retiring: set[str] = set()  # unloaded by Serve, deleted once unused
        self._lock = threading.RLock()
        self._count = 0

    @property
    def base_id(self) -> str:
        return f"{self.card.name}:{self.card.version}"

    # --- what each use loads --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            return self._tokenizer

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine over the model (`load_trained`), loaded on first use."""
        with self._lock:
            if self._engine is None:
                import torch

                from workflows.tasks.chat.model import load_trained

                if self.precision not in ("fp32", "bf16"):
                    raise ValueError(f"serve.precision={self.precision}: a chat model is served in fp32 or bf16")

                # on the replica's GPU when it has one (SDPA attention there: load_causal_lm), in bf16 when
                # serve.precision says so; the engine makes its inputs where the model is
                model = load_trained(self.model_dir, self.card, self.cfg)
                device = serving_device()
                if self.precision == "bf16":
                    model = model.to(torch.bfloat16)
                    if device.type == "cpu" and not native_cpu_bf16():
                        log.warning("serve.precision=bf16 on a CPU without AVX512-BF16 or AMX: its bf16 matmuls "
                                    "are emulated and slower than fp32 (docs/guides/serve.md)")
                model = model.to(device)
                gen = self.gen
                self._engine = Engine(model, self.tokenizer, max_batch=gen.max_batch, max_queue=gen.max_queue,
                                      retry_after_s=gen.retry_after_s, max_prompt_tokens=gen.max_prompt_tokens,
                                      max_context=gen.max_prompt_tokens + gen.max_tokens,
                                      prefill_chunk=gen.prefill_chunk, max_prefill_tokens=gen.max_prefill_tokens,
                                      timeout_s=gen.timeout_s, prepack=gen.prepack_weights)
            return self._engine

    def scorer(self):
        """The training side's scorer (evaluation of processed rows), loaded on first use."""
        with self._lock:
            if self._scorer is None:
                from workflows.tasks.chat.predictor import ChatScorer

                self._scorer = ChatScorer(self.task, self.model_dir, self.card, self.threads,
                                          self.cfg.evaluate.batch_size)
            return self._scorer

    def base_sha256(self) -> str:
        """The sha256 of the served base's weights: a served adapter's card names it; else its own."""
        if self._base_sha is None:
            from workflows.tasks.chat.model import weights_sha256

            base = dict(getattr(self.card, "base", None) or {})
            self._base_sha = str(base.get("sha256") or "") if self.served_adapter else weights_sha256(self.model_dir)
        return self._base_sha

    # --- prompts -------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation rendered by the model's chat template, ending where the assistant answers; with
        `tools` (OpenAI's), and tool calls in the history, as workflows.tasks.chat.tools renders them."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise PromptError("this model has no chat template: use /v1/completions")
        from jinja2 import TemplateError

        from workflows.tasks.chat.tools import render, template_reads_tools

        system = getattr(self.task.options, "system_prompt", None)
        if system and (not messages or messages[0].get("role") != "system"):  # as preprocessing puts it
            messages = [{"role": "system", "content": system}, *messages]
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages, tools = render(messages, tools, template_reads_tools(template))
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except TemplateError as e:  # the template's own check (e.g. roles out of order)
            raise PromptError(f"messages: {str(e)[:500]}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    # --- what structured output and logprobs need (built on first use, in the tokenizing thread) -----
    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (its config's vocab_size)."""
        return int(self.engine.model.config.vocab_size)

    @property
    def eos(self) -> set[int]:
        return set(self.engine.eos)

    def grammars(self):
        """The grammars of this model's tokenizer (workflows.tasks.chat.grammar), built on first use."""
        with self._lock:
            if self._grammars is None:
                from workflows.tasks.chat.grammar import Grammars

                self._grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos))
            return self._grammars

    def warm_grammars(self) -> None:
        """Build `grammars()` in the tokenizing thread now, so the first structured request need not."""
        self._tokenize.submit(self.grammars)

    @property
    def token_text(self):
        with self._lock:
            if self._token_text is None:
                from workflows.tasks.chat.choices import TokenText

                self._token_text = TokenText(self.tokenizer)
            return self._token_text

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    async def encode(self, fn, arg) -> list[int]:
        """`fn(arg)` (chat_ids or prompt_ids) in the tokenizing thread. A ValueError of the tokenizer or
        its template library (whose message may name a file) is answered naming the model only."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, arg)
        except (PromptError, BadRequest, GrammarError):
            raise  # the plan's own answers, which name their field
        except ValueError as e:
            log.warning("model %s: the prompt could not be tokenized: %s", self.base_id, e)
            raise PromptError(f"model {self.base_id} could not tokenize this prompt") from None

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

    def model_id(self, adapter: str | None) -> str:
        """The model id (NAME:VERSION) a request with this peft adapter name asked for: the served one for
        the base (or a served adapter), else the adapter's."""
        if adapter is None or adapter == self.served_adapter:
            return self.base_id
        # a copy in one step (the event loop may add or remove adapters meanwhile; the engine thread asks)
        return next((m for m, name in list(self.adapters.items()) if name == adapter), adapter)

    def check_card(self, model_id: str, card: Any) -> None:
        """Before anything is downloaded: the card of a chat task's adapter export of the served base
        (its base weights' sha256), or ModelNotFound."""
        tasks = {"chat", getattr(self.card, "task", None) or "chat"}  # the served card's: a chat task's subclass
        if getattr(card, "task", None) not in tasks or getattr(card, "export", None) != "adapter":
            raise ModelNotFound(f"model {model_id} is not a LoRA adapter of the chat task (task "
                                f"{getattr(card, 'task', None)!r}, export {getattr(card, 'export', None)!r})")
        self._check_base(model_id, card)

    def check_adapter(self, model_id: str, model_dir: str, card: Any) -> None:
        """A registered version this replica may load as an adapter of its base, or ModelNotFound."""
        missing = [f for f in ADAPTER_FILES if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise ModelNotFound(f"model {model_id} is not a LoRA adapter (no {', '.join(missing)})")
        self._check_base(model_id, card)

    def _check_base(self, model_id: str, card: Any) -> None:
        base = dict(getattr(card, "base", None) or {})
        if not base.get("sha256") or base["sha256"] != self.base_sha256():  # its base's name is a place: unsaid
            raise ModelNotFound(f"model {model_id} is an adapter of another base (weights sha256 "
                                f"{str(base.get('sha256') or '?')[:12]}...), not of the base served by {self.base_id} "
                                f"({self.base_sha256()[:12]}...)")

    def add_adapter(self, model_id: str, model_dir: str):
        """Load an adapter in the decode thread, between steps (a Future of its peft name), through
        `load_adapter` (its config rebuilt from an allow-list, its weights from safetensors only). One
        that fails to load leaves nothing: neither a listed model id nor a half-loaded adapter."""
        with self._lock:
            self._count += 1
            name = self.adapters.setdefault(model_id, f"adapter{self._count}")
        self._retiring.discard(model_id)

        def load():
            from workflows.tasks.chat.model import load_adapter

            if name not in self._loaded:
                try:
                    self.engine.model = load_adapter(self.engine.model, model_dir, name).eval()
                except BaseException:
                    with self._lock:
                        if self.adapters.get(model_id) == name:
                            del self.adapters[model_id]
                    raise
                self._loaded.add(name)
            with self._lock:  # a load of the same id that failed first took it off
                self.adapters[model_id] = name
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
            from workflows.tasks.chat.model import remove_adapter

            model = self.engine.model
            self._loaded.discard(name)
            if name in getattr(model, "peft_config", {}):  # the last adapter of a whole model: unwrapped
                self.engine.model = remove_adapter(model, name, unwrap=self.served_adapter is None)

        self.engine.call(delete)

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
            ids = self.chat_ids(list(inst["messages"])) if "messages" in inst else self.prompt_ids(inst["prompt"])
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
        from workflows.tasks.chat.predictor import PROCESSED

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
        self._tokenize.shutdown(wait=False)


def _conversation(value) -> list[dict]:
    """A row's conversation: a list of {role, content} (or its JSON text, as a processed row's `prompt`),
    a final assistant turn (the reference answer of a labelled row) left out; other text is a user's turn."""
    import json

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
    from workflows.tasks.chat.openai_api import OpenAIContract

    return OpenAIContract(card, cfg.serve.generate)
