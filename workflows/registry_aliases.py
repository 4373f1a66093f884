"""Aliases of registered versions (`production`, `staging`, any valid name) and their history, in
the registry's bucket: `<storage.root>/models/<name>/aliases/<alias>/<seq>.json`. This module names,
reads and writes those records; an alias moves through `registry.move_alias`, which checks the
version it is to point at, appends the record here and mirrors it into MLflow's model registry.

Each move of an alias is a new record with the next sequence number, written with the registry's
create-only write (workflows.storage.create_only.create_once). The alias's holder
is its newest record. Two movers racing contend for the same key: one creates it, the other reads
the new newest record and writes the next one (its `from` is then the winner's version), or,
when it moved on the condition that the holder is still the one it saw (`expect`, the promotion
gate's compare-and-set), reports the move it lost to. No move is lost, and none is recorded twice.
The records are the history: from, to, when, by which command or run, why. Each is signed by the
mover's registry.signing_key and read only once it verifies against registry.trusted_keys
(registry_signing.sign_record): a writer to the bucket can delete moves, never make or edit one. A
record that is refused (edited, unsigned, another key's, another place's) stops every reader of the
alias and the gate's conditional move, and shows in the history, until a plain move goes past it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from workflows import registry_signing
from workflows.config import WorkflowConfig
from workflows.config.base import check_alias_name
from workflows.console import warn
from workflows.errors import StoreUnreachable, UserError
from workflows.registry_signing import Refused
from workflows.storage.create_only import create_once
from workflows.storage.uri import StorageContext, join, names_under, read_json

ALIASES = "aliases"
_RECORD = re.compile(r"^(\d{8,})\.json$")  # 8 digits, more once there are (seq 10**8 on)
UNSET = object()  # `expect` not given: move whatever holds the alias now
# a lifecycle record read back (a move, a version's evaluation or promotion): kilobytes
MAX_RECORD_BYTES = 1 << 20
MAX_VERSION = 10**9


class AliasMovedMeanwhile(UserError):
    """A conditional move (`expect`) found another move first: the decision it was based on is stale."""


@dataclass(frozen=True)
class AliasRecord:
    """One move of an alias: `version` None removes it. `seq` orders the moves of one alias."""

    alias: str
    seq: int
    version: int | None
    previous: int | None
    at: str
    by: str
    reason: str
    details: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"alias": self.alias, "seq": self.seq, "version": self.version, "from": self.previous, "at": self.at,
                "by": self.by, "reason": self.reason, **({"details": self.details} if self.details else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AliasRecord:
        if not isinstance(d, dict):
            raise TypeError(f"a JSON object, not a {type(d).__name__}")
        return cls(alias=str(d["alias"]), seq=int(d["seq"]), version=_version_or_none(d.get("version")),
                   previous=_version_or_none(d.get("from")), at=str(d.get("at", "")), by=str(d.get("by", "")),
                   reason=str(d.get("reason", "")), details=dict(d.get("details") or {}))


def _version_or_none(v: Any) -> int | None:
    if v is None:
        return None
    # not a bool, a float or a string that int() would take; versions count up from 1, one registration each
    if type(v) is not int or not 1 <= v < MAX_VERSION:
        raise TypeError(f"a version is a positive integer below {MAX_VERSION}, not {json.dumps(v)[:40]}")
    return v


def check_alias(alias: str) -> str:
    """An alias becomes part of a path and of `NAME@ALIAS`: a valid name that cannot read as a version."""
    try:
        return check_alias_name(alias)
    except ValueError as e:
        raise UserError(str(e)) from None


def _alias_dir(cfg: WorkflowConfig, name: str, alias: str) -> str:
    return join(cfg.uri("models"), name, ALIASES, alias)


def _record_name(seq: int) -> str:
    return f"{seq:08d}.json"


def _record_uri(cfg: WorkflowConfig, name: str, alias: str, seq: int) -> str:
    return join(_alias_dir(cfg, name, alias), _record_name(seq))


def _seqs(cfg: WorkflowConfig, ctx: StorageContext, uri: str) -> list[int]:
    return sorted(int(m.group(1)) for n in names_under(uri, ctx) if (m := _RECORD.match(n)))


def _read(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str, seq: int) -> AliasRecord:
    """The record in `<seq>.json`, refused in one line naming the file unless it is a JSON object of at most
    MAX_RECORD_BYTES whose alias and seq are those its place says: the file name orders the moves, and a
    record whose content claims another seq (the next move would be written where no listing reads it,
    or collide forever) or another alias was edited in the store."""
    uri = _record_uri(cfg, name, alias, seq)
    try:
        stored = read_json(uri, ctx, max_bytes=MAX_RECORD_BYTES)
        record = AliasRecord.from_dict(stored)
    except StoreUnreachable:
        raise
    except UserError as e:  # over the bound
        raise Refused(str(e)) from None
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise Refused(f"{uri} is not a valid alias record ({type(e).__name__}: {e})".splitlines()[0]) from None
    if (record.alias, record.seq) != (alias, seq):
        raise Refused(f"{uri} says alias {record.alias!r} seq {record.seq}, not the {alias!r} seq {seq} of its "
                      "place: refused; the record was edited in the store")
    registry_signing.verified_record(stored, f"{name}@{alias}", _record_name(seq), cfg.registry.trusted_keys,
                                     cfg.registry.allow_unsigned, uri)
    return record


def newest(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str) -> AliasRecord | None:
    """The alias's newest record (its holder is `.version`), or None if it was never set. A newest record
    that is refused is refused here (no reader falls back to an older move): serving keeps what it serves
    and says why, until a real move (`workflows models alias`) goes past it."""
    seqs = _seqs(cfg, ctx, _alias_dir(cfg, name, alias))
    try:
        return _read(cfg, ctx, name, alias, seqs[-1]) if seqs else None
    except Refused as e:
        raise Refused(f"{e}; `workflows models alias {name}:VERSION {alias}` moves the alias past it") from None


def holder(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str) -> int | None:
    """The version the alias points at now; None when it is not set (never, or removed)."""
    record = newest(cfg, ctx, name, alias)
    return record.version if record is not None else None


def alias_names(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> list[str]:
    return names_under(join(cfg.uri("models"), name, ALIASES), ctx)


def aliases(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> dict[str, int]:
    """{alias: version} of the aliases of `name` that are set now."""
    out = {}
    for alias in alias_names(cfg, ctx, name):
        try:
            version = holder(cfg, ctx, name, alias)
        except Refused:  # no trusted move says where it points: not set (resolving it says why)
            continue
        if version is not None:
            out[alias] = version
    return out


def history(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> list[AliasRecord]:
    """Every move of every alias of `name`, oldest first; refused if any record is (audit: them too)."""
    records, refused = audit(cfg, ctx, name)
    if refused:
        raise Refused(refused[0].reason)
    return records


@dataclass(frozen=True)
class RefusedRecord:
    """A record of the store that is no move: edited, unsigned, another key's, copied from elsewhere.
    `after`: the time of the alias's move before it (where a history shows it)."""

    alias: str
    seq: int
    reason: str
    after: str


def audit(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> tuple[list[AliasRecord], list[RefusedRecord]]:
    """(every move of every alias of `name`, oldest first; the records refused among them, each with why)."""
    records: list[AliasRecord] = []
    refused: list[RefusedRecord] = []
    for alias in alias_names(cfg, ctx, name):
        after = ""
        for seq in _seqs(cfg, ctx, _alias_dir(cfg, name, alias)):
            try:
                record = _read(cfg, ctx, name, alias, seq)
            except Refused as e:
                refused.append(RefusedRecord(alias, seq, str(e), after))
                continue
            records.append(record)
            after = record.at
    return sorted(records, key=lambda r: (r.at, r.alias, r.seq)), refused


def append(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str, version: int | None, *, by: str,
           reason: str = "", expect: Any = UNSET, details: dict[str, Any] | None = None,
           attempts: int = 100) -> AliasRecord:
    """The record of `alias` of model `name` pointing at `version` (None: removed), after the newest
    (registry.move_alias calls it, once it has checked that the version is complete).

    `expect`: move only if the alias holds this version now (None: is not set); another mover that
    got there first raises AliasMovedMeanwhile, naming its move, and a newest record that is refused
    (registry_signing.Refused) is refused here too: a decision cannot be based on a forged holder.
    Without it, a lost race is retried on the new newest record, so the recorded `from` is always the
    version really replaced; refused records are moved past, each said in a warning (this is how an
    operator repairs an alias a bucket writer forged): the move's sequence number follows the newest
    record's file, its `from` is the newest record that verifies."""
    check_alias(alias)
    key = registry_signing.signer(cfg.registry.signing_key)  # a bad key is refused before anything is read
    for _ in range(attempts):
        seq, current, refused = _top(cfg, ctx, name, alias, strict=expect is not UNSET)
        held = current.version if current is not None else None
        if expect is not UNSET and held != expect:
            raise AliasMovedMeanwhile(f"{name}@{alias} moved meanwhile: {_describe(current)}; "
                                      f"expected it at {version_label(expect)}")
        if version is None and held is None:
            raise UserError(f"model {name!r} has no alias {alias!r} to delete")
        record = AliasRecord(alias=alias, seq=seq + 1, version=version, previous=held, at=now(), by=by,
                             reason=reason, details=details or {})
        stored = registry_signing.sign_record(key, f"{name}@{alias}", _record_name(seq + 1), record.to_dict())
        if create_once(_record_uri(cfg, name, alias, seq + 1), json.dumps(stored, indent=2).encode(), ctx):
            for why in refused:
                warn(f"{name}@{alias}: moved past a refused record: {why}")
            return record
        # another move took this sequence number: read it and go after it
    raise UserError(f"could not move {name}@{alias} after {attempts} attempts: too many concurrent moves")


def _top(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str,
         strict: bool) -> tuple[int, AliasRecord | None, list[str]]:
    """(the newest record's sequence number, from its file name: 0 for none; the newest record that is not
    refused; why each newer one was). `strict`: the newest refused is raised instead."""
    seqs = _seqs(cfg, ctx, _alias_dir(cfg, name, alias))
    refused: list[str] = []
    for seq in reversed(seqs):
        try:
            return seqs[-1], _read(cfg, ctx, name, alias, seq), refused
        except Refused as e:
            if strict:
                raise
            refused.append(str(e))
    return (seqs[-1] if seqs else 0), None, refused


def version_label(version: int | None) -> str:
    """A version as moves name it: v3, or nothing for an alias not set."""
    return "nothing" if version is None else f"v{version}"


def _describe(record: AliasRecord | None) -> str:
    if record is None:
        return "never set"
    return f"{version_label(record.previous)} -> {version_label(record.version)} at {when(record)} by {record.by}"


def now() -> str:
    """UTC, to the microsecond: records of different aliases sort by it (within one alias, `seq`)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def when(record: AliasRecord) -> str:
    """The record's time to the second, for people."""
    return record.at.split(".", 1)[0] + "Z" if "." in record.at else record.at
