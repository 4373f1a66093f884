"""`workflows models history NAME`: a model's versions (the data, config and code commit that produced
each, from its card) and its aliases' moves (registry_aliases), in time order."""

from __future__ import annotations

from typing import Any

from workflows import registry, registry_aliases
from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.lineage import version_lineage
from workflows.registry_aliases import version_label
from workflows.storage.uri import StorageContext


def model_history(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> list[dict[str, Any]]:
    """The events of model `name`, oldest first: {"kind": "registered", "version", "at", lineage...} and
    {"kind": "alias", "alias", "from", "to", "at", "by", "reason", "seq"}, and {"kind": "refused", "alias",
    "seq", "at", "reason"} for each alias record that is refused (registry_aliases.audit)."""
    registry.parse_spec(name)  # a valid name
    found = registry.versions(cfg, ctx, name)
    if not found:
        raise UserError(f"model {name!r} not found in the registry at {cfg.uri('models')}")
    events: list[dict[str, Any]] = []
    for version in found:
        card = registry.model_card(cfg, ctx, f"{name}:{version}")
        promotion = card.promotion or {}
        events.append({"kind": "registered", "version": version, "at": card.registered_at or "",
                       **version_lineage(card),
                       "gate": promotion.get("reason") if promotion else None})
    moves, refused = registry_aliases.audit(cfg, ctx, name)
    for r in moves:
        events.append({"kind": "alias", "alias": r.alias, "from": r.previous, "to": r.version, "at": r.at,
                       "by": r.by, "reason": r.reason, "seq": r.seq})
    for f in refused:  # shown where it lies, after the alias's move before it: its own time is not believed
        events.append({"kind": "refused", "alias": f.alias, "seq": f.seq, "at": f.after, "reason": f.reason})
    # a registration's time is to the second, a move's to the microsecond: a version comes before
    # the move that names it
    order = {"registered": 0, "alias": 1, "refused": 2}
    return sorted(events, key=lambda e: (e["at"][:19], e["kind"] != "registered", e["at"], order[e["kind"]]))


def format_history(events: list[dict[str, Any]]) -> str:
    lines = []
    for e in events:
        when = e["at"][:19].replace("T", " ")
        if e["kind"] == "registered":
            rows = "/".join(str((e["rows"] or {}).get(split, "?")) for split in ("train", "val", "test"))
            lines.append(f"{when}  v{e['version']} registered: data {e['data_version'] or '?'} (digest "
                         f"{e['digest'] or '?'}, rows train/val/test {rows}), config {e['config_digest'] or '?'}, "
                         f"commit {(e['commit'] or '?')[:12]}" + (f", MLflow run {e['run']}" if e["run"] else ""))
        elif e["kind"] == "refused":
            lines.append(f"{when or '?':19}  @{e['alias']}: move {e['seq']} REFUSED: {e['reason']}")
        else:
            lines.append(f"{when}  @{e['alias']}: {version_label(e['from'])} -> {version_label(e['to'])} by {e['by']}"
                         + (f": {e['reason']}" if e["reason"] else ""))
    return "\n".join(lines)
