"""`workflows bench serve` on the quickstart's model for docs/BENCHMARKS.md's serving section, and the
latency/throughput figure that section embeds (`python -m benchmarks.serve`)."""

from __future__ import annotations

from pathlib import Path

from workflows.bench.serve import GOALS

PLOT = Path("docs/images/serve_latency_throughput.png")


def run(config: str | None, overrides: list[str]) -> dict:
    """The serving benchmark (workflows.bench.serve), then its latency/throughput figure."""
    from workflows.bench import serve

    result = serve.run(config, overrides)
    _plot(result["batched"], result["unbatched_c32"])
    return {**result, "plot": str(PLOT)}


def _plot(curve: dict, unbatched: dict) -> None:
    from workflows.plots import new_figure, save_png

    cs = sorted(curve)
    fig, ax1 = new_figure()
    ax1.plot(cs, [curve[c]["rps"] for c in cs], "o-", label="batched: requests/s")
    ax1.plot([32], [unbatched["rps"]], "s", color="gray", label="unbatched, c=32: requests/s")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("requests/s")
    ax2 = ax1.twinx()
    ax2.plot(cs, [curve[c]["p50_ms"] for c in cs], "^--", color="tab:red", label="batched: p50 ms")
    ax2.set_ylabel("p50 latency (ms)")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, fontsize=7, loc="upper left")
    save_png(fig, PLOT)


def _rollout_row(r: dict) -> str:
    u = r.get("rolling_update")
    if not u:
        return "| new version rolled out under load | not measured in this run | 0 failed |"
    met = _mark(r, "rolling_update_failed")
    if "moved_by" not in u:  # a run from before the rollover was driven by an alias move
        return (
            f"| new version rolled out under load (2 replicas, concurrency {u['concurrency']}): failed requests | "
            f"{u['failed']} of {u['requests']}; answered by {u['answered_by']}; first v2 answer after "
            f"{u['first_new_version_s']} s, last v1 answer {u['last_old_version_s']} s, deploy returned after "
            f"{u['deploy_returned_s']} s | 0 ({met}) |"
        )
    bound = _mark(r, "rolling_update_bound_s")
    return (
        f"| an alias move rolls serving over under load (2 replicas, concurrency {u['concurrency']}): failed "
        f"requests; only the new version answering | {u['failed']} of {u['requests']}; answered by "
        f"{u['answered_by']}; first v2 answer {u['first_new_version_s']} s after the move, last v1 answer "
        f"{u['last_old_version_s']} s (the new version deployed in {u['deploy_s']} s) | 0 ({met}); within "
        f"{u['bound_s']:g} s ({bound}) |"
    )


def _scale_to_zero_row(r: dict) -> str:
    z = r.get("scale_to_zero")
    if not z:
        return "| scale to zero and back | not measured in this run | 0 failed |"
    return (
        f"| scale to zero (`min_replicas: 0`, idle {z['downscale_delay_s']:g} s) and back, {z['cycles']} "
        f"cycles: failed requests; the cold start | {z['failed']} of {z['requests']}; cold start p50 "
        f"{z['cold_p50_ms'] / 1000:.1f} s, p99 {z['cold_p99_ms'] / 1000:.1f} s; warm p50 {z['warm_p50_ms']} ms, "
        f"p99 {z['warm_p99_ms']} ms; zero replicas {z['to_zero_s_median']} s after the last request | "
        f"0 ({_mark(r, 'scale_to_zero_failed')}) |"
    )


def _autoscaling_row(r: dict) -> str:
    a = r.get("autoscaling")
    if not a:
        return "| autoscaling 1 -> 2 replicas under load | not measured in this run | 0 errors |"
    met = _mark(r, "autoscaling_errors")
    return (
        f"| autoscaling 1 -> 2 replicas (target {a['target_ongoing_requests']} ongoing, delays "
        f"{a['upscale_delay_s']:g}/{a['downscale_delay_s']:g} s) at concurrency {a['concurrency']}: errors | "
        f"{a['errors']} of {a['requests']}; 2 replicas after {a['scaled_up_s']} s, back to 1 "
        f"{a['scaled_down_s']} s after the load stopped; {a['rps_one_replica']} req/s on 1 replica, "
        f"{a['rps_two_replicas']} on 2 | 0 ({met}) |"
    )


def _bf16_rows(r: dict) -> str:
    if "bf16_f1_delta" not in r:
        return "| bf16 | not measured in this run | |"
    return (
        f"| `bf16_speedup` (in-process on this CPU, batches of 32; a GPU's differs) | {r['bf16_speedup']}x "
        f"({r['bf16_rows_per_s']:.0f} vs {r['fp32_rows_per_s']:.0f} rows/s) | |\n"
        f"| `bf16_f1_delta` (fp32 − bf16 weighted F1, held-out split) | {r['bf16_f1_delta']} "
        f"({r['fp32_f1']} vs {r['bf16_f1']}) | |"
    )


def _peer_rows(r: dict) -> str:
    p = r.get("peer")
    if not p:
        return "| Serve vs the plain FastAPI peer | not measured in this run | |"
    s, q = p["serve"], p["peer"]
    return (
        f"| `serve_vs_peer_throughput`: req/s at concurrency 32, Serve / the plain FastAPI peer (medians of "
        f"{p['reps']} alternating runs) | {p['serve_vs_peer_throughput']} ({s['32']['rps']:.0f} vs "
        f"{q['32']['rps']:.0f} req/s) | >= {GOALS['serve_vs_peer_throughput']} "
        f"({_mark(r, 'serve_vs_peer_throughput')}) |\n"
        f"| `p50_over_peer_ms`: p50 at concurrency 1, Serve − peer | {p['p50_over_peer_ms']} ms ({s['1']['p50_ms']} vs "
        f"{q['1']['p50_ms']} ms) | <= {GOALS['p50_over_peer_ms']} ({_mark(r, 'p50_over_peer_ms')}) |"
    )


def _image_rows_md(r: dict) -> str:
    i = r.get("image")
    if not i or not i.get("peer"):
        why = f" ({i['skipped']})" if i and i.get("skipped") else ""
        return f"| image classifier: Serve vs the plain FastAPI peer | not measured in this run{why} | |"
    p = i["peer"]
    s, q = p["serve"], p["peer"]
    return (
        f"| image classifier {i['model']} (JSON base64 PNGs, the held-out raw images, median "
        f"{i['image_bytes_median']} bytes): req/s at concurrency 32, Serve / the peer (same ImagePredictor and "
        f"decode path; medians of {p['reps']} alternating runs) | {p['serve_vs_peer_throughput']} "
        f"({s['32']['rps']:.0f} vs {q['32']['rps']:.0f} req/s) | >= {GOALS['image_serve_vs_peer_throughput']} "
        f"({_mark(r, 'image_serve_vs_peer_throughput')}) |\n"
        f"| image classifier: p50 at concurrency 1, Serve − peer | {p['p50_over_peer_ms']} ms ({s['1']['p50_ms']} vs "
        f"{q['1']['p50_ms']} ms) | <= {GOALS['image_p50_over_peer_ms']} ({_mark(r, 'image_p50_over_peer_ms')}) |"
    )


def _image_cpu_md(r: dict) -> str:
    """Where the image row's CPU goes: ms per request by process, Serve beside the peer."""
    cpu = ((r.get("image") or {}).get("peer") or {}).get("cpu_ms_per_request")
    if not cpu:
        return ""
    s, q = cpu["serve"], cpu["peer"]
    # by CPU, ties by name: the same results always render the same doc
    groups = sorted(set(s["groups"]) | set(q["groups"]),
                    key=lambda g: (-(s["groups"].get(g, 0) + q["groups"].get(g, 0)), g))
    rows = "\n".join(f"| {g} | {s['groups'].get(g, 0):.3f} | {q['groups'].get(g, 0):.3f} |" for g in groups)
    return f"""
Image classifier: CPU per answered request at concurrency 32 ({s["requests"]} requests to each server, one after the
other; user + system CPU of this process and every process it started, Ray's and the peer's, by process). Unlike
req/s, CPU time per request is not taken by other work on the machine; on {r["machine"]["cpus"]} cores, req/s at
concurrency 32 is bounded by cores ÷ total CPU per request.

| process | Serve ms CPU / request | peer ms CPU / request |
| --- | --- | --- |
{rows}
| **total** | **{s["total"]}** ({s["rps"]:.0f} req/s) | **{q["total"]}** ({q["rps"]:.0f} req/s) |

{_image_why(r)}
{_image_levers_md(r)}"""


def _image_why(r: dict) -> str:
    """The image row's CPU accounting in words, every figure from the results."""
    import textwrap

    i = r["image"]["peer"]
    s, q = i["cpu_ms_per_request"]["serve"], i["cpu_ms_per_request"]["peer"]
    met = r["goals_met"].get("image_serve_vs_peer_throughput") and r["goals_met"].get("image_p50_over_peer_ms")
    levers = i.get("levers") or []
    closing = [v["lever"] for v in levers
               if (v["serve_vs_peer_throughput"] or 0) >= GOALS["image_serve_vs_peer_throughput"]]
    said = (f"Where the image row's time goes{'' if met else ', and why it misses its goals'}: the model is cheap, so "
            f"per request the serving stack, not the model, takes most of the CPU, and both servers and the client "
            f"share the same {r['machine']['cpus']} cores. From CPU alone, Serve's req/s can be at most "
            f"{q['total'] / s['total']:.2f}x the peer's (peer ÷ Serve CPU per request), against the "
            f"{i['serve_vs_peer_throughput']}x measured. The replica alone spends "
            f"{s['groups'].get('Serve replica', 0) - q['groups'].get('peer (FastAPI + uvicorn)', 0):.2f} ms more CPU "
            "per request than the peer's process for the same ImagePredictor and decode; HAProxy, its manager and "
            "Ray's other processes add the rest. A py-spy profile of the replica under this load (outside the bench) "
            "put the model's forward at a smaller share of the replica's samples than of the peer's, the difference "
            "going to Serve's request path: the Ray metric records of every request (RequestGuard's counter and "
            "latency histogram, Serve's own), the access log and its forwarding to the driver, Serve's replica "
            "wrapper and direct-ingress HTTP handling, and the hop to the separate user-code event loop thread. "
            + (f"Of the settings below, {', '.join(closing)} reaches the throughput goal. " if closing else
               "None of the settings below reaches the throughput goal. " if levers else "")
            + f"The text row's model, about {r.get('direct_p50_ms', 0):.0f} ms a row in process, hides the same "
            "per-request cost.")
    return textwrap.fill(said, 118)


def _image_levers_md(r: dict) -> str:
    levers = r["image"]["peer"].get("levers") or []
    if not levers:
        return ""
    rows = "\n".join(
        f"| {v['lever']} | `{v['change']}` | {v['serve_vs_peer_throughput']} ({v['serve']['32']['rps']:.0f} vs "
        f"{v['peer']['32']['rps']:.0f} req/s) | {v['p50_over_peer_ms']} ms ({v['serve']['1']['p50_ms']} vs "
        f"{v['peer']['1']['p50_ms']} ms) |" for v in levers)
    return f"""
The image deployment again with one setting changed, against the same peer (same alternation and reps):

| lever | change | Serve / peer req/s at concurrency 32 | p50 at concurrency 1, Serve − peer |
| --- | --- | --- | --- |
{rows}
"""


def _load_line(r: dict) -> str:
    load = r["machine"].get("load_average")
    if not load:
        return ""
    return (f"\nThe machine's load average: {load['before']} (1 min) when this run started, {load['after_15min']} "
            "(15 min) when it ended.")


def _mark(r: dict, goal: str) -> str:
    return "met" if r["goals_met"].get(goal) else "**not met**"


def markdown(r: dict) -> str:
    def mark(goal):
        return _mark(r, goal)

    rows = "\n".join(
        f"| {c} | {v['rps']:.0f} | {v['p50_ms']} | {v['p95_ms']} | {v['errors']} |"
        for c, v in sorted(r["batched"].items(), key=lambda kv: int(kv[0]))
    )
    k, load_10k = r["replica_kill"], r["load_10k"]
    c32 = r["batched"].get(32) or r["batched"]["32"]  # int keys in memory, str once through JSON
    return f"""## Serving

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs), model {r["model"]}, 1 replica x
{r["cpus_per_replica"]} CPU, `serve.batch_wait_timeout_s` {r.get("batch_wait_timeout_s", "n/a")},
`serve.model_in_thread` {r.get("model_in_thread", "n/a")}, behind {r.get("ingress", "n/a")}, real HTTP from an aiohttp client on the same machine.
The machine may be shared with other work while measured: the Serve-vs-peer figures alternate between the two
servers point by point so that both see the same load; absolute req/s and ms move with it.{_load_line(r)}

| measure | value | goal |
| --- | --- | --- |
{_peer_rows(r)}
{_image_rows_md(r)}
| `batched_vs_unbatched_throughput` at concurrency 32 | {r["batched_vs_unbatched_throughput"]}x ({c32["rps"]:.0f} vs {r["unbatched_c32"]["rps"]:.0f} req/s) | (the 4x goal moved to the GPU) |
| ceiling: the predictor alone, batches of 32 vs single rows (no HTTP) | {r.get("inprocess_batched_vs_unbatched", "n/a")}x ({r.get("inprocess_rows_per_s_batch32", "n/a")} vs {r.get("inprocess_rows_per_s_batch1", "n/a")} rows/s) | |
| `p50_overhead_ms` (HTTP p50 at concurrency 1 − in-process predictor p50 {r["direct_p50_ms"]} ms) | {r["p50_overhead_ms"]} ms | |
| floor: `GET /healthz` p50 at concurrency 1 (ingress, replica, FastAPI; no model, no batching) | {r.get("healthz_p50_ms", "n/a")} ms | |
| `int8_speedup` (in-process, batches of 32) | {r["int8_speedup"]}x ({r["int8_rows_per_s"]:.0f} vs {r["fp32_rows_per_s"]:.0f} rows/s) | |
| `int8_f1_delta` (fp32 − int8 weighted F1, held-out split) | {r["int8_f1_delta"]} ({r["fp32_f1"]} vs {r["int8_f1"]}) | |
{_bf16_rows(r)}
| {load_10k["requests"]} requests at concurrency 64: errors | {load_10k["errors"]} ({load_10k["rps"]:.0f} req/s, p99 {load_10k["p99_ms"]} ms) | 0 ({mark("load_errors")}) |
| one of 2 replicas SIGKILLed under load: failed requests | {k["failed"]} of {k["requests"]} ({100 * k["failed_fraction"]:.2f}%) | < 1% ({mark("replica_kill_failed_fraction")}) |
| replica replaced after | {k["recovery_s"]} s | < 30 s ({mark("replica_kill_recovery_s")}) |
{_rollout_row(r)}
{_autoscaling_row(r)}
{_scale_to_zero_row(r)}

Batched deployment, by concurrency:

| clients | req/s | p50 ms | p95 ms | errors |
| --- | --- | --- | --- | --- |
{rows}

![latency and throughput](images/{PLOT.name})
{_image_cpu_md(r)}"""  # noqa: E501 (markdown table rows: one line each)

if __name__ == "__main__":
    from benchmarks.record import main

    main("serve")
