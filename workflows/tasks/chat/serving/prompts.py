"""A served chat model's prompts as token ids, and the views of its tokenizer that structured output and
logprobs need.

A conversation is rendered by the model's chat template (tools and tool calls as
workflows.tasks.chat.openai.tools writes them), a text prompt tokenized as it is. Both run in a thread
of their own, never on the event loop (`encode`). A request's grammar compiles in another (`constraints`):
a request without one never waits behind another's compile (llguidance releases the GIL meanwhile). The
grammars of the tokenizer (llguidance's view of the vocabulary takes about a second) are built in that
thread too, by `warm_grammars`, before the first structured request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError

from workflows.tasks.chat.engine import Engine
from workflows.tasks.chat.grammar import GrammarError, Grammars, TokenText
from workflows.tasks.chat.openai.protocol import BadRequest
from workflows.tasks.chat.openai.tools import render, template_reads_tools
from workflows.tasks.chat.vllm_engine.grammar_text import GrammarText

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt this model cannot take, said in the platform's words (an HTTP 400's message)."""


class Prompts:
    """The tokenizer of `model_dir` (loaded on first use) and what is built on it; `engine` gives the
    served engine (its model's vocabulary width and end-of-sequence tokens); `lock` is the predictor's,
    under which each thing loads once."""

    def __init__(self, model_dir: str, model_id: str, system_prompt: str | None, engine: Callable[[], Engine],
                 lock: threading.RLock):
        self.model_dir, self.model_id, self.system_prompt = model_dir, model_id, system_prompt
        self._engine, self._lock = engine, lock
        self._tokenizer: Any = None
        self._grammars: Grammars | None = None
        self._token_text: TokenText | None = None
        self._thread = ThreadPoolExecutor(1, "tokenize")
        self._grammar_thread = ThreadPoolExecutor(1, "grammar")

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            return self._tokenizer

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation rendered by the model's chat template, ending where the assistant answers; with
        `tools` (OpenAI's), and tool calls in the history, as workflows.tasks.chat.openai.tools renders them."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise PromptError("this model has no chat template: use /v1/completions")
        if self.system_prompt and (not messages or messages[0].get("role") != "system"):  # as preprocessing does
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            messages, tools = render(messages, tools, template_reads_tools(template))
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except TemplateError as e:  # the template's own check (e.g. roles out of order)
            raise PromptError(f"messages: {str(e)[:500]}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)

    async def encode(self, fn, arg) -> list[int]:
        """`fn(arg)` (chat_ids, prompt_ids, or a plan built with them) in the tokenizing thread. A
        ValueError of the tokenizer or its template library (whose message may name a file) is answered
        naming the model only."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, arg)
        except (PromptError, BadRequest, GrammarError):
            raise  # the plan's own answers, which name their field
        except ValueError as e:
            log.warning("model %s: the prompt could not be tokenized: %s", self.model_id, e)
            raise PromptError(f"model {self.model_id} could not tokenize this prompt") from None

    # --- what structured output and logprobs need (built on first use, in the tokenizing thread) -----
    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        return int(self._engine().vocab_size)

    @property
    def eos(self) -> set[int]:
        return set(self._engine().eos)

    def grammars(self) -> Grammars:
        """The grammars of this model's tokenizer (workflows.tasks.chat.grammar), built on first use."""
        with self._lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos))
            return self._grammars

    def warm_grammars(self) -> None:
        """Build `grammars()` in the grammar thread now, so the first structured request need not."""
        self._grammar_thread.submit(self.grammars)

    async def constraints(self, grammar: str, param: str, n: int) -> list:
        """n constraints of their own for `grammar` (compiled once, in the grammar thread; GrammarError
        naming `param` if it does not compile). An engine that enforces grammars itself (vLLM's, through
        llguidance too) gets the checked grammar's text."""
        as_text = getattr(self._engine(), "constraints_as_text", False)

        def build():
            grammars = self.grammars()
            compiled = grammars.compiled(grammar, param)  # the 400 naming `param`, whichever engine
            if as_text:
                return [GrammarText.of(grammar)] * n
            return [grammars.fresh(compiled) for _ in range(n)]

        return await asyncio.get_running_loop().run_in_executor(self._grammar_thread, build)

    @property
    def token_text(self) -> TokenText:
        with self._lock:
            if self._token_text is None:
                self._token_text = TokenText(self.tokenizer)
            return self._token_text

    def close(self) -> None:
        self._thread.shutdown(wait=False)
        self._grammar_thread.shutdown(wait=False)
