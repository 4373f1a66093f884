"""Request bodies: what reading one costs a chat replica's event loop, whatever a client puts in it.

Each body (up to the 1 MiB the chat routes read) goes through the routes' own `read_json` (parse and
validate, lists bounded before their items: workflows.tasks.chat.openai), in this process, the bodies
interleaved and repeated; the event loop does nothing else meanwhile, so the time is how long every
stream of the replica waits. Beside them, in the same run, the cheapest body of that size (one message of
plain text): the ratio says what a body's shape costs. The goal: no body holds the loop longer than the
inter-token gap a stream sees anyway (the generate bench's latest p50 at one stream, SmolLM2-135M on
these cores).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

REPEATS = 7
FIGURES = ("worst_ms_p50", "worst_vs_stream_gap")
SIZE = 1 << 20
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
GENERATE_RESULTS = Path("benchmarks/results/generate.json")


def bodies() -> dict[str, tuple[str, dict]]:
    """name -> (route kind, body): the plain baseline, then the shapes that cost the most per byte."""
    one_tool = [{"type": "function", "function": {"name": "f"}}]
    return {
        "one message of plain text (baseline)": ("chat", {**BASE, "messages": [
            {"role": "user", "content": "x" * (SIZE - 200)}]}),
        "20,000 allowed tools (refused: over 128)": ("chat", {**BASE, "tools": one_tool, "tool_choice": {
            "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": one_tool * 20000}}}),
        "15,000 invalid messages (refused: over 2,048)": ("chat", {**BASE, "messages": [{"role": "user"}] * 15000}),
        "2,000 messages of 500 characters": ("chat", {**BASE, "messages": [
            {"role": "user", "content": "x" * 500}] * 2000}),
        "128 tools of 200 parameters each": ("chat", {**BASE, "tools": [{"type": "function", "function": {
            "name": f"f{i}", "parameters": {"type": "object", "properties": {
                f"p{j}": {"type": "string"} for j in range(200)}}}} for i in range(128)]}),
        "a schema of 1 MiB of nested arrays": ("chat", {**BASE, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "a", "schema": {
                                                             "a": [[1, [2], {"b": [3]}]] * 38000}}}}),
        "200,000 token ids": ("text", {"model": "m", "prompt": [1] * 200000}),
        "100,000 stop strings (refused: over 4)": ("chat", {**BASE, "stop": ["a"] * 100000}),
    }


class _Body:
    """What read_json reads of a request: its headers and its body in chunks."""

    def __init__(self, data: bytes):
        self.data, self.headers = data, {"content-length": str(len(data))}

    async def stream(self):
        for i in range(0, len(self.data), 65536):
            yield self.data[i:i + 65536]


def _read_seconds(kind: str, data: bytes) -> float:
    from workflows.tasks.chat.openai.protocol import BadRequest, ChatRequest, CompletionRequest
    from workflows.tasks.chat.openai.routes import read_json

    model = ChatRequest if kind == "chat" else CompletionRequest

    async def read():
        t0 = time.perf_counter()
        try:
            await read_json(_Body(data), model, limit=2 * SIZE)
        except BadRequest:
            pass
        return time.perf_counter() - t0

    return asyncio.run(read())


def run(config: str | None, overrides: list[str]) -> dict:
    import torch  # noqa: F401 (the replica's heap: the garbage collector's work grows with it)
    import transformers  # noqa: F401

    encoded = {name: (kind, json.dumps(body).encode()) for name, (kind, body) in bodies().items()}
    seconds: dict[str, list[float]] = {name: [] for name in encoded}
    for _ in range(REPEATS):  # interleaved: every body sees the same machine
        for name, (kind, data) in encoded.items():
            seconds[name].append(_read_seconds(kind, data))
    baseline = statistics.median(seconds[next(iter(seconds))])
    rows = [{"body": name, "mib": round(len(data) / 2**20, 2),
             "ms_p50": round(1e3 * statistics.median(seconds[name]), 1), "ms_max": round(1e3 * max(seconds[name]), 1),
             "vs_plain": round(statistics.median(seconds[name]) / baseline, 1)} for name, (_, data) in encoded.items()]
    gap = _stream_gap_ms()
    worst = max(round(1e3 * statistics.median(v), 1) for v in seconds.values())
    return {"rows": rows, "worst_ms_p50": worst, "stream_gap_ms": gap, "repeats": REPEATS,
            "worst_vs_stream_gap": round(worst / gap, 2) if gap else None}


def _stream_gap_ms() -> float | None:
    """The generate bench's latest inter-token p50 at one stream over HTTP (ms), if it has run here."""
    if not GENERATE_RESULTS.exists():
        return None
    rows = json.loads(GENERATE_RESULTS.read_text()).get("rows", [])
    return next((round(1e3 * r["itl_s_p50"], 1) for r in rows if r.get("row") == "http_c1"), None)


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    rows = "\n".join(f"| {x['body']} | {x['mib']:.2f} | {x['ms_p50']:.1f} | {x['ms_max']:.1f} | {x['vs_plain']:.1f}x |"
                     for x in r["rows"])
    gap, ratio = r["stream_gap_ms"], r["worst_vs_stream_gap"]
    verdict = "not measured (no generate results)" if ratio is None else \
        f"{ratio:.2f}x the gap ({'met' if ratio <= 1 else 'not met'})"
    return f"""## Request bodies: what reading one costs a chat replica's event loop

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

Each body through the chat routes' own `read_json` (parse, then validate with every list bounded before
its items), in one process holding torch and transformers as a replica does; {r["repeats"]} rounds, the
bodies interleaved; milliseconds the event loop is held, so every stream of the replica waits that long.

| body | MiB | ms (median) | ms (max) | vs plain text |
| --- | --- | --- | --- | --- |
{rows}

Worst median {r["worst_ms_p50"]:.1f} ms against a stream's inter-token gap of {gap} ms (the generate bench's
p50 at one stream): goal <= 1x the gap, {verdict}.
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("request-bodies")
