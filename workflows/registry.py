"""The model registry in object storage: `<storage.root>/models/<name>/v<N>/`.

A version holds the serving artifact (safetensors weights, model config, tokenizer) and
`workflows.json` (labels, text columns, metrics, lineage). `workflows.json` is written last, so a
version without it is incomplete (an interrupted upload) and is never listed or served.
Fetched versions are cached on local disk under their unique artifact id, downloaded to a temp
directory and renamed into place.

This module names and writes every file of a version: its claim, its card, its evaluation and the
promotion gate's decision (readers ask it for them); an alias's records are registry_aliases'.
`move_alias` is the one way an alias moves (the gate, `workflows models alias`, the bench): it checks
the version, appends the alias's record and mirrors the move into MLflow's model registry.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from workflows import registry_aliases, registry_signing
from workflows.config import WorkflowConfig, check_name
from workflows.dataset import ProcessedDataset
from workflows.errors import UserError
from workflows.model_card import CARD_FILE, MAX_CARD_BYTES, ModelCard
from workflows.storage.confine import first_error, relative_under, shown
from workflows.storage.create_only import create_once
from workflows.storage.model_cache import cached_dir
from workflows.storage.model_dir import check_tokenizer_files
from workflows.storage.uri import (
    StorageContext,
    download_dir,
    exists,
    filesystem,
    join,
    json_bytes,
    names_under,
    reaching,
    read_bytes,
    read_json,
    write_bytes_atomic,
    write_json,
)
from workflows.tracking.client import Tracker, Warn
from workflows.tracking.model_registry import mirror_alias

CLAIM_FILE = "claim.json"  # a version's first object: which registration writes into it
EVAL_FILE = "evaluation.json"  # its metrics on held-out rows, written after registration
PROMOTION_FILE = "promotion.json"  # the promotion gate's decision for it (workflows.pipeline.promote)
# written beside a version after its registration, or the claim before it: not part of its signature
NOT_SIGNED = (EVAL_FILE, CLAIM_FILE, PROMOTION_FILE)
_VERSION = re.compile(r"^v(\d+)$")


class NotRegistered(UserError):
    """No such model or version; `public`: the same said without where the registry is (an HTTP answer)."""

    def __init__(self, message: str, public: str):
        super().__init__(message)
        self.public = public


@dataclass(frozen=True)
class ModelRef:
    name: str
    version: int
    uri: str


def split_alias(spec: str) -> tuple[str, str | None]:
    """'NAME@ALIAS' -> (NAME, ALIAS); anything else -> (spec, None)."""
    base, at, alias = spec.partition("@")
    return (base, alias) if at else (spec, None)


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'NAME', 'NAME:VERSION' (VERSION as 3 or v3) or 'NAME@ALIAS' (the version an alias holds, read by
    `resolve`: None here); names are validated before becoming paths."""
    base, alias = split_alias(spec)
    name, _, version = base.partition(":")
    try:
        check_name(name, "model name")
    except ValueError as e:
        raise UserError(str(e)) from None
    if alias is not None:
        if version:
            raise UserError(f"{spec!r}: name a version (NAME:3) or an alias (NAME@production), not both")
        registry_aliases.check_alias(alias)
        return name, None
    if not version or version == "latest":
        return name, None
    m = re.fullmatch(r"v?(\d+)", version)
    if not m:
        raise UserError(f"invalid model version {version!r} in {spec!r}: use NAME:3 or NAME:v3")
    return name, int(m.group(1))


def _models_root(cfg: WorkflowConfig) -> str:
    return cfg.uri("models")


def _version_uri(cfg: WorkflowConfig, name: str, version: int) -> str:
    return join(_models_root(cfg), name, f"v{version}")


def versions(cfg: WorkflowConfig, ctx: StorageContext, name: str) -> list[int]:
    uri = join(_models_root(cfg), name)
    return sorted(int(m.group(1)) for n in names_under(uri, ctx)
                  if (m := _VERSION.match(n)) and exists(join(uri, n, CARD_FILE), ctx))


def list_models(cfg: WorkflowConfig, ctx: StorageContext) -> dict[str, list[int]]:
    return {n: v for n in names_under(_models_root(cfg), ctx) if (v := versions(cfg, ctx, n))}


def resolve(cfg: WorkflowConfig, ctx: StorageContext, spec: str) -> ModelRef:
    """The version `spec` names: NAME (the newest), NAME:VERSION, or NAME@ALIAS (the alias's holder now)."""
    name, version = parse_spec(spec)
    available = versions(cfg, ctx, name)
    if not available:
        raise NotRegistered(f"model {name!r} not found in the registry at {_models_root(cfg)}",
                            f"model {name!r} is not registered")
    alias = split_alias(spec)[1]
    if alias is not None:
        version = registry_aliases.holder(cfg, ctx, name, alias)
        if version is None:
            held = registry_aliases.aliases(cfg, ctx, name)
            listed = ", ".join(f"{a}=v{v}" for a, v in held.items()) or "none"
            raise NotRegistered(f"model {name!r} has no alias {alias!r} (aliases: {listed})",
                                f"model {name!r} has no alias {alias!r}")
    if version is None:
        version = available[-1]
    elif version not in available:
        message = f"model {name!r} has no version {version} (available: {', '.join(f'v{v}' for v in available)})"
        raise NotRegistered(message, message)
    return ModelRef(name, version, _version_uri(cfg, name, version))


def register(
    cfg: WorkflowConfig, ctx: StorageContext, local_dir: str, name: str, metadata: ModelCard | Mapping[str, Any]
) -> ModelRef:
    """Upload an exported artifact as the next version of `name`, described by its card.

    The version is claimed first: its CLAIM_FILE is created only where none exists (S3's
    conditional PUT, a local file's O_EXCL), so of registrations racing for one version exactly
    one writes into it and the others move on to the next. A registration that dies after its
    claim leaves that version number unused (never listed: it has no workflows.json)."""
    check_name(name, "model name")
    card = metadata if isinstance(metadata, ModelCard) else ModelCard.model_validate(metadata)
    key = registry_signing.signer(cfg.registry.signing_key)  # a bad key is refused before a version is claimed
    artifact_id = uuid.uuid4().hex
    version = (versions(cfg, ctx, name) or [0])[-1] + 1
    while not create_once(join(_version_uri(cfg, name, version), CLAIM_FILE),
                          json.dumps({"artifact_id": artifact_id}).encode(), ctx):
        version += 1  # another registration holds it
    uri = _version_uri(cfg, name, version)
    card = card.model_copy(update={"name": name, "version": version, "artifact_id": artifact_id,
                                   "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    card_bytes = json_bytes(card.to_dict())
    # signed: every file uploaded and the card, by their digests (registry_signing)
    files = registry_signing.digests(Path(local_dir), skip=(*NOT_SIGNED, CARD_FILE))
    signature = registry_signing.sign(key, f"{name}:v{version}",
                                      {**files, CARD_FILE: hashlib.sha256(card_bytes).hexdigest()})
    fs, path = filesystem(uri, ctx)
    with reaching(uri, ctx):
        for file in files:
            fs.put_file(str(Path(local_dir) / file), f"{path}/{file}")
    write_bytes_atomic(join(uri, registry_signing.SIGNATURE_FILE), signature, ctx)
    write_bytes_atomic(join(uri, CARD_FILE), card_bytes, ctx)  # last: marks the version complete
    return ModelRef(name, version, uri)


def read_card(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef) -> ModelCard:
    """The stored card of `ref`, refused in one line unless the fields that name places (its name,
    version and artifact id: the cache entry) are what register() writes (anyone who can write to
    the bucket can edit the card, and must not choose where a fetch writes), and unless the version's
    signature names these very bytes (registry_signing): a card is believed only as it was registered."""
    uri = join(ref.uri, CARD_FILE)
    raw = read_bytes(uri, ctx, max_bytes=MAX_CARD_BYTES)
    try:
        card = ModelCard.model_validate(json.loads(raw))
    except ValidationError as e:  # a field of the wrong type or size (before json's ValueError: a subclass)
        raise UserError(f"{uri} is not a valid model card: {first_error(e)}") from None
    except ValueError as e:  # not JSON
        raise UserError(f"{uri} is not a valid model card: {str(e).splitlines()[0]}") from None
    if card.artifact_id is None:  # written by every register(); a hand-made version lacks it
        raise UserError(f"{uri} has no artifact_id: register the model again")
    try:
        check_name(card.artifact_id, "artifact_id")
    except ValueError as e:
        raise UserError(f"{uri}: {e}; the card was edited in the store: register the model again") from None
    if (card.name, card.version) != (ref.name, ref.version):
        raise UserError(f"{uri} names model {card.name!r} version {card.version!r}, not the {ref.name!r} "
                        f"v{ref.version} it is stored as; the card was edited in the store: register the model again")
    _card_signed(cfg, ctx, ref, raw)
    return card


def _card_signed(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef, raw: bytes) -> None:
    """The card's bytes `raw` are those the version's signature names (else refused in one line)."""
    subject = f"{ref.name}:v{ref.version}"
    try:
        signature = read_bytes(join(ref.uri, registry_signing.SIGNATURE_FILE), ctx,
                               max_bytes=registry_signing.MAX_SIGNATURE_BYTES)
    except FileNotFoundError:
        if cfg.registry.allow_unsigned:
            return
        raise registry_signing.Refused(registry_signing.unsigned(f"model {subject}")) from None
    signed = registry_signing.signed_digests(signature, subject, cfg.registry.trusted_keys, f"model {subject}")
    if signed.get(CARD_FILE) != hashlib.sha256(raw).hexdigest():
        raise registry_signing.Refused(registry_signing.changed(f"model {subject}", CARD_FILE))


def card_uri(cfg: WorkflowConfig, card: ModelCard) -> str:
    """Where a version's card is stored (as an error message names it)."""
    return join(_models_root(cfg), str(card.name), f"v{card.version}", CARD_FILE)


def lineage_dataset(cfg: WorkflowConfig, ctx: StorageContext, card: ModelCard) -> ProcessedDataset:
    """The processed dataset a version was trained on, as its card's lineage.dataset_uri names it. The
    card is the bucket's: the dataset is read only from under storage.root (plain-name segments), as
    every processed dataset is written; anything else is refused in one line."""
    uri = (card.lineage or {}).get("dataset_uri")
    if not uri:
        raise UserError(f"model {card.name}:v{card.version} records no processed dataset in its lineage; "
                        "evaluate it with --data URI")
    if relative_under(cfg.storage.root, uri) is None:
        raise UserError(f"{card_uri(cfg, card)}: lineage.dataset_uri {shown(uri)} is not under storage.root "
                        f"({cfg.storage.root}): refused (the card was edited in the store; evaluate it with "
                        "--data URI)")
    try:
        return ProcessedDataset.load(uri, ctx)
    except FileNotFoundError:
        raise UserError(f"model {card.name}:v{card.version} was trained on the processed dataset {uri}, which is "
                        "gone (no manifest.json there); evaluate it with --data URI") from None


def fetch(cfg: WorkflowConfig, ctx: StorageContext, spec: str) -> tuple[str, ModelCard]:
    """Local directory holding the model version (downloaded once per node), and its card."""
    ref = resolve(cfg, ctx, spec)
    card = read_card(cfg, ctx, ref)
    assert card.artifact_id is not None  # read_card refuses a card without one

    what = f"model {ref.name}:v{ref.version}"

    filled = []

    def fill(tmp: str) -> None:
        found = download_dir(ref.uri, ctx, tmp, skip=NOT_SIGNED)
        _verified(cfg, Path(tmp), ref, card, found)  # nothing refused enters the cache
        check_tokenizer_files(tmp, what)
        filled.append(tmp)

    local = cached_dir(Path(cfg.cache.resolved_dir()) / "models", card.artifact_id, fill)
    if not filled:  # cached before: checked again (an entry cached unsigned, or changed on this node)
        _verified(cfg, Path(local), ref, card)
    return check_tokenizer_files(local, what), card


def _verified(cfg: WorkflowConfig, folder: Path, ref: ModelRef, card: ModelCard,
              found: dict[str, str] | None = None) -> None:
    """The version's files in `folder` are those its signature names (registry_signing.verify; `found`: their
    digests as downloaded), and its card there is the card the caller read from the store (else the store's
    changed meanwhile)."""
    subject = f"{ref.name}:v{ref.version}"
    registry_signing.verify(folder, subject, cfg.registry.trusted_keys, cfg.registry.allow_unsigned, found)
    try:
        here = ModelCard.model_validate(json.loads((folder / CARD_FILE).read_text()))
    except (OSError, ValueError, ValidationError):
        here = None
    if here is None or here.to_dict() != card.to_dict():
        raise registry_signing.Refused(f"model {subject}: its {CARD_FILE} in the store is not the one it was "
                                       "registered (and signed) with: refused")


def write_evaluation(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef, metrics: dict) -> None:
    """Evaluation runs after registration (actors fetch the model from the registry), so its
    metrics are stored beside the version rather than inside workflows.json, signed (_write_record)."""
    _write_record(cfg, ctx, ref, EVAL_FILE, metrics)


def write_promotion(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef, decision: dict) -> None:
    """The promotion gate's decision on the version, beside it, signed: its card shows it (`model_card`)."""
    _write_record(cfg, ctx, ref, PROMOTION_FILE, decision)


def _write_record(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef, file: str, content: dict) -> None:
    key = registry_signing.signer(cfg.registry.signing_key)
    write_json(join(ref.uri, file), registry_signing.sign_record(key, f"{ref.name}:v{ref.version}", file, content),
               ctx)


def model_card(cfg: WorkflowConfig, ctx: StorageContext, spec: str) -> ModelCard:
    """The card of a version, with its evaluation metrics and the promotion gate's decision when there are any."""
    ref = resolve(cfg, ctx, spec)
    found = read_card(cfg, ctx, ref)
    for key, file in (("metrics", EVAL_FILE), ("promotion", PROMOTION_FILE)):
        if exists(join(ref.uri, file), ctx):
            found = found.model_copy(update={key: read_record(cfg, ctx, ref, file)})
    return found


def read_record(cfg: WorkflowConfig, ctx: StorageContext, ref: ModelRef, file: str) -> dict[str, Any]:
    """A version's evaluation or promotion record (`file`): a JSON object within the lifecycle records' bound
    (registry_aliases.MAX_RECORD_BYTES) whose signature verifies (registry_signing.verified_record), else
    refused in one line naming the file (every replica reads both at its start: a huge or mistyped one must
    not put replicas in a restart loop, nor reach a reader that expects an object)."""
    uri = join(ref.uri, file)
    try:
        value = read_json(uri, ctx, max_bytes=registry_aliases.MAX_RECORD_BYTES)
    except ValueError as e:  # not JSON
        raise UserError(f"{uri} is not valid JSON ({str(e).splitlines()[0]}): refused; the file was "
                        "edited in the store") from None
    if not isinstance(value, dict):
        raise UserError(f"{uri} holds a JSON {type(value).__name__}, not an object: refused; the file was edited "
                        "in the store")
    return registry_signing.verified_record(value, f"{ref.name}:v{ref.version}", file, cfg.registry.trusted_keys,
                                            cfg.registry.allow_unsigned, uri)


def describe(cfg: WorkflowConfig, ctx: StorageContext, spec: str) -> dict[str, Any]:
    """`model_card` as its JSON object: the keys stored, extras included."""
    return model_card(cfg, ctx, spec).to_dict()


def move_alias(cfg: WorkflowConfig, ctx: StorageContext, name: str, alias: str, version: int | None, *, by: str,
               reason: str = "", expect: Any = registry_aliases.UNSET, details: dict[str, Any] | None = None,
               tracker: Tracker | None = None, warn: Warn | None = None) -> registry_aliases.AliasRecord:
    """Point `alias` of model `name` at the complete `version` (None: remove it): the alias's new
    record (registry_aliases.append: `expect` makes the move conditional on the holder, as the gate
    does), then the same alias in MLflow's model registry where tracking is on (on `tracker`, the
    command's tracking session's when it has one; tracking.model_registry.mirror_alias)."""
    registry_aliases.check_alias(alias)
    uri = _version_uri(cfg, name, version) if version is not None else None
    if uri is not None and not exists(join(uri, CARD_FILE), ctx):  # its card is written last
        raise UserError(f"model {name!r} has no version {version} to alias as {alias!r}")
    record = registry_aliases.append(cfg, ctx, name, alias, version, by=by, reason=reason, expect=expect,
                                     details=details)
    mirror_alias(cfg, name, alias, record.version, uri, tracker=tracker, warn=warn)
    return record
