"""The cases of store_hostile_objects (reliability.store_hostile runs them): every object the platform
reads back from the store, each field it reads set to what a bucket writer could put there.

A field that names a place (a file, a folder, a dataset, a base model, a module) gets each of
PLACE_VARIANTS: a path escaping the place it must lie under, a foreign URI (another bucket at the
canary S3 endpoint; an http:// URL of the canary server), an absolute path outside everything the
config names, a huge value and a wrong type. A field that holds data (labels, counts, numbers of a
LoRA adapter) gets the two that apply to data: a huge value and a wrong type (a label "../x" is a
label; no place is made of it). Each case must be refused in one line.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

PLACE_VARIANTS = ("escaping path", "foreign URI (s3)", "foreign URI (http)", "absolute path", "huge value",
                  "wrong type")
DATA_VARIANTS = ("huge value", "wrong type")
HUGE = (1 << 20) + 1  # characters: over every bound the platform sets on a name read from the store
CANARY_BUCKET = "canary"


@dataclass(frozen=True)
class Case:
    obj: str  # the object, as the store holds it
    field: str
    variant: str
    run: Callable[[], Any]  # sets the object up with the field's value, then reads it as the platform does
    serving: bool = False  # read by the served replica: it must answer the base model as before after it


def place(variant: str, env, name: str, under: str, uri: bool = True) -> Any:
    """A value of `variant` for a field that names `name`: `under` is the folder (or URI) the field's
    name must lie under; `uri`: the field holds a URI or path (else a name relative to `under`)."""
    target = env.outside / name
    rel = os.path.relpath(target, under.removeprefix("file://"))  # ../../outside/NAME
    return {"escaping path": f"{under}/{rel}" if uri else rel,
            "foreign URI (s3)": f"s3://{CANARY_BUCKET}/{name}",
            "foreign URI (http)": f"{env.http}/{name}",
            "absolute path": str(target),
            "huge value": "a" * HUGE,
            "wrong type": 12345}[variant]


def data(variant: str, huge: Any, wrong: Any = ("a", "list")) -> Any:
    """A value of `variant` for a field that holds data: `huge` over the field's bound, `wrong` of
    another JSON type (a tuple stands for a list)."""
    return {"huge value": huge, "wrong type": list(wrong) if isinstance(wrong, tuple) else wrong}[variant]


def put(doc: dict, dotted: str, value: Any) -> None:
    """doc[a][b][0] = value for dotted "a.b.0"."""
    keys = dotted.split(".")
    for k in keys[:-1]:
        doc = doc[int(k)] if isinstance(doc, list) else doc[k]
    last = keys[-1]
    if isinstance(doc, list):
        doc[int(last)] = value
    else:
        doc[last] = value


def edit_json(path: Path, dotted: str, value: Any) -> None:
    doc = json.loads(path.read_text())
    put(doc, dotted, value)
    path.write_text(json.dumps(doc))


# --- the objects ------------------------------------------------------------------------------------
def card_cases(env) -> list[Case]:
    """A registered version's workflows.json: fetch (its name, version and artifact id name the cache
    entry), evaluate --split (lineage.dataset_uri), a chat adapter's base (base.name_or_path), the
    task it is served by (task), its labels. On a version registered unsigned, read with
    registry.allow_unsigned: the checks behind the signature (signature_cases: an edited card is refused
    by its version's signature first)."""
    from workflows import registry
    from workflows.tasks import task_for_card
    from workflows.tasks.chat.training.model import card_base_dir

    root = env.cfg.storage.root
    cfg, chat_cfg = (c.model_copy(update={"registry": c.registry.model_copy(update={"allow_unsigned": True})})
                     for c in (env.cfg, env.chat_cfg))

    def fetch(spec):
        registry.fetch(cfg, env.ctx, spec)

    def dataset(spec):
        registry.lineage_dataset(cfg, env.ctx, registry.model_card(cfg, env.ctx, spec))

    def base(spec):
        card_base_dir(registry.model_card(chat_cfg, env.ctx, spec), chat_cfg)

    def task(spec):
        task_for_card(cfg, registry.model_card(cfg, env.ctx, spec))

    fields: list[tuple[str, tuple[str, ...], Callable, Callable[[str], Any]]] = [
        ("artifact_id", PLACE_VARIANTS, fetch, lambda v: place(v, env, "model", env.cache_models, uri=False)),
        ("name", PLACE_VARIANTS, fetch, lambda v: place(v, env, "model", f"{root}/models", uri=False)),
        ("version", PLACE_VARIANTS, fetch, lambda v: place(v, env, "v1", f"{root}/models/m", uri=False)),
        ("lineage.dataset_uri", PLACE_VARIANTS, dataset, lambda v: place(v, env, "dataset", f"{root}/processed")),
        ("base.name_or_path", PLACE_VARIANTS, base, lambda v: place(v, env, "base", f"{root}/models")),
        ("task", PLACE_VARIANTS, task, lambda v: place(v, env, "task.py", f"{root}/models", uri=False)),
        ("labels", DATA_VARIANTS, fetch, lambda v: data(v, ["a" * HUGE, "b"], wrong="ab")),
        ("text_columns", DATA_VARIANTS, fetch, lambda v: data(v, ["a" * HUGE], wrong="ab")),
    ]
    cases = []
    for field, variants, read, value in fields:
        for variant in variants:
            def run(field=field, read=read, value=value(variant)):
                spec, card = env.fresh_model()
                (card.parent / "model.sig").unlink()  # as a version registered before signing
                edit_json(card, field, value)
                read(spec)

            cases.append(Case("card (workflows.json)", field, variant, run))
    return cases


def manifest_cases(env) -> list[Case]:
    """A processed dataset's manifest.json: its files (training, evaluation, Workflow.rows), its
    tokenizer (which must be the config's), the fields read as data."""
    from workflows.dataset import ProcessedDataset
    from workflows.tasks import get_task

    def load(uri):
        ProcessedDataset.load(uri, env.ctx)

    def tokenizer(uri):
        get_task(env.cfg).dataset.tokenizer_of(ProcessedDataset.load(uri, env.ctx))

    fields: list[tuple[str, tuple[str, ...], Callable, Callable[[str, str], Any]]] = [
        ("files.train.0", PLACE_VARIANTS, load, lambda v, uri: place(v, env, "secret.parquet", uri)),
        ("files.test.0", PLACE_VARIANTS, load, lambda v, uri: place(v, env, "secret.parquet", f"{uri}/split=test")),
        ("tokenizer", PLACE_VARIANTS, tokenizer, lambda v, uri: place(v, env, "tokenizer", uri)),
        # not followed: the files are read where the manifest is
        ("uri", DATA_VARIANTS, load, lambda v, uri: data(v, "a" * HUGE)),
        ("labels", DATA_VARIANTS, load, lambda v, uri: data(v, ["a" * HUGE], wrong="ab")),
        ("label_column", DATA_VARIANTS, load, lambda v, uri: data(v, "a" * HUGE)),
        ("max_length", DATA_VARIANTS, load, lambda v, uri: data(v, 10**30)),
        ("counts", DATA_VARIANTS, load, lambda v, uri: data(v, {"train": 10**30})),
    ]
    cases = []
    for field, variants, read, value in fields:
        for variant in variants:
            def run(field=field, read=read, value=value, variant=variant):
                uri = env.fresh_dataset()
                edit_json(Path(uri) / "manifest.json", field, value(variant, uri))
                read(uri)

            cases.append(Case("processed dataset (manifest.json)", field, variant, run))
    return cases


def tokenizer_cases(env) -> list[Case]:
    """A registered model's tokenizer_config.json: the keys that name its files."""
    from workflows import registry

    cases = []
    for field in ("vocab_file", "tokenizer_file", "merges_file"):
        for variant in PLACE_VARIANTS:
            def run(field=field, variant=variant):
                spec, card = env.fresh_model()
                edit_json(card.parent / "tokenizer_config.json", field,
                          place(variant, env, "vocab.txt", str(env.cache_models), uri=False))
                registry.fetch(env.cfg, env.ctx, spec)

            cases.append(Case("tokenizer (tokenizer_config.json)", field, variant, run))
    return cases


def adapter_cases(env) -> list[Case]:
    """A LoRA adapter a request names (adapter_config.json, adapter_model.safetensors), loaded by the
    served replica's multiplexed loader: refused as a 404, the base answering as before."""
    places = {"target_modules": lambda v: [place(v, env, "q_proj", env.tiny, uri=False)] if v != "wrong type"
              else 12345,
              "modules_to_save": lambda v: [place(v, env, "lm_head", env.tiny, uri=False)],
              "megatron_core": lambda v: place(v, env, "megatron.py", env.tiny, uri=False),
              # not read: the base is the served one, checked by the sha256 its card names
              "base_model_name_or_path": None}
    numbers = {"r": ("a" * HUGE, "4"), "lora_alpha": (1e30, "16"), "lora_dropout": (1e30, "0.1"),
               "peft_type": ("a" * HUGE, 7), "task_type": ("a" * HUGE, 7), "bias": ("a" * HUGE, 7)}
    cases = []
    for field, value in places.items():
        if value is None:
            continue
        for variant in PLACE_VARIANTS:
            cases.append(_adapter_case(env, field, variant, value(variant)))
    for field, (huge, wrong) in numbers.items():
        for variant in PLACE_VARIANTS:  # a path where a number or a name belongs is one more wrong value
            if variant == "huge value":
                v = huge
            elif variant == "wrong type":
                v = wrong
            else:
                v = place(variant, env, field, env.tiny, uri=False)
            cases.append(_adapter_case(env, field, variant, v))
    for variant in PLACE_VARIANTS[:-1]:  # a weight's name: a key of the safetensors header, always a string
        key = place(variant, env, "x", env.tiny, uri=False) + ".lora_A.weight"
        cases.append(Case("LoRA adapter (adapter_model.safetensors)", "a weight's name", variant,
                          partial(env.load_adapter, weights_key=key), serving=True))
    return cases


def _adapter_case(env, field: str, variant: str, value: Any) -> Case:
    return Case("LoRA adapter (adapter_config.json)", field, variant, partial(env.load_adapter, config={field: value}),
                serving=True)


def checkpoint_cases(env) -> list[Case]:
    """A training checkpoint (resumed, exported for registration): the files .metadata's entries name,
    and train_state.json's list of the checkpoint's files."""
    from workflows.train import checkpoint

    def metadata(value):
        directory = env.fresh_checkpoint()
        with open(directory / checkpoint.METADATA_FILE, "rb") as f:
            meta = checkpoint.read_metadata(f)
        for info in meta.storage_data.values():
            info.relative_path = value
        with open(directory / checkpoint.METADATA_FILE, "wb") as f:
            pickle.dump(meta, f)
        # train_state.json lists the new size too, as a writer who replaced .metadata would make it
        state = json.loads((directory / checkpoint.STATE_FILE).read_text())
        state["files"][checkpoint.METADATA_FILE] = (directory / checkpoint.METADATA_FILE).stat().st_size
        (directory / checkpoint.STATE_FILE).write_text(json.dumps(state))
        checkpoint.consolidated_model_state(str(directory))

    def state(value):
        directory = env.fresh_checkpoint()
        edit_json(directory / checkpoint.STATE_FILE, "files", value)
        checkpoint.check_complete(str(directory))

    cases = []
    for variant in PLACE_VARIANTS:
        value = place(variant, env, "shard.distcp", str(env.checkpoint), uri=False)
        cases.append(Case("training checkpoint (.metadata)", "storage entry's file", variant, partial(metadata, value)))
        names = {"wrong type": ["a", "list"], "huge value": {"a" * HUGE: 1}}.get(variant, {value: 1})
        cases.append(Case("training checkpoint (train_state.json)", "files", variant, partial(state, names)))
    return cases


def trial_state_cases(env) -> list[Case]:
    """A search's tuner.pkl (`tune --resume`; Ray Tune unpickles it): replaced in the store, or not the
    plain file this user's `tune` wrote."""
    from workflows.tune.state import MAX_TUNER_PKL_BYTES

    def replaced(path: Path) -> None:
        path.write_bytes(pickle.dumps(Payload(str(env.outside / "ran"))))

    def escaping(path: Path) -> None:
        path.unlink()
        path.symlink_to(os.path.relpath(env.outside / "tuner.pkl", path.parent))

    def absolute(path: Path) -> None:
        path.unlink()
        path.symlink_to(env.outside / "tuner.pkl")

    def huge(path: Path) -> None:
        with open(path, "wb") as f:
            f.truncate(MAX_TUNER_PKL_BYTES + 1)  # sparse

    def wrong_type(path: Path) -> None:
        path.unlink()
        path.mkdir()

    cases = []
    for variant, change in (("a pickle that runs code", replaced), ("escaping path", escaping),
                            ("absolute path", absolute), ("huge value", huge), ("wrong type", wrong_type)):
        def run(change=change):
            uri, path = env.fresh_search()
            change(path)
            env.check_tuner_state(uri)

        cases.append(Case("search state (tuner.pkl)", "tuner.pkl", variant, run))
    return cases


def lifecycle_cases(env) -> list[Case]:
    """The lifecycle's records: a version's evaluation.json and promotion.json (read with its card by every
    reader: serve's replicas, evaluate, `models history`), each whole record huge or of another JSON type, a
    field forged (the gate's verdict, a metric), its signature removed or another version's record copied in;
    an alias record (aliases/<alias>/<seq>.json), read by resolving NAME@ALIAS and by the gate's conditional
    move (after which a plain move, the operator's repair, must land past it and show in the history): its
    seq and alias another place's (a forged seq would send the next move where no listing reads it), huge or
    of another type, its version huge or of another type, who moved it, why and when forged, its signature
    removed or another key's, another model's record copied in, the whole record of another type."""
    from workflows import registry, registry_aliases, registry_signing
    from workflows.errors import UserError

    def version_record(file: str, variant: str) -> None:
        spec, card = env.fresh_model()
        ref = registry.resolve(env.cfg, env.ctx, spec)
        if variant in DATA_VARIANTS:
            (card.parent / file).write_text(json.dumps(data(variant, {"reason": "a" * HUGE})))
        else:
            write = registry.write_evaluation if file == registry.EVAL_FILE else registry.write_promotion
            write(env.cfg, env.ctx, ref, {"promoted": False, "reason": "does not beat v1", "f1": 0.5})
            forged = {"forged field": lambda d: {**d, "promoted": True, "f1": 0.99},
                      "unsigned": lambda d: {k: v for k, v in d.items() if k != registry_signing.RECORD_SIGNATURE},
                      "another version's": lambda d: env.other_version_record(file)}[variant]
            (card.parent / file).write_text(json.dumps(forged(json.loads((card.parent / file).read_text()))))
        registry.model_card(env.cfg, env.ctx, spec)

    def alias_record(field: str | None, value: Any, read: str) -> None:
        spec, card = env.fresh_model()
        name, version = spec.split(":")
        alias = f"a{next(env.count)}"  # an alias of its own: a forged record stays in its place
        path = card.parent.parent / "aliases" / alias / "00000001.json"
        if field == "by another key":  # a writer with a key of their own writes the move
            registry.move_alias(env.writer_cfg(), env.ctx, name, alias, int(version), by="mallory")
        elif field == "another model's":
            other = env.other_alias_record(alias, int(version))
            path.parent.mkdir(parents=True)
            path.write_text(other)
        else:
            registry.move_alias(env.cfg, env.ctx, name, alias, int(version), by="reliability")
        if field is None:
            path.write_text(json.dumps(value))
        elif field == "signature":
            path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != field}))
        elif field not in ("by another key", "another model's"):
            edit_json(path, field, value)
        if read == "resolve":
            registry.fetch(env.cfg, env.ctx, f"{name}@{alias}")
            return
        try:  # the gate's conditional move refuses it ...
            registry.move_alias(env.cfg, env.ctx, name, alias, None, by="the gate", expect=int(version))
        except UserError as refused:  # ... and a plain move (the operator's repair) lands after it, in the history
            record = registry.move_alias(env.cfg, env.ctx, name, alias, int(version), by="the operator")
            moves, refusals = registry_aliases.audit(env.cfg, env.ctx, name)
            if (record.seq, alias) not in [(m.seq, m.alias) for m in moves] or \
                    (1, alias) not in [(r.seq, r.alias) for r in refusals] or \
                    registry.resolve(env.cfg, env.ctx, f"{name}@{alias}").version != int(version):
                raise AssertionError(f"the move after the refused record of {name}@{alias} did not land") from None
            raise refused

    cases = []
    for file in ("evaluation.json", "promotion.json"):
        for variant in (*DATA_VARIANTS, "forged field", "unsigned", "another version's"):
            cases.append(Case(f"version record ({file})", "the record", variant,
                              partial(version_record, file, variant)))
    fields: list[tuple[str | None, str, Any]] = [
        ("seq", "another place's", 99999999), ("seq", "huge value", float("inf")), ("seq", "wrong type", ["1"]),
        ("alias", "another place's", "production"), ("alias", "huge value", "a" * HUGE),
        ("alias", "wrong type", ["a", "list"]), ("version", "huge value", 10**30), ("version", "wrong type", "1"),
        ("by", "forged signer", "alice"), ("reason", "forged reason", "approved by the gate"),
        ("at", "forged time", "2020-01-01T00:00:00.000000Z"), ("signature", "removed", None),
        ("by another key", "signed", None), ("another model's", "copied in", None),
        (None, "wrong type", ["a", "list"]),
    ]
    for field, variant, value in fields:
        for read in ("resolve", "move"):
            cases.append(Case(f"alias record ({read})", field or "the record", variant,
                              partial(alias_record, field, value, read)))
    return cases


def signature_cases(env) -> list[Case]:
    """A signed version (registry_signing) changed in the store: each kind of file changed (weights, tokenizer,
    card), a file added or removed, the signature removed or replaced by another key's over the changed
    files, the whole version copied under another name; read as every reader loads a version (fetch)."""
    from workflows import registry, registry_signing

    def resign(v: Path) -> None:  # a writer with a key of their own signs the files as they now are
        (v / "model.safetensors").write_bytes(b"other weights")
        key = env.workdir / "writer-key.pem"
        if not key.exists():
            key.write_bytes(registry_signing.new_private_key())
        files = registry_signing.digests(v, skip=registry.NOT_SIGNED)
        signature = registry_signing.sign(registry_signing.signer(str(key)), "m", files)
        (v / registry_signing.SIGNATURE_FILE).write_bytes(signature)

    def copied(v: Path) -> Path:
        other = v.parent.parent / f"copy{next(env.count)}"
        shutil.copytree(v, other / "v1")
        return other

    edits: list[tuple[str, str, Callable[[Path], Any]]] = [
        ("model.safetensors", "changed", lambda v: (v / "model.safetensors").write_bytes(b"other weights")),
        ("tokenizer_config.json", "changed", lambda v: edit_json(v / "tokenizer_config.json", "model_max_length", 9)),
        ("workflows.json", "changed", lambda v: edit_json(v / "workflows.json", "labels", ["b", "a"])),
        ("a new file", "added", lambda v: (v / "added.py").write_text("print('ran')")),
        ("vocab.txt", "removed", lambda v: (v / "vocab.txt").unlink()),
        ("model.sig", "removed", lambda v: (v / registry_signing.SIGNATURE_FILE).unlink()),
        ("model.sig", "another key's", resign),
    ]
    cases = []
    for field, variant, edit in edits:
        def run(edit=edit):
            spec, card = env.fresh_model()
            edit(card.parent)
            registry.fetch(env.cfg, env.ctx, spec)

        cases.append(Case("signed version", field, variant, run))

    def copy_run():
        spec, card = env.fresh_model()
        registry.fetch(env.cfg, env.ctx, f"{copied(card.parent).name}:1")

    cases.append(Case("signed version", "the whole version", "copied under another name", copy_run))
    return cases


class Payload:
    """What a bucket writer would put in a pickle: code run when it is loaded (it creates a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# `python -m reliability --fast` (and `make test`): the objects read without a model; the full run adds
# the LoRA adapters, loaded by the serving predictor of a tiny chat model (about a minute more)
FAST = (card_cases, manifest_cases, tokenizer_cases, checkpoint_cases, trial_state_cases, lifecycle_cases,
        signature_cases)
ALL = (*FAST, adapter_cases)


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
