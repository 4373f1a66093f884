"""The generation bench's client, in a process of its own: `python -m workflows.bench.generate_client`
reads a job (JSON) on stdin, sends its requests to an OpenAI-compatible server with the official `openai`
client (streamed, Server-Sent Events), and prints what each request saw (JSON) on stdout.

The same client drives every server the bench measures (ours behind `workflows serve`, the one-at-a-time
peer, llama.cpp's server, vLLM), so their figures differ by the server alone. Two kinds of load:
- closed loop (`concurrency`): that many clients, each sending its next request once its previous one
  has ended;
- open loop (`rate`, requests/s): requests sent at Poisson arrival times (exponential gaps, seeded),
  whatever is in flight; a rejected request (429, 503) is recorded with the time its answer took.

The job names the models its requests ask for (`models`): request i asks for models[i % len]: one
model, or a base and its adapter in turn (a batch of both).

Per request: when it was sent, when each chunk that carried text arrived (time to first token and the
gaps between tokens, as the client sees them), the completion tokens the server's usage counted, the
finish reason, or the HTTP status and answer time of a refusal. Times are seconds from the job's start.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any


async def one(client, job: dict, messages: list, t0: float, model: str) -> dict:
    import openai

    extra: dict[str, Any] = {**job.get("extra_body", {}), **({"ignore_eos": True} if job.get("ignore_eos") else {})}
    sent = time.perf_counter()
    out: dict[str, Any] = {"sent": sent - t0, "chunks": [], "tokens": 0, "status": 200, "finish_reason": None}
    for attempt in (1, 2):
        try:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=job["max_tokens"], temperature=job["temperature"],
                top_p=job["top_p"], seed=job.get("seed"), stream=True, stream_options={"include_usage": True},
                extra_body=extra)
            async for chunk in stream:
                now = time.perf_counter() - t0
                for choice in chunk.choices:
                    # a token's chunk: content, "" while its text is held back (a special token's, a stop
                    # string's possible start), as vLLM streams it; the opening chunk names the role
                    if choice.delta and choice.delta.content is not None and not choice.delta.role:
                        out["chunks"].append(now)
                    if choice.finish_reason:
                        out["finish_reason"] = choice.finish_reason
                if chunk.usage is not None:
                    out["tokens"], out["prompt_tokens"] = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        except openai.APIStatusError as e:  # refused (429, 503) or failed: how fast the answer came
            out.update(status=e.status_code, error=str(e)[:200])
        except openai.APIError as e:  # the connection itself
            if attempt == 1 and not out["chunks"]:
                # a kept-alive connection the server had closed (llama-server does, at times): sent again
                # on a new one, as any HTTP client's retry would; the time lost stays in this request's
                out["retried"] = str(e)[:200]
                continue
            out.update(status=0, error=str(e)[:200])
        break
    out["ended"] = time.perf_counter() - t0
    return out


async def run(job: dict) -> dict:
    import httpx2
    import openai

    prompts, n, models = job["messages"], job["requests"], job["models"]
    # connections enough for every request in flight: the client must not queue what the server should
    limits = httpx2.Limits(max_connections=max(64, n), max_keepalive_connections=max(64, n))
    client = openai.AsyncOpenAI(base_url=job["base_url"], api_key=job.get("api_key") or "none", max_retries=0,
                                timeout=job.get("timeout_s", 1800),
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    t0 = time.perf_counter()
    results: list[dict] = []
    async with client:
        if job.get("rate"):
            rng = random.Random(job.get("arrival_seed", 0))
            tasks, at = [], 0.0
            for i in range(n):
                at += rng.expovariate(job["rate"])
                delay = at - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                request = one(client, job, prompts[i % len(prompts)], t0, models[i % len(models)])
                tasks.append(asyncio.create_task(request))
            results = list(await asyncio.gather(*tasks))
        else:
            todo = list(range(n))

            async def worker():
                while todo:
                    i = todo.pop(0)
                    results.append(await one(client, job, prompts[i % len(prompts)], t0, models[i % len(models)]))

            await asyncio.gather(*(worker() for _ in range(min(job["concurrency"], n))))
    return {"seconds": time.perf_counter() - t0, "requests": results}


def main() -> None:
    job = json.loads(sys.stdin.read())
    json.dump(asyncio.run(run(job)), sys.stdout)


if __name__ == "__main__":
    main()
