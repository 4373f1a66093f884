"""The engine's decode steps with and without the building thread's OpenMP pool released
(workflows.tasks.chat.engine.threads): SmolLM2-135M fp32 loaded in the main thread as a replica loads
it, the engine built there and its steps run in its own thread, decoding 1 and then 16 rows (48 tokens
each, eos ignored); the median token gap past the first 8 tokens. libgomp's pools are per process, so
each measurement is a process of its own (`--child released|kept`), the two kinds alternated, REPEATS
of each.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

REPEATS = 2
FIGURES = ("released_over_kept_c1", "released_over_kept_c16")
ROWS = (1, 16)


def child(kind: str) -> None:
    """One process: load, build the engine (its release skipped for `kept`), decode; JSON to stdout."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import workflows.tasks.chat.engine.loop as loop
    from workflows.config import load_config
    from workflows.tasks.chat.engine import Engine, SamplingParams
    from workflows.tasks.chat.training.smollm2 import smollm2_dir

    if kind == "kept":
        loop.release_openmp_pool = lambda: False  # type: ignore[assignment]  # the engine before the release
    base = smollm2_dir(load_config("chat", []).cache.resolved_dir(), say=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    engine = Engine(model, tokenizer, max_batch=max(ROWS), max_context=1024)
    ids = tokenizer("Tell me about the history of the printing press in Europe.")["input_ids"]
    gaps_ms = {}
    try:
        for rows in ROWS:
            gens = [engine.submit(ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), deadline=False)
                    for _ in range(rows)]
            for g in gens:
                g.result(600)
            gaps = [b - a for g in gens for a, b in zip(g.token_times[8:], g.token_times[9:])]
            gaps_ms[rows] = round(1e3 * statistics.median(gaps), 1)
    finally:
        engine.close()
    print(json.dumps({"kind": kind, "gap_ms": gaps_ms, "threads": torch.get_num_threads()}))


def run(config: str | None, overrides: list[str]) -> dict:
    runs: dict[str, list[dict]] = {"kept": [], "released": []}
    for _ in range(REPEATS):  # alternated: both kinds see the same machine
        for kind in ("kept", "released"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.openmp_pool", "--child", kind],
                                 capture_output=True, text=True, timeout=1200, check=True)
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    median = {kind: {rows: statistics.median(r["gap_ms"][str(rows)] for r in rs) for rows in ROWS}
              for kind, rs in runs.items()}
    return {"runs": runs, "repeats": REPEATS, "gap_ms_p50": median, "threads": runs["kept"][0]["threads"],
            **{f"released_over_kept_c{rows}": round(median["kept"][rows] / median["released"][rows], 2)
               for rows in ROWS}}


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    m = r["gap_ms_p50"]
    rows = "\n".join(f"| {rows} | {m['kept'][str(rows)]:.1f} | {m['released'][str(rows)]:.1f} | "
                     f"{r[f'released_over_kept_c{rows}']:.2f}x |" for rows in ROWS)
    each = "; ".join(f"{kind}: " + ", ".join(str(x["gap_ms"]) for x in rs) for kind, rs in r["runs"].items())
    return f"""## The engine's thread and OpenMP: decode steps with the building thread's pool released

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

SmolLM2-135M fp32, loaded in the main thread as a replica loads it; the engine built there, its steps in
its own thread ({r["threads"]} OpenMP threads). "kept": the main thread's OpenMP pool left alive (libgomp
then holds more threads than cores and throttles every idle worker's spin); "released": the engine
releases it where it is built (`engine/threads.py`). Median gap between a stream's tokens, past its first
8; each run a process of its own, the kinds alternated, the medians of {r["repeats"]} runs.

| rows decoding | kept (ms) | released (ms) | tokens/s, released over kept |
| --- | --- | --- | --- |
{rows}

Each run's medians (ms by rows): {each}.
"""


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        from benchmarks.record import main

        main("openmp-pool")
