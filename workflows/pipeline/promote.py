"""The promotion gate (`registry.promote`): after the pipeline's evaluation, the new version and the
version that holds the alias are scored on the same rows, and the alias moves to the new version only
when it wins by the margin; with no holder, the first version takes it.

The rows: the candidate's held-out split (the pipeline's evaluation already scored the candidate on
it), and `registry.gate_data` when the config names one, a fixed set both are scored on too. The gate
set decides when there is one (two runs on different data meet on common ground there), else the
held-out split. The decision, both scores and the rows go into the stage's summary (promote.json and
pipeline.json's `promotion`), beside the version in the registry (registry.write_promotion, which its
card shows), into MLflow (the promote run) and one printed line. The alias moves as every alias does
(registry.move_alias: the record, and the alias in MLflow's registry), on the condition that it still
holds the version the gate scored (`expect`): a move made meanwhile by someone else is reported, never
overwritten.
"""

from __future__ import annotations

import time
from typing import Any

from workflows import registry, registry_aliases
from workflows.config import WorkflowConfig
from workflows.evaluate import evaluate_dataset
from workflows.pipeline.stages import stage
from workflows.preprocess.sources import list_shards, read_dataset
from workflows.runtime import Runtime, say
from workflows.tasks import get_task, task_for_card
from workflows.tracking import stages as tracking
from workflows.tracking.session import Run


def gate_metric(cfg: WorkflowConfig) -> tuple[str, str]:
    """(the metric the gate compares, "max" | "min"): `registry.promote.metric`, else the task's headline."""
    assert cfg.registry.promote is not None
    metrics = get_task(cfg).evaluation.comparable_metrics()
    name = cfg.registry.promote.metric or next(iter(metrics))
    return name, metrics[name]


def wins(candidate: float, holder: float, mode: str, margin: float) -> bool:
    """Whether the candidate beats the holder by more than `margin` in the metric's direction (a tie never does)."""
    gain = candidate - holder if mode == "max" else holder - candidate
    return gain > margin


def stage_promote(rt: Runtime, ref: registry.ModelRef, test_ds, candidate_test: dict, by: str) -> dict:
    """Decide whether `ref` takes the alias; returns the decision (what promote.json holds).
    `test_ds`: the candidate's held-out rows, `candidate_test`: its evaluation on them."""
    cfg = rt.cfg
    promote = cfg.registry.promote
    assert promote is not None
    metric, mode = gate_metric(cfg)
    task = get_task(cfg)
    with stage(rt, "promote") as s:
        held = registry_aliases.holder(cfg, rt.storage, ref.name, promote.alias)
        sets: dict[str, dict[str, Any]] = {"test": {"rows": candidate_test["rows"],
                                                    "candidate": task.evaluation.metric_value(candidate_test, metric)}}
        gate_ds = _gate_rows(rt) if cfg.registry.gate_data else None
        if gate_ds is not None:
            scored = _score(rt, f"{ref.name}:{ref.version}", gate_ds)
            sets["gate"] = {"rows": scored["rows"], "data": cfg.registry.gate_data,
                            "candidate": task.evaluation.metric_value(scored, metric)}
        if held is not None:
            card = registry.model_card(cfg, rt.storage, f"{ref.name}:{held}")
            holder_task = task_for_card(cfg, card)
            for name, ds in (("test", test_ds), ("gate", gate_ds)):
                if ds is not None:
                    scored = _score(rt, f"{ref.name}:{held}", ds, card)
                    if scored["rows"] != sets[name]["rows"]:  # both scored on the same labelled rows
                        raise RuntimeError(f"gate: {name} rows differ ({scored['rows']} vs {sets[name]['rows']})")
                    sets[name]["holder"] = holder_task.evaluation.metric_value(scored, metric)
        on = "gate" if "gate" in sets else "test"
        decision = _decide(ref, held, sets[on], metric, mode, promote.margin)
        decision.update(alias=promote.alias, metric=metric, mode=mode, margin=promote.margin, decided_on=on,
                        scores=sets, candidate=ref.version, holder=held, by=by,
                        at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        s.summary.update(carry_out(rt, s.run, ref, decision))
    return decision


def carry_out(rt: Runtime, run: Run, ref: registry.ModelRef, decision: dict) -> dict:
    """The decision carried out and recorded: the alias moved to `ref` when it won, unless it moved
    meanwhile (the decision then says so); the decision stored beside the version, said in one line
    and logged on the promote `run`."""
    if decision["promoted"]:
        try:
            record = registry.move_alias(rt.cfg, rt.storage, ref.name, decision["alias"], ref.version,
                                         by=decision["by"], reason=decision["reason"], expect=decision["holder"],
                                         details={k: decision[k] for k in ("metric", "scores", "decided_on")},
                                         tracker=tracking.session_tracker(rt))
            decision["seq"] = record.seq
        except registry_aliases.AliasMovedMeanwhile as e:
            decision.update(promoted=False, reason=f"not moved: {e}")
    registry.write_promotion(rt.cfg, rt.storage, ref, decision)
    rt.persist()
    say(line(ref, decision))
    tracking.log_promotion(run, ref, decision)
    return decision


def _decide(ref, held: int | None, scores: dict, metric: str, mode: str, margin: float) -> dict:
    if held is None:
        return {"promoted": True, "reason": f"the first version to take it: {metric} {scores['candidate']:.4f} on "
                                            f"{scores['rows']} rows"}
    cand, hold = scores["candidate"], scores["holder"]
    gain = cand - hold if mode == "max" else hold - cand
    better = "higher" if mode == "max" else "lower"
    verdict = "beats" if wins(cand, hold, mode, margin) else "does not beat"
    return {"promoted": verdict == "beats",
            "reason": f"{metric} {cand:.4f} {verdict} v{held}'s {hold:.4f} by more than the margin {margin:g} "
                      f"({better} is better: {gain:+.4f}) on the same {scores['rows']} rows"}


def line(ref, d: dict) -> str:
    """The one printed line of a decision."""
    verdict = f"{ref.name}@{d['alias']} -> v{ref.version}" if d["promoted"] else \
        f"{ref.name}@{d['alias']} stays at {registry_aliases.version_label(d['holder'])}"
    where = {"test": "of the held-out split", "gate": "of the gate set"}[d["decided_on"]]
    return f"promote: {verdict}: {d['reason']} {where}"


def _gate_rows(rt: Runtime):
    uri = rt.cfg.registry.gate_data
    assert uri is not None
    shards, fmt = list_shards(uri, rt.storage)
    return read_dataset(shards, fmt, rt.storage, rt.cfg.cache)


def _score(rt: Runtime, spec: str, ds, card=None) -> dict:
    card = card if card is not None else registry.model_card(rt.cfg, rt.storage, spec)
    return evaluate_dataset(rt.cfg, spec, card, ds)


