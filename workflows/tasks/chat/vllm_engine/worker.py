"""The vLLM side of the vLLM engine: a Ray actor that owns vLLM's `AsyncLLM` (its EngineCore in a process of
its own), takes requests (`submit`) and streams every request's news as plain dicts in one stream (`outputs`).

It runs in the vLLM venv's Python (Ray's runtime_env `py_executable`) and imports nothing of workflows: the
class is shipped by value (cloudpickle), so that venv needs vllm and ray only. vLLM pins transformers,
llguidance and fastapi below the product's (docs/guides/serving.md), hence the venv of its own.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

# vLLM's finish reasons as the engine's (FINISH_REASONS): an abort is the caller's cancel (or its deadline,
# which the replica's side names)
FINISHED = {"stop": "stop", "length": "length", "abort": "cancelled"}


class VllmWorker:
    """One vLLM engine over `model_dir` (a folder vLLM reads: `model_files.vllm_folder`), built from
    `engine_args` (vLLM's AsyncEngineArgs fields) with `env` set first (vLLM reads VLLM_* at import)."""

    def __init__(self, model_dir: str, engine_args: dict[str, Any], env: dict[str, str]):
        os.environ.update(env)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **engine_args))
        self.loras: dict[str, Any] = {}  # name -> LoRARequest
        self._news: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[str, asyncio.Future] = {}

    async def ready(self) -> dict[str, Any]:
        """What the replica needs of the engine once built: its vocabulary and context."""
        import vllm

        config = self.llm.model_config
        return {"vocab_size": int(config.get_vocab_size()), "max_model_len": int(config.max_model_len),
                "version": vllm.__version__}

    async def add_lora(self, name: str, lora_id: int, path: str) -> None:
        """Load a LoRA adapter (a folder the replica has checked and written) under `name`, before a
        request names it: a bad one fails here, not in a batch."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_id, path)
        await self.llm.add_lora(request)
        self.loras[name] = request

    async def remove_lora(self, name: str) -> None:
        request = self.loras.pop(name, None)
        if request is not None:
            await self.llm.remove_lora(request.lora_int_id)

    async def submit(self, request_id: str, prompt: list[int], params: dict[str, Any], adapter: str | None) -> None:
        """Start one request; its news comes through `outputs`. `params`: vLLM SamplingParams' fields, and
        `grammar` (llguidance's Lark text, through vLLM's guidance backend)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        params = dict(params)
        grammar = params.pop("grammar", None)
        sampling = SamplingParams(**params, output_kind=RequestOutputKind.DELTA,
                                  structured_outputs=StructuredOutputsParams(grammar=grammar) if grammar else None)
        lora = self.loras[adapter] if adapter is not None else None
        self._tasks[request_id] = asyncio.ensure_future(self._run(request_id, prompt, sampling, lora))

    async def _run(self, request_id: str, prompt: list[int], sampling, lora) -> None:
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, sampling, request_id, lora_request=lora):
                choice = out.outputs[0]
                self._news.put_nowait((request_id, {
                    "text": choice.text, "token_ids": list(choice.token_ids),
                    "logprobs": _logprobs(choice.logprobs, sampling.logprobs),
                    "finish_reason": FINISHED.get(choice.finish_reason, choice.finish_reason) if out.finished
                    else None}))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # that request's alone: vLLM refused it (a grammar its backend cannot read, ...)
            cause = e.__cause__ or e
            self._news.put_nowait((request_id, {"error": f"{type(cause).__name__}: {str(cause)[:500]}"}))
        finally:
            self._tasks.pop(request_id, None)

    async def outputs(self):
        """Every request's news as it comes, in batches: [(request_id, {"text", "token_ids", "logprobs",
        "finish_reason"} or {"error"})], what has come since the last batch (one Ray object per engine step
        for all requests, not one per request)."""
        while True:
            batch = [await self._news.get()]
            while not self._news.empty():
                batch.append(self._news.get_nowait())
            yield batch

    async def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        self.llm.shutdown()


def _logprobs(positions, top: int | None) -> list | None:
    """vLLM's log probabilities of the new tokens (a dict per position: the sampled token and the `top` most
    probable, each with its rank) as [(token, logprob, [(token, logprob), ...] most probable first)]."""
    if positions is None or top is None:
        return None
    out = []
    for position in positions:
        ranked = sorted(((lp.rank or 0, token, lp.logprob) for token, lp in position.items()))
        chosen = next(iter(position))  # vLLM puts the sampled token first
        out.append((chosen, float(position[chosen].logprob),
                    [(token, float(lp)) for rank, token, lp in ranked if 1 <= rank <= top]))
    return out
