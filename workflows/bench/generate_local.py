"""The generation bench's in-process paths (workflows.bench.generate): the engine called directly by
closed-loop client threads, and static batching (left-padded `generate`), with the figures every path's
run reports (tokens/s, each request's time to first token and gaps between its tokens)."""

from __future__ import annotations

import threading
import time

SAMPLED = {"temperature": 0.7, "top_p": 0.9}
GREEDY = {"temperature": 0.0, "top_p": 1.0}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class StepTimes:
    """The engine's watcher while a run lasts (the one it had still sees every step): the wall time of each
    step that decoded `rows` rows and prefilled nothing, a decode step as the roofline counts it."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows, self.watcher = engine, rows, engine.metrics
        self.seconds: list[float] = []

    def __enter__(self):
        self.engine.metrics = self
        return self

    def __exit__(self, *exc):
        self.engine.metrics = self.watcher

    def step(self, report) -> None:
        if report.decode_tokens == self.rows and not report.prefill_tokens:
            self.seconds.append(report.seconds)
        self.watcher.step(report)

    def rejected(self, reason: str, adapter: str | None = None) -> None:
        self.watcher.rejected(reason, adapter)


def engine_run(engine, prompts: list[list[int]], max_tokens: int, concurrency: int, sampled: bool = False,
               natural: bool = False) -> dict:
    """`concurrency` closed-loop clients on threads of this process, each submitting its next prompt as its
    last one ends; fixed lengths (ignore_eos) unless `natural`. Beside every path's figures, the wall time
    of each decode step with `concurrency` rows and no prompt tokens (`decode_steps_s`)."""
    from workflows.tasks.chat.engine import SamplingParams

    sampling = SAMPLED if sampled else GREEDY
    todo, timed, tokens, lock = list(range(len(prompts))), [], [0], threading.Lock()

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            params = SamplingParams(max_tokens=max_tokens, seed=i if sampled else None, ignore_eos=not natural,
                                    **sampling)
            gen = engine.submit(prompts[i], params)
            gen.result(timeout=3600)
            with lock:
                timed.append((gen.times["submitted"] - t0, [t - t0 for t in gen.token_times]))
                tokens[0] += gen.completion_tokens

    with StepTimes(engine, min(concurrency, len(prompts))) as steps:
        t0 = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(min(concurrency, len(prompts)))]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        seconds = time.perf_counter() - t0
        # a step hands out its tokens before it reports: the engine's next turn comes after the last one's report
        engine.call(lambda: None).result(timeout=600)
    return {**figures(timed, tokens[0], seconds), "decode_steps_s": steps.seconds}


def transformers_step(model, rows: int, context: int, steps: int = 12) -> float:
    """The median wall time of transformers' own decode step on `model` (the forward `generate` runs per
    token with a static cache): `rows` rows, one token each, attending over `context` cached positions
    and more in a `StaticCache`. The engine's decode step of as many rows on the same weights is measured
    against it; the cached values do not change the work (the static cache's attention reads all of its
    length), so the cache is not prefilled."""
    import torch
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=context + steps + 4)
    token = torch.full((rows, 1), 100, dtype=torch.long, device=model.device)
    seconds = []
    with torch.inference_mode():
        for i in range(steps + 3):  # three to warm up
            position = torch.tensor([context + i], device=model.device)
            t0 = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True, cache_position=position,
                  position_ids=position.expand(rows, 1), logits_to_keep=1)
            if i >= 3:
                seconds.append(time.perf_counter() - t0)
    return percentile(seconds, 0.5)


def static_run(model, pad: int, prompts: list[list[int]], max_tokens: int, batch: int, sampled: bool = False,
               eos: set[int] | None = None) -> dict:
    """`batch` prompts at a time, left-padded, all waiting at the start; a batch decodes until its every
    row ended at one of the `eos` ids (natural stopping), or, without `eos`, made max_tokens (fixed)."""
    import torch

    class Steps:  # a timestamp per generated step (the first put is the prompt)
        def __init__(self):
            self.times: list[float] = []
            self.started = False

        def put(self, value):
            if self.started:
                self.times.append(time.perf_counter() - t0)
            self.started = True

        def end(self):
            pass

    sampling = {"do_sample": True, **SAMPLED} if sampled else {"do_sample": False}
    timed, tokens, t0 = [], 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        part = prompts[i:i + batch]
        width = max(len(p) for p in part)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in part], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=model.device)
        steps = Steps()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=0 if eos else max_tokens, use_cache=True, pad_token_id=pad,
                                 streamer=steps, **sampling)
        for seq in out[:, width:].tolist():
            n = next((k + 1 for k, t in enumerate(seq) if t in eos), len(seq)) if eos else len(seq)
            tokens += n
            timed.append((0.0, steps.times[:n]))  # every request was waiting at the start
    return figures(timed, tokens, time.perf_counter() - t0)


def figures(timed: list[tuple[float, list[float]]], tokens: int, seconds: float) -> dict:
    """Per run: tokens/s, and each request's time to first token and gaps between its tokens."""
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "requests_per_s": len(timed) / seconds,
            "ttft": [t[0] - sent for sent, t in timed if t],
            "itl": [b - a for _, t in timed for a, b in zip(t, t[1:])]}
