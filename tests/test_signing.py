"""Signed versions (workflows.registry_signing): registration signs a version's files and card with
model-signing; `registry.fetch`, the one way evaluate, serve and its replicas, predict, the alias follower
and a chat adapter's base load a version, refuses a changed, added or missing file, an unsigned version
and a signature by another key, in one line naming the model and the file, before anything enters the
cache. On a local store and the embedded S3 endpoint; no Ray."""

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from tests.test_registry_aliases import CARD, store
from workflows import registry, registry_signing
from workflows.errors import UserError
from workflows.model_card import CARD_FILE
from workflows.registry_signing import SIGNATURE_FILE


def pair(folder: Path, name: str) -> tuple[str, str]:
    """(private, public) PEM paths of a new EC key pair."""
    private = registry_signing.new_private_key()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.pem").write_bytes(private)
    (folder / f"{name}.pub.pem").write_bytes(registry_signing.public_key_of(private))
    return str(folder / f"{name}.pem"), str(folder / f"{name}.pub.pem")


def signed_by(cfg, key: str, trusted: list[str]):
    return cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"signing_key": key,
                                                                              "trusted_keys": trusted})})


def register_one(cfg, ctx, tmp_path: Path, name: str = "m") -> Path:
    art = tmp_path / f"art-{name}"
    art.mkdir(exist_ok=True)
    (art / "model.safetensors").write_bytes(b"weights" * 1000)
    (art / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8}))
    (art / "vocab.txt").write_text("a\nb\n")
    return Path(registry.register(cfg, ctx, str(art), name, CARD).uri)


def refused(cfg, ctx, spec: str, match: str) -> str:
    with pytest.raises(UserError, match=match) as e:
        registry.fetch(cfg, ctx, spec)
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    return message


TAMPER = {
    "weights changed": (lambda v: (v / "model.safetensors").write_bytes(b"WEIGHTS" * 1000),
                        "model.safetensors changed after the version was signed"),
    "tokenizer changed": (lambda v: (v / "tokenizer_config.json").write_text('{"model_max_length": 9}'),
                          "tokenizer_config.json changed after"),
    "card changed": (lambda v: (v / CARD_FILE).write_text(
        json.dumps({**json.loads((v / CARD_FILE).read_text()), "labels": ["b", "a"]})), "workflows.json changed after"),
    "file added": (lambda v: (v / "extra.py").write_text("print('hi')"), "extra.py was added after"),
    "file removed": (lambda v: (v / "vocab.txt").unlink(), "vocab.txt is signed but missing"),
    "signature removed": (lambda v: (v / SIGNATURE_FILE).unlink(), "is not signed .*registry.allow_unsigned=true"),
    "signature garbage": (lambda v: (v / SIGNATURE_FILE).write_text("{}"), "model.sig (is not a signature|does not)"),
}


@pytest.mark.parametrize("tamper", list(TAMPER))
def test_a_version_changed_in_the_store_is_refused_before_it_is_cached(tmp_path, tamper):
    change, match = TAMPER[tamper]
    with store(tmp_path, "local") as (cfg, ctx):
        private, public = pair(tmp_path / "keys", "team")
        cfg = signed_by(cfg, private, [public])
        version = register_one(cfg, ctx, tmp_path)
        assert (version / SIGNATURE_FILE).is_file()
        change(version)
        message = refused(cfg, ctx, "m:1", match)
        assert message.startswith("model m:v1") and str(tmp_path) not in message.replace(str(version), "")
        assert not list((Path(cfg.cache.resolved_dir()) / "models").glob("[!.]*"))  # nothing refused was cached


def test_a_signed_version_loads_on_both_stores_and_a_change_after_caching_is_caught(tmp_path):
    for kind in ("s3", "local"):
        with store(tmp_path / kind, kind) as (cfg, ctx):
            private, public = pair(tmp_path / kind / "keys", "team")
            cfg = signed_by(cfg, private, [public])
            (tmp_path / kind).mkdir(exist_ok=True)
            register_one(cfg, ctx, tmp_path / kind)
            local, card = registry.fetch(cfg, ctx, "m:1")
            assert (Path(local) / "model.safetensors").read_bytes() == b"weights" * 1000 and card.version == 1
            assert registry.fetch(cfg, ctx, "m:1")[0] == local  # a cache hit, checked again
            (Path(local) / "model.safetensors").write_bytes(b"changed on this node")
            refused(cfg, ctx, "m:1", "model.safetensors changed after the version was signed")


def test_another_key_and_unsigned_versions(tmp_path, monkeypatch):
    with store(tmp_path, "local") as (cfg, ctx):
        team_private, team_public = pair(tmp_path / "keys", "team")
        other_private, other_public = pair(tmp_path / "keys", "other")
        register_one(signed_by(cfg, other_private, [other_public]), ctx, tmp_path)
        refused(signed_by(cfg, team_private, [team_public]), ctx, "m:1", "signed by a key that is not in "
                "registry.trusted_keys")
        # several trusted keys: any one verifies; a key from the environment (a mounted secret's PEM)
        monkeypatch.setenv("OTHER_PUBLIC_PEM", Path(other_public).read_text())
        assert registry.fetch(signed_by(cfg, team_private, [team_public, "env:OTHER_PUBLIC_PEM"]), ctx, "m:1")
        refused(signed_by(cfg, team_private, ["env:NOT_SET_HERE"]), ctx, "m:1", "NOT_SET_HERE, which is not set")
        # an unsigned version (registered before signing): refused unless registry.allow_unsigned
        version = register_one(signed_by(cfg, team_private, [team_public]), ctx, tmp_path)
        (version / SIGNATURE_FILE).unlink()
        trusted = signed_by(cfg, team_private, [team_public])
        refused(trusted, ctx, "m:2", "is not signed")
        allowing = trusted.model_copy(update={"registry": trusted.registry.model_copy(update={"allow_unsigned": True})})
        assert registry.fetch(allowing, ctx, "m:2")[1].version == 2
        # allow_unsigned loads no changed file of a signed version (a node that has not cached it yet)
        (tmp_path / "store/models/m/v1/vocab.txt").write_text("c\n")
        fresh_node = allowing.model_copy(update={
            "registry": allowing.registry.model_copy(update={"trusted_keys": [other_public]}),
            "cache": allowing.cache.model_copy(update={"dir": str(tmp_path / "another-node")})})
        refused(fresh_node, ctx, "m:1", "vocab.txt changed after")


def test_a_signed_version_copied_under_another_name_is_refused(tmp_path):
    with store(tmp_path, "local") as (cfg, ctx):
        private, public = pair(tmp_path / "keys", "team")
        cfg = signed_by(cfg, private, [public])
        version = register_one(cfg, ctx, tmp_path)
        register_one(cfg, ctx, tmp_path, name="n")
        shutil.rmtree(tmp_path / "store/models/n/v1")
        shutil.copytree(version, tmp_path / "store/models/n/v1")
        with pytest.raises(UserError, match="names model 'm' version 1, not the 'n' v1"):
            registry.fetch(cfg, ctx, "n:1")


def test_the_auto_key_pair_is_made_once_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    private, public = registry_signing.auto_key_pair()
    assert private.parent == tmp_path / "config" / "workflows" / "signing"
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600 and b"PRIVATE KEY" in private.read_bytes()
    first = private.read_bytes()
    assert registry_signing.auto_key_pair() == (private, public) and private.read_bytes() == first  # made once
    with store(tmp_path, "local") as (cfg, ctx):  # the defaults: signed and verified with it, no setup
        assert (cfg.registry.signing_key, cfg.registry.trusted_keys) == ("auto", ["auto"])
        register_one(cfg, ctx, tmp_path)
        assert registry.fetch(cfg, ctx, "m:1")[1].version == 1


def test_auto_reads_the_keys_a_clusters_pods_get_from_a_secret(tmp_path, monkeypatch):
    """registry.signing_key/trusted_keys `auto` read WORKFLOWS_SIGNING_KEY / WORKFLOWS_SIGNING_PUBLIC_KEY where
    set (cluster/kuberay: the Secret workflows-signing), so every pod signs and verifies with one pair."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    private, public = pair(tmp_path / "keys", "cluster")
    monkeypatch.setenv("WORKFLOWS_SIGNING_KEY", Path(private).read_text())
    monkeypatch.setenv("WORKFLOWS_SIGNING_PUBLIC_KEY", Path(public).read_text())
    with store(tmp_path, "local") as (cfg, ctx):
        register_one(cfg, ctx, tmp_path)
        assert registry.fetch(signed_by(cfg, "auto", [public]), ctx, "m:1")  # signed with the Secret's key
        monkeypatch.delenv("WORKFLOWS_SIGNING_PUBLIC_KEY")
        refused(signed_by(cfg, "auto", ["auto"]).model_copy(update={"cache": cfg.cache.model_copy(
            update={"dir": str(tmp_path / "other-node")})}), ctx, "m:1", "not in registry.trusted_keys")


def test_a_key_that_is_not_one_is_refused_naming_its_field_and_no_version_is_claimed(tmp_path):
    with store(tmp_path, "local") as (cfg, ctx):
        bad = tmp_path / "bad.pem"
        bad.write_text("not a key\n")
        private, public = pair(tmp_path / "keys", "team")
        with pytest.raises(UserError, match=r"registry.signing_key: .*bad.pem is not an EC private key in PEM"):
            register_one(signed_by(cfg, str(bad), [public]), ctx, tmp_path)
        assert registry.versions(cfg, ctx, "m") == [] and not (tmp_path / "store/models/m/v1").exists()
        register_one(signed_by(cfg, private, [public]), ctx, tmp_path)
        refused(signed_by(cfg, private, [str(bad)]), ctx, "m:1",
                r"registry.trusted_keys: .*bad.pem is not an EC public key in PEM")


def forge(path: Path, **changes) -> None:
    """What a writer to the bucket can do to a stored record: change its fields, keeping its signature."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def one_line(attempt, match: str) -> str:
    with pytest.raises(UserError, match=match) as e:
        attempt()
    assert len(str(e.value).splitlines()) == 1, e.value
    return str(e.value)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_alias_moves_are_signed_and_a_forged_move_is_refused_naming_its_file(tmp_path, kind):
    """Each move of an alias carries its mover's signature: a move a bucket writer edits (where the alias
    points, who moved it, why, when), writes with another key or copies from another model or place, is
    refused in one line naming its file by resolving and by the gate's conditional move, and shown refused
    in the history; serving then follows nothing."""
    from workflows.registry_history import model_history

    with store(tmp_path, kind) as (cfg, ctx):
        private, public = pair(tmp_path / "keys", "team")
        cfg = signed_by(cfg, private, [public])
        for name in ("m", "m", "m", "n"):
            register_one(cfg, ctx, tmp_path, name)
        registry.move_alias(cfg, ctx, "m", "production", 1, by="the gate", reason="first")
        registry.move_alias(cfg, ctx, "n", "production", 1, by="the gate")
        assert registry.resolve(cfg, ctx, "m@production").version == 1
        if kind == "s3":  # the record as stored on the endpoint carries its signature
            stored = registry_aliases_record(cfg, ctx, "m", "production", 1)
            assert stored["version"] == 1 and "signature" in stored
            return
        place = tmp_path / "store/models/m/aliases/production"
        first = place / "00000001.json"
        pristine = first.read_text()
        other_private, _ = pair(tmp_path / "keys", "other")
        for tamper, match in (
                (lambda: forge(first, version=3), "changed after it was signed"),  # where it points
                (lambda: forge(first, by="alice", reason="approved", at="2020-01-01T00:00:00.000000Z"),
                 "changed after it was signed"),  # who, why, when
                (lambda: first.write_text(json.dumps({k: v for k, v in json.loads(pristine).items()
                                                      if k != "signature"})), "is not signed"),
                (lambda: (first.unlink(), registry.move_alias(signed_by(cfg, other_private, [public]), ctx, "m",
                                                              "production", 3, by="mallory")),
                 "signed by a key that is not in registry.trusted_keys"),
                (lambda: first.write_text((tmp_path / "store/models/n/aliases/production/00000001.json")
                                          .read_text()), "signs 'n@production', not 'm@production'")):
            tamper()
            for attempt in (lambda: registry.resolve(cfg, ctx, "m@production"),
                            lambda: registry.move_alias(cfg, ctx, "m", "production", 2, by="the gate", expect=1)):
                assert str(first) in one_line(attempt, match)
            (refusal,) = [e for e in model_history(cfg, ctx, "m") if e["kind"] == "refused"]
            assert refusal["seq"] == 1 and re.search(match, refusal["reason"]) and str(first) in refusal["reason"]
            first.write_text(pristine)
            assert registry.resolve(cfg, ctx, "m@production").version == 1
        # a signed move copied to the next place: its content names its own place
        (place / "00000002.json").write_text(pristine)
        one_line(lambda: registry.resolve(cfg, ctx, "m@production"), "says alias 'production' seq 1, not the")
        (place / "00000002.json").unlink()
        # records written before signing: read with registry.allow_unsigned, refused without
        first.write_text(json.dumps({k: v for k, v in json.loads(pristine).items() if k != "signature"}))
        allowing = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"allow_unsigned": True})})
        assert registry.resolve(allowing, ctx, "m@production").version == 1


def registry_aliases_record(cfg, ctx, name: str, alias: str, seq: int) -> dict:
    from workflows.registry_aliases import _record_uri
    from workflows.storage.uri import read_json

    return read_json(_record_uri(cfg, name, alias, seq), ctx)


@pytest.mark.parametrize("file, field", [(registry.PROMOTION_FILE, "promotion"), (registry.EVAL_FILE, "metrics")])
def test_a_versions_evaluation_and_promotion_decision_are_signed(tmp_path, file, field):
    """The gate's decision and the evaluation beside a version carry their writer's signature: edited (a
    refused version made to look promoted, better metrics), copied from another version, or by another key,
    each is refused in one line naming the file by every reader of the card."""
    from workflows.registry_history import model_history

    with store(tmp_path, "local") as (cfg, ctx):
        private, public = pair(tmp_path / "keys", "team")
        cfg = signed_by(cfg, private, [public])
        for _ in range(2):
            register_one(cfg, ctx, tmp_path)
        content = {"promoted": False, "reason": "does not beat v1", "f1": float("nan")}  # NaN: a metric can be
        for version in (1, 2):
            ref = registry.resolve(cfg, ctx, f"m:{version}")
            write = registry.write_promotion if file == registry.PROMOTION_FILE else registry.write_evaluation
            write(cfg, ctx, ref, {**content, "version": version})
        card = registry.model_card(cfg, ctx, "m:2")
        assert getattr(card, field)["reason"] == "does not beat v1" and getattr(card, field)["version"] == 2
        assert "signature" not in getattr(card, field)
        record = Path(ref.uri, file)
        pristine = record.read_text()
        other_private, _ = pair(tmp_path / "keys", "other")
        for tamper, match in (
                (lambda: forge(record, promoted=True, reason="beats v1"), "changed after it was signed"),
                (lambda: record.write_text(Path(tmp_path / "store/models/m/v1", file).read_text()),
                 "signs 'm:v1', not 'm:v2'"),
                (lambda: write(signed_by(cfg, other_private, [public]), ctx, ref, {"promoted": True}),
                 "signed by a key that is not in registry.trusted_keys"),
                (lambda: forge(record, signature={"not": "a bundle"}), "its signature is not a signature bundle")):
            tamper()
            for attempt in (lambda: registry.model_card(cfg, ctx, "m:2"), lambda: model_history(cfg, ctx, "m")):
                assert str(record) in one_line(attempt, match)
            record.write_text(pristine)


def test_a_card_edited_in_the_store_is_refused_by_every_reader_not_only_fetch(tmp_path):
    """`models describe`, `models history` and the gate read a version's card without downloading it: a card
    whose bytes are not those its version's signature names is refused there too."""
    with store(tmp_path, "local") as (cfg, ctx):
        private, public = pair(tmp_path / "keys", "team")
        cfg = signed_by(cfg, private, [public])
        version = register_one(cfg, ctx, tmp_path)
        card = json.loads((version / CARD_FILE).read_text())
        card["lineage"]["dataset_version"] = "another"
        (version / CARD_FILE).write_text(json.dumps(card))
        for attempt in (lambda: registry.model_card(cfg, ctx, "m:1"), lambda: registry.describe(cfg, ctx, "m:1")):
            assert one_line(attempt, "workflows.json changed after").startswith("model m:v1: ")
