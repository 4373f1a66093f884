"""Generation: the chat model served by `workflows serve`, measured over HTTP as clients reach it, beside
the engine called directly, static batching and a one-at-a-time peer.

    workflows bench generate --config chat                  # the chat config's base model (SmolLM2-135M)
    workflows bench generate --config chat --set model=chat # a registered chat model, from the config's store
    workflows bench generate --config chat --set requests=64 --set max_tokens=128 --set repeats=3

What runs where (each a process of its own but the in-process paths):
- `http`: `workflows serve` (workflows.bench.generate_servers) on the served model, reached by the official
  `openai` client, streamed (SSE), from a client process (workflows.bench.generate_client). Without
  `--set model=...` the config's base model is registered as `bench-base` in a scratch store and served.
- `engine`: the same model's continuous-batching engine built as a replica builds it (the chat task's
  predictor), called in this process with no HTTP;
- `static`: left-padded `generate` of `static_batch` prompts at a time, all waiting at the start, in this
  process on the served model as transformers loads it (a copy of its own); `static_packed`, fixed
  lengths, on the engine's model itself, its fp32 linears packed for oneDNN as the engine computes them
  (workflows.tasks.chat.engine.linear; a row only where the engine packed them);
- `peer`: plain `generate` behind a minimal OpenAI-compatible server (workflows.bench.generate_peer), one
  request at a time, reached by the same client;
- the project's harness (benchmarks/generate.py) adds llama.cpp's server and vLLM the same way (`peers`).

With `lora=1` (the default) on the config's base model, a LoRA adapter of it is registered beside it
(workflows.bench.generate_models) and two `http` rows name it: every request (`http_lora_c16`), and the
adapter and the base in turn, one batch holding both (`http_mixed_c16`).

A row is a path and its settings (workflows.bench.generate.Row): closed-loop concurrency (each client sends
its next request when its previous one ended) or Poisson arrivals at a rate; greedy or sampled
(temperature 0.7, top_p 0.9); fixed lengths (`ignore_eos`: every request makes max_tokens tokens) or
natural stopping (EOS honoured, up to max_tokens). Rows run interleaved (each row once, then again)
`repeats` times, after a warm-up that is not counted (`warm_ups`: each path, and on it each model its
requests name, structured output and the engine's own weights). No row runs beside another server: the
peers sit paused (SIGSTOP) outside their rows, and `workflows serve`, which cannot be paused, is started
for each repeat's HTTP rows (and their warm-ups) and stopped before the rest (each row's `servers_beside`
says what ran beside it). Every second repeat mirrors the order: the other rows first, in reverse, then the
HTTP rows (`order` in the result), so that every row's mean time in the run is about its middle and a slow
drift of the machine's speed does not tilt a ratio of rows run minutes apart. The Poisson rates come from the
capacity measured in the same repeat (requests/s over HTTP at the top concurrency): `load` times it near
capacity, `overload` times it for the overload row (`overload_requests` of them, by default 3x the engine's batch plus
queue, so that some are refused: how fast their answer came).

Figures per row: output tokens/s (the median over repeats; tokens as the server's usage counts them),
time to first token and inter-token latency (p50/p99 over every request of every repeat: as the client
sees the streamed chunks, or as the engine samples the tokens for in-process paths). The roofline of a
decode step at the top concurrency (workflows.bench.roofline) uses the matmul rate and the memory
bandwidth measured between the rows of every repeat (the best of those readings); beside it, transformers'
own decode step of as many rows on the engine's weights (a `StaticCache` forward, as `generate` runs it),
timed there too, in the engine's decode thread, is what the same kernels do without the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflows.bench.generate_local import GREEDY, SAMPLED, engine_run, figures, static_run, transformers_step
from workflows.bench.generate_models import Served, served_model
from workflows.bench.generate_report import mean_context, report
from workflows.bench.generate_servers import Server, peer_command, serve_command
from workflows.bench.roofline import matmul_floor, matmul_rate, memory_bandwidth

DEFAULTS: dict[str, Any] = {"requests": 32, "serial_requests": 8, "max_tokens": 64, "repeats": 2, "static_batch": 16,
                            "concurrency": "1,8,16,32", "threads": 0, "paths": "http,engine,static,peer", "model": "",
                            "load": "0.9", "overload": "4", "overload_requests": 0, "lora": 1}
PATHS = ("http", "engine", "static", "peer")
TEXT_SETTINGS = ("model", "paths", "concurrency")
FLOAT_SETTINGS = ("load", "overload")


@dataclass
class Row:
    """One measured configuration: a path (how the tokens are reached) and its settings."""

    key: str
    path: str  # http | engine | static | peer | a peer of the harness (llama_cpp, vllm)
    label: str  # the path in words, for the doc
    concurrency: int = 1  # closed loop (static: the batch)
    rate: float | None = None  # Poisson arrivals, as a multiple of the measured capacity (open loop)
    sampled: bool = False
    natural: bool = False  # EOS honoured (else ignore_eos: fixed lengths)
    structured: bool = False  # response_format json_schema (STRUCTURED), against the same row unconstrained
    requests: int = 0  # 0: the bench's `requests`
    engine_weights: bool = False  # static batching on the engine's model (its packed linears), not a plain copy
    models: str = "base"  # what its requests name: the base | adapter (a LoRA adapter of it) | mixed (in turn)
    runs: list[dict] = field(default_factory=list)

    def settings(self) -> dict:
        return {"concurrency": self.concurrency, "arrivals": f"poisson x{self.rate} capacity" if self.rate else
                "closed loop", "sampling": "temperature 0.7, top_p 0.9" if self.sampled else "greedy",
                "lengths": "natural (eos honoured)" if self.natural else "fixed (eos ignored)",
                "output": "json_schema" if self.structured else "unconstrained", "models": self.models}


@dataclass
class HttpPeer:
    """A server of the harness reached over HTTP like ours: what starts it and how it is described."""

    name: str  # row key prefix: llama_cpp, vllm
    label: str
    start: Callable[[Path, Served], Server]  # (log directory, what ours serves) -> its server, not started
    model: str = "peer"  # the "model" its requests name
    levels: tuple[int, ...] = (1, 16)
    extra: dict = field(default_factory=dict)  # fields its requests add (e.g. llama.cpp's cache_prompt)


def structured(max_tokens: int) -> dict:
    """The structured rows' response_format: a strict schema no answer can close before max_tokens tokens
    (at least that many array items), so the row makes as many tokens as its unconstrained twin and the
    two differ by the grammar's cost alone."""
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"},
                                                          "minItems": max_tokens}},
              "required": ["words"], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "words", "strict": True, "schema": schema}}


def settings(overrides: list[str]) -> tuple[dict, list[str]]:
    """(the bench's settings, the config overrides): a key with no dot is the bench's."""
    from workflows.errors import UserError

    out, rest = dict(DEFAULTS), []
    for item in overrides:
        key, _, value = item.partition("=")
        if "." in key:
            rest.append(item)
        elif key not in DEFAULTS:
            raise UserError(f"bench generate: unknown setting {key!r}; use {', '.join(DEFAULTS)} or a config key")
        elif key == "concurrency":
            if not all(v.isdigit() and int(v) > 0 for v in value.split(",")):
                raise UserError(f"bench generate: concurrency is a list such as 1,8,16,32, got {value!r}")
            out[key] = value
        elif key == "paths":
            unknown = sorted(set(value.split(",")) - set(PATHS))
            if unknown:
                raise UserError(f"bench generate: paths are a list of {', '.join(PATHS)}, got {', '.join(unknown)}")
            out[key] = value
        elif key in TEXT_SETTINGS:
            out[key] = value
        elif key in FLOAT_SETTINGS:
            try:
                if float(value) < 0:
                    raise ValueError
            except ValueError:
                raise UserError(f"bench generate: {key} is a number >= 0, got {value!r}") from None
            out[key] = value
        elif not value.isdigit() or (int(value) == 0 and key not in ("threads", "overload_requests", "lora")):
            raise UserError(f"bench generate: {key} must be a positive integer, got {value!r}")
        else:
            out[key] = int(value)
    return out, rest


def has_adapter(opts: dict) -> bool:
    """Whether the run registers an adapter of its own for the adapter rows: `lora` on, over HTTP, on the
    config's base model (a registered `model` may be an adapter itself)."""
    return bool(opts["lora"]) and "http" in str(opts["paths"]).split(",") and not opts["model"]


def questions(n: int) -> list[list[dict]]:
    """n conversations of one user turn: the questions of the chat config's synthetic instruction set."""
    from workflows.preprocess import chat_data

    rows = chat_data.build(max(1, -(-n // len(chat_data.KINDS))))[:n]
    return [[{"role": "user", "content": r["messages"][0]["content"]}] for r in rows]


# --- how each path is driven: a run's result is {tokens, seconds, ttft, itl, rejected...} ----------------
def client_run(url: str, models: list[str], messages: list[list[dict]], row: Row, max_tokens: int, rate: float | None,
               api_key: str | None = None, extra: dict | None = None) -> dict:
    """The row's requests from a client process (workflows.bench.generate_client)."""
    job = {"base_url": url, "models": models, "api_key": api_key, "messages": messages, "requests": len(messages),
           "extra_body": {**(extra or {}), **({"response_format": structured(max_tokens)} if row.structured else {})},
           "max_tokens": max_tokens, "ignore_eos": not row.natural, "concurrency": row.concurrency, "rate": rate,
           "seed": 0 if row.sampled else None, **(SAMPLED if row.sampled else GREEDY)}
    done = subprocess.run([sys.executable, "-m", "workflows.bench.generate_client"], input=json.dumps(job),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the bench's client failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    answered = [r for r in out["requests"] if r["status"] == 200]
    refused = [r for r in out["requests"] if r["status"] != 200]
    if refused and not rate:  # a closed loop sends no more than the server takes: a refusal is a failure
        raise RuntimeError(f"bench generate: {len(refused)} of {len(out['requests'])} requests to {url} failed, "
                           f"e.g. {refused[0].get('error')}")
    timed = [(r["sent"], r["chunks"]) for r in answered]
    result = figures(timed, sum(r["tokens"] for r in answered), out["seconds"])
    result["prompt_tokens"] = [r.get("prompt_tokens", 0) for r in answered]
    result["finish"] = [r["finish_reason"] for r in answered]
    result["refused"] = [{"status": r["status"], "sent_s": r["sent"], "answer_s": r["ended"] - r["sent"]}
                         for r in refused]
    return result


def plan(levels: list[int], paths: set[str], peers: list[HttpPeer], opts: dict, packed: bool = False) -> list[Row]:
    """The rows of one repeat, in the order they run."""
    mid = 16 if 16 in levels else max(levels)
    top = max(levels)
    rows: list[Row] = []
    if "http" in paths:
        rows += [Row(f"http_c{c}", "http", "ours: workflows serve, HTTP + SSE", c) for c in levels]
        rows += [Row(f"http_sampled_c{mid}", "http", "ours: workflows serve, HTTP + SSE", mid, sampled=True),
                 Row(f"http_natural_c{mid}", "http", "ours: workflows serve, HTTP + SSE", mid, natural=True)]
        rows += [Row(f"http_json_c{c}", "http", "ours: workflows serve, HTTP + SSE, json_schema", c, structured=True)
                 for c in sorted({1, mid})]
        if has_adapter(opts):  # a LoRA adapter of the served base: its requests alone, and in turn with the base's
            rows += [Row(f"http_lora_c{mid}", "http", "ours: workflows serve, HTTP + SSE, a LoRA adapter", mid,
                         models="adapter"),
                     Row(f"http_mixed_c{mid}", "http", "ours: workflows serve, HTTP + SSE, the adapter and the base "
                         "in turn", mid, models="mixed")]
        if float(opts["load"]):
            rows.append(Row("http_poisson", "http", "ours: workflows serve, HTTP + SSE", top, rate=float(opts["load"])))
        if float(opts["overload"]):
            rows.append(Row("http_overload", "http", "ours: workflows serve, HTTP + SSE", top,
                            rate=float(opts["overload"]), requests=opts["overload_requests"]))
    if "engine" in paths:
        rows += [Row(f"engine_c{c}", "engine", "ours: the engine called directly, no HTTP", c)
                 for c in sorted({mid, top})]
    if "static" in paths:
        label = f"static batching: left-padded generate, {opts['static_batch']} at a time"
        rows += [Row("static", "static", label, opts["static_batch"]),
                 Row("static_natural", "static", label, opts["static_batch"], natural=True)]
        if packed:  # the engine computes with packed linears: static batching on them too, beside the plain
            rows.append(Row("static_packed", "static", f"{label}, on the engine's packed fp32 weights",
                            opts["static_batch"], engine_weights=True))
    if "peer" in paths:
        rows.append(Row("peer", "peer", "peer: generate behind FastAPI, HTTP + SSE, one request at a time", 1))
    for p in peers:
        rows += [Row(f"{p.name}_c{c}", p.name, p.label, c) for c in p.levels]
    return rows


def warm_ups(rows: list[Row]) -> list[Row]:
    """The first row of each kind whose first requests load what later ones find loaded: each path, and on
    it each model its requests name (a LoRA adapter is loaded by the first request naming it), structured
    output, the engine's own weights. The first repeat's rows then measure what every later one does."""
    first: dict[tuple, Row] = {}
    for r in rows:
        if not r.rate:
            first.setdefault((r.path, r.models, r.structured, r.engine_weights), r)
    return list(first.values())


def on_engine_thread(engine, fn: Callable[[], Any]) -> Any:
    """`fn()` where the in-process engine's steps run, between them (or here without one): the bench's
    every computation in one thread, so the process holds one OpenMP pool. A second pool, this thread's,
    throttles the other's idle workers (workflows.tasks.chat.engine.threads): every step of the engine's
    rows and of static batching beside it would wait on its workers waking."""
    return engine.call(fn).result() if engine is not None else fn()


def run(config: str | None, overrides: list[str], peers: list[HttpPeer] | None = None) -> dict:
    import torch

    from workflows.config import load_config
    from workflows.errors import UserError
    from workflows.net import free_port
    from workflows.tasks import task_for_card
    from workflows.tasks.chat.training.model import load_trained, pad_id

    opts, config_overrides = settings(overrides)
    if threading.current_thread() is threading.main_thread():  # SIGTERM: stop the servers and clean up, as Ctrl-C
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    config = config or "chat"
    cfg = load_config(config, config_overrides)
    threads = opts["threads"] or os.cpu_count() or 1
    torch.set_num_threads(threads)
    levels = [int(c) for c in str(opts["concurrency"]).split(",")]
    paths, peers = set(str(opts["paths"]).split(",")), list(peers or [])
    gen = cfg.serve.generate
    # the overload row must outrun what the server admits (the engine's batch and queue): at 4x capacity
    # about three quarters of its requests are in flight when the last arrives, so 3x that is refused in part
    opts["overload_requests"] = opts["overload_requests"] or 3 * (gen.max_batch + gen.max_queue)
    max_tokens = opts["max_tokens"]
    scratch = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    logs = Path(cfg.cache.resolved_dir()) / "bench-generate"
    model_dir = None
    try:
        served = served_model(cfg, config, config_overrides, opts, scratch, adapter=has_adapter(opts))
        spec, store, model_dir, card = served.spec, served.store, served.model_dir, served.card
        task = task_for_card(cfg, card)
        predictor: Any = task.serving.predictor(model_dir, card, threads=threads, precision=cfg.serve.precision)
        in_process = bool({"engine", "static"} & paths)  # the builtin engine's own rows
        if in_process and gen.engine != "builtin":
            raise UserError(f"bench generate: paths engine and static measure the builtin engine; with "
                            f"serve.generate.engine={gen.engine}, paths=http")
        engine = predictor.engine if in_process else None  # built as the replica builds it
        model = engine.model if engine is not None else load_trained(model_dir, card, cfg)  # its size, its dtype
        tok = predictor.prompts.tokenizer
        # static batching runs on the model as transformers loads it, in the served precision: the
        # engine's own (its linears packed) only in the static_packed row
        plain = on_engine_thread(engine, lambda: load_trained(model_dir, card, cfg).to(
            dtype=model.dtype, device=model.device)) \
            if "static" in paths and engine is not None and engine.packed_bytes else model
        rows = plan(levels, paths, peers, opts, packed=plain is not model)
        convs = questions(max(opts["requests"], opts["overload_requests"]))
        prompts = [predictor.prompts.chat_ids(m) for m in convs]
        pad, eos = pad_id(tok), set(engine.eos if engine is not None else ())
        port = free_port()
        api_key = os.environ.get(cfg.serve.auth_token_env) if cfg.serve.auth_token_env else None
        serve_sets = [*config_overrides, *store, "serve.enabled=true", f"serve.port={port}",
                      f"serve.cpus_per_replica={threads}"]
        servers: dict[str, Server] = {}
        if "http" in paths:
            servers["http"] = Server("workflows serve", serve_command(config, serve_sets, spec), port,
                                     logs / "serve.log", health="/healthz")
        if "peer" in paths:
            peer_port = free_port()
            servers["peer"] = Server("the one-at-a-time peer", peer_command(model_dir, peer_port, threads), peer_port,
                                     logs / "peer.log")
        for p in peers:
            servers[p.name] = p.start(logs, served)
        names = {"http": spec, **{p.name: p.model for p in peers}, "peer": "peer"}
        in_turn = {"base": lambda path: [names[path]], "adapter": lambda path: [served.adapter],
                   "mixed": lambda path: [served.adapter, names[path]]}
        extras = {p.name: p.extra for p in peers}

        def n_of(row: Row) -> int:
            if row.requests:
                return row.requests
            return opts["serial_requests"] if row.concurrency == 1 and not row.rate else opts["requests"]

        capacity: dict[str, float] = {}  # requests/s over HTTP at the top concurrency, this repeat

        def measure(row: Row, n: int, tokens: int) -> dict:
            """The row's run, its peer server resumed for it: peers sit paused (SIGSTOP) outside their rows.
            `workflows serve` is up for its own rows alone (Ray's processes cannot be frozen without failing
            its health checks, and idle they still take CPU from the rows beside them)."""
            own = servers.get(row.path) if row.path != "http" else None
            if own is not None:
                own.resume()
            try:
                beside = sorted(name for name, s in servers.items() if s.running and name != row.path)
                return {**run_row(row, n, tokens), "beside": beside}
            finally:
                if own is not None:
                    own.pause()

        def run_row(row: Row, n: int, tokens: int) -> dict:
            if row.path == "engine":
                return engine_run(engine, prompts[:n], tokens, row.concurrency, row.sampled, row.natural)
            if row.path == "static":
                return on_engine_thread(engine, lambda: static_run(
                    model if row.engine_weights else plain, pad, prompts[:n], tokens, row.concurrency, row.sampled,
                    eos if row.natural else None))
            rate = row.rate * capacity["http"] if row.rate else None
            return client_run(servers[row.path].url, in_turn[row.models](row.path), convs[:n], row, tokens, rate,
                              api_key if row.path == "http" else None, extras.get(row.path))

        flops: list[float] = []
        bandwidth: list[float] = []
        reference: list[float] = []  # seconds of transformers' decode step at the top concurrency
        floors: list[dict] = []  # that step's matmuls alone (roofline.matmul_floor)
        context = round(mean_context(prompts, opts))

        order: list[list[str]] = []  # each repeat's rows, in the order they ran

        def measure_rows(some: list[Row]) -> None:
            for row in some:
                if row.rate and "http" not in capacity:
                    continue
                result = measure(row, n_of(row), max_tokens)
                row.runs.append(result)
                order[-1].append(row.key)
                print(f"bench generate: {row.key} (repeat {len(row.runs)}): {result['tokens_per_s']:.1f} tokens/s, "
                      f"{len(result.get('refused', []))} refused", file=sys.stderr, flush=True)
                if row.key == f"http_c{max(levels)}":
                    capacity["http"] = result["requests_per_s"]

        def warm(some: list[Row]) -> None:
            for row in some:  # not counted: first calls allocate, load kernels, an adapter
                measure(row, 2, 4)

        def probe() -> None:  # every server stopped or paused (but ours with paths=http alone)
            # the served precision's matmuls
            flops.append(on_engine_thread(engine, lambda: matmul_rate(dtype=model.dtype)))
            bandwidth.append(on_engine_thread(engine, memory_bandwidth))
            floors.append(on_engine_thread(engine, lambda: matmul_floor(model, max(levels))))
            # transformers' own decode step on the engine's weights, in its thread
            if engine is not None and "engine" in paths:
                reference.append(on_engine_thread(engine, lambda: transformers_step(model, max(levels), context)))

        ours = servers.get("http")
        http_rows, other_rows = [r for r in rows if r.path == "http"], [r for r in rows if r.path != "http"]
        warmed = warm_ups(rows)
        try:
            for server in servers.values():
                if server is not ours:
                    server.start()
                    server.pause()
            warm([r for r in warmed if r.path != "http"])
            for repeat in range(opts["repeats"]):
                order.append([])
                # `workflows serve` up for its own rows alone (started, then warmed, as a new replica needs);
                # every second repeat mirrored, against the machine's drift (the module's docstring)
                mirrored = repeat % 2 == 1 and ours is not None and bool(other_rows)
                if mirrored:
                    measure_rows(other_rows[::-1])
                    probe()
                if ours is not None and not ours.running:
                    ours.start()
                    warm([r for r in warmed if r.path == "http"])
                measure_rows(http_rows)
                if not mirrored:
                    if ours is not None and other_rows:
                        ours.stop()
                    measure_rows(other_rows)
                    probe()
                capacity.pop("http", None)
        finally:
            for server in servers.values():  # any not started, or stopped already, is left as it is
                server.stop()
            if engine is not None:
                engine.close()
        return {**report(rows, opts, levels, model, prompts, spec, cfg, threads, flops, bandwidth, reference,
                         {name: s.command for name, s in servers.items()}, floors), "warm_ups": [r.key for r in warmed],
                "http_starts": ours.starts if ours is not None else 0, "order": order}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if model_dir and not opts["model"]:  # the scratch version's copy in the model cache, new each run
            shutil.rmtree(model_dir, ignore_errors=True)


