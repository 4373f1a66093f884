"""Signing: what signed versions and records cost beside the commands that pay for them.

The quickstart pipeline runs first (the real command, a fresh embedded store), which registers
`quickstart:1` signed. Then, in that store:
- `workflows evaluate --model quickstart --split test` as a fresh process from a cold cache (its own empty
  cache.dir), on the signed version, interleaved and repeated with the same command on an unsigned copy of
  it (`quickstart-unsigned:1`, read with registry.allow_unsigned: what a version registered before signing
  costs): the wall ratio, and
- the parts signing adds, timed in this process on the same files: a replica's start on a node whose
  cache holds the version (the card's signature, and every file hashed again and checked), a cold fetch's
  check (the digests come from the download), registration's signing, a record's signature and its check,
  and model-signing's import, each beside the evaluate command's wall and the pipeline's serve start.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.pipeline_run import fresh_overrides, run_pipeline_in

GOAL = 0.05  # signing and verifying at most 5% of evaluate from a cold cache, and of a replica's start
REPEATS = 3
FIGURES = ("evaluate_signed_vs_unsigned", "verify_share_of_evaluate", "verify_share_of_replica_start")


def run(config: str | None, overrides: list[str]) -> dict:
    config = config or "quickstart"
    with tempfile.TemporaryDirectory() as tmp:
        pipeline_wall, summary = run_pipeline_in(tmp, config, overrides)
        sets = [*fresh_overrides(tmp), *overrides]
        unsigned = _unsigned_copy(tmp, config, sets)
        walls: dict[str, list[float]] = {"signed": [], "unsigned": []}
        for i in range(REPEATS):  # interleaved: both see the same machine
            for kind, model, extra in (("signed", "quickstart", []),
                                       ("unsigned", unsigned, ["registry.allow_unsigned=true"])):
                walls[kind].append(_evaluate(tmp, config, [*sets, *extra], model, f"{kind}-{i}"))
        parts = _parts(tmp, config, sets)
    evaluate = {k: round(statistics.median(v), 2) for k, v in walls.items()}
    out = {
        "pipeline_wall_seconds": round(pipeline_wall, 1),
        "evaluate_seconds": evaluate,
        "evaluate_walls": walls,
        "evaluate_signed_vs_unsigned": round(evaluate["signed"] / evaluate["unsigned"], 3),
        "version_bytes": parts.pop("version_bytes"),
        "parts_seconds": parts,
        "serve_start_seconds": summary.get("serve", {}).get("deploy_seconds"),
        "goal": GOAL,
    }
    return {**out, **shares(out)}


def shares(r: dict) -> dict:
    """What the checks cost a cold evaluate and a replica's start, and their shares. Both count model-signing's
    import, the card's check and every file hashed (on a cold fetch the hashing happens as the download writes
    the files, the check then compares digests: the cache hit's full hashing bounds it); the evaluate also
    reads its version's records."""
    p = r["parts_seconds"]
    common = p["import_model_signing"] + p["card_check"] + p["cache_hit_check"]
    cold, replica = common + p["record_check"], common
    serve = r["serve_start_seconds"]
    return {"verify_cold_seconds": round(cold, 3), "verify_share_of_evaluate": round(cold / r["evaluate_seconds"]
                                                                                     ["signed"], 4),
            "verify_replica_seconds": round(replica, 3),
            "verify_share_of_replica_start": round(replica / serve, 4) if serve else None}


def _evaluate(tmp: str, config: str, sets: list[str], model: str, cache: str) -> float:
    """Wall seconds of `workflows evaluate` in a fresh process, on a cache of its own (cold)."""
    cmd = [sys.executable, "-m", "workflows", "evaluate", "--model", model, "--split", "test", "--config", config]
    for s in [*sets, f"cache.dir={tmp}/cache-{cache}"]:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return round(time.perf_counter() - t0, 2)


@contextmanager
def _opened(config: str, sets: list[str]) -> Iterator[tuple]:
    """(config, storage context) of the pipeline's store, its embedded endpoint up (and persisted after)."""
    from workflows.config import load_config
    from workflows.runtime import runtime

    cfg = load_config(config, sets)
    with runtime(cfg, ray_needed=False) as rt:
        yield cfg, rt.storage


def _unsigned_copy(tmp: str, config: str, sets: list[str]) -> str:
    """`quickstart-unsigned:1`: quickstart:1's files and card (renamed) without its signature, as a version
    registered before signing is stored."""
    from workflows import registry
    from workflows.model_card import CARD_FILE
    from workflows.registry_signing import SIGNATURE_FILE
    from workflows.storage.uri import download_dir, join, read_json, write_bytes_atomic, write_json

    with _opened(config, sets) as (cfg, storage):
        ref = registry.resolve(cfg, storage, "quickstart:1")
        local = Path(tmp, "unsigned")
        local.mkdir()
        download_dir(ref.uri, storage, str(local), skip=(*registry.NOT_SIGNED, SIGNATURE_FILE, CARD_FILE))
        card = read_json(join(ref.uri, CARD_FILE), storage)
        target = join(cfg.uri("models"), "quickstart-unsigned", "v1")
        for f in local.iterdir():
            write_bytes_atomic(join(target, f.name), f.read_bytes(), storage)
        write_json(join(target, CARD_FILE), {**card, "name": "quickstart-unsigned"}, storage)
    return "quickstart-unsigned"


def _parts(tmp: str, config: str, sets: list[str]) -> dict:
    """Seconds of each part signing adds, on quickstart:1's own files (best of REPEATS: the cost, not the
    machine's noise), and model-signing's import in a fresh process."""
    from workflows import registry, registry_signing
    from workflows.storage.uri import download_dir

    imported = subprocess.run([sys.executable, "-c", "import time; t = time.perf_counter(); "
                               "from model_signing._signing import sign_ec_key, sign_sigstore_pb; "
                               "print(time.perf_counter() - t)"], check=True, capture_output=True, text=True)
    out: dict = {"import_model_signing": round(float(imported.stdout.strip()), 3)}
    with _opened(config, sets) as (cfg, s):
        ref = registry.resolve(cfg, s, "quickstart:1")
        local = Path(tmp, "parts")
        found = download_dir(ref.uri, s, str(local), skip=registry.NOT_SIGNED)
        out["version_bytes"] = sum(f.stat().st_size for f in local.iterdir())
        card = registry.read_card(cfg, s, ref)
        allowing = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"allow_unsigned": True})})
        key = registry_signing.signer(cfg.registry.signing_key)
        subject = f"{ref.name}:v{ref.version}"
        record = registry_signing.sign_record(key, subject, registry.EVAL_FILE, {"weighted": {"f1": 0.9}})
        timed = {
            # the card's read with its signature's check, less the same read without it
            "card_check": (lambda: registry.read_card(cfg, s, ref), lambda: registry.read_card(allowing, s, ref)),
            "cold_fetch_check": (lambda: registry._verified(cfg, local, ref, card, found), None),
            "cache_hit_check": (lambda: registry._verified(cfg, local, ref, card), None),
            "sign_version": (lambda: registry_signing.sign(key, subject, registry_signing.digests(local)), None),
            "sign_record": (lambda: registry_signing.sign_record(key, subject, registry.EVAL_FILE, {"f1": 0.9}), None),
            "record_check": (lambda: registry_signing.verified_record(
                record, subject, registry.EVAL_FILE, cfg.registry.trusted_keys, False, "bench"), None),
        }
        for name, (fn, base) in timed.items():
            out[name] = round(max(0.0, _best(fn) - (_best(base) if base else 0.0)), 4)
    return out


def _best(fn) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _goal(share: float | None) -> str:
    if share is None:
        return "not measured"
    return f"<= {GOAL:.0%} ({'met' if share <= GOAL else 'not met'})"


def markdown(r: dict) -> str:
    from benchmarks.quickstart import load

    r = {**r, **shares(r)}
    p, e, walls = r["parts_seconds"], r["evaluate_seconds"], r["evaluate_walls"]
    rows = "\n".join(f"| {k.replace('_', ' ')} | {v:.4f} |" for k, v in sorted(p.items()))
    overlap = max(min(walls["signed"]), min(walls["unsigned"])) <= min(max(walls["signed"]), max(walls["unsigned"]))
    noise = " (the runs' ranges overlap: the commands differ by less than the machine's noise; the parts below " \
            "measure the cost)" if overlap else ""
    return f"""## Signing: what signed versions and records cost

`{r["command"]}` ({r["measured_at"]}, {r["machine"]["cpus"]} CPUs{load(r)})

The quickstart pipeline, then in its store `workflows evaluate --model quickstart --split test` in a fresh
process from a cold cache, {REPEATS} times interleaved with the same command on an unsigned copy of the version
(read with `registry.allow_unsigned`); medians. The parts signing adds, timed on the same version's files
({r["version_bytes"] / 2**20:.1f} MiB; best of {REPEATS}), beside that command and the pipeline's serve start.

| measure | value | goal |
| --- | --- | --- |
| evaluate, signed version (s) | {e["signed"]:.2f} (runs {", ".join(map(str, walls["signed"]))}) | |
| evaluate, unsigned copy (s) | {e["unsigned"]:.2f} (runs {", ".join(map(str, walls["unsigned"]))}) | |
| signed / unsigned, medians | {r["evaluate_signed_vs_unsigned"]:.3f}x{noise} | |
| checks on a cold evaluate (import, card, every file hashed, records) (s) | {r["verify_cold_seconds"]:.3f} | |
| their share of evaluate | {r["verify_share_of_evaluate"]:.2%} | {_goal(r["verify_share_of_evaluate"])} |
| checks on a replica's start, cache hit (import, card, every file hashed again) (s) | {r["verify_replica_seconds"]:.3f} | |
| their share of the pipeline's serve start ({r["serve_start_seconds"] or 0:.1f} s) | {r["verify_share_of_replica_start"]:.2%} | {_goal(r["verify_share_of_replica_start"])} |

| part (seconds) | |
| --- | --- |
{rows}
"""  # noqa: E501 (markdown table rows: one line each)


if __name__ == "__main__":
    from benchmarks.record import main

    main("signing")
