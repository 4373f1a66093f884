"""Signed versions (workflows.registry_signing): registration signs a version's files and card with
model-signing; `registry.fetch`, the one way evaluate, serve and its replicas, predict, the alias follower
and a chat adapter's base load a version, refuses a changed, added or missing file, an unsigned version
and a signature by another key, in one line naming the model and the file, before anything enters the
cache. On a local store and the embedded S3 endpoint; no Ray."""

import json
import os
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
