"""The registry's create-only write (workflows.storage.create_only.create_once) against a second S3
endpoint whose answers the test sets (tests/s3_behaviour.py): AWS's 409 ConditionalRequestConflict
is retried, and a store that ignores If-None-Match is found by one probe (registrations racing on
one: tests/test_model_card.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.s3_behaviour import BehaviourStore
from workflows import registry
from workflows.config import WorkflowConfig
from workflows.errors import UserError
from workflows.storage import create_only
from workflows.storage.create_only import create_once

META = {"task": "sequence-classification", "labels": ["a", "b"]}


@pytest.fixture
def store():
    create_only.forget_probes()  # each test's endpoint is new: probe it again
    with BehaviourStore() as s:
        yield s
    create_only.forget_probes()


def _bucket(store) -> str:
    name = f"claims-{uuid.uuid4().hex[:12]}"  # moto's buckets are per process
    store.context().boto3_client().create_bucket(Bucket=name)
    return name


def _cfg(tmp_path, root: str) -> WorkflowConfig:
    return WorkflowConfig.model_validate({"data": {"source": str(tmp_path / "raw")},
                                         "storage": {"root": root, "embedded": {"enabled": False}},
                                         "cache": {"dir": str(tmp_path / "cache")}})


def _artifact(tmp_path: Path, i: int) -> str:
    art = tmp_path / f"artifact{i}"
    art.mkdir()
    (art / "model.safetensors").write_bytes(f"weights of writer {i}".encode() * 100)
    return str(art)


def test_a_409_conflict_is_retried_and_the_registration_takes_its_version(tmp_path, store):
    """AWS answers conditional PUTs racing for one key with 409 ConditionalRequestConflict, which s3fs
    turned into an OSError: the registration failed instead of retrying. Now it is retried."""
    cfg, ctx = _cfg(tmp_path, f"s3://{_bucket(store)}/store"), store.context()
    store.behaviour.conflicts = 2
    ref = registry.register(cfg, ctx, _artifact(tmp_path, 0), "m", META)
    assert ref.version == 1 and store.behaviour.seen["409"] == 2
    assert registry.versions(cfg, ctx, "m") == [1]


def test_a_store_that_keeps_answering_409_is_a_one_line_error(store, monkeypatch):
    monkeypatch.setattr(create_only, "CONFLICT_ATTEMPTS", 3)
    bucket = _bucket(store)
    store.behaviour.conflicts = 10**6
    with pytest.raises(UserError) as e:
        create_once(f"s3://{bucket}/k", b"x", store.context())
    assert len(str(e.value).splitlines()) == 1 and "409" in str(e.value), str(e.value)


def test_the_probe_tells_a_store_that_honours_if_none_match_from_one_that_ignores_it(store):
    bucket, ctx = _bucket(store), store.context()
    assert create_once(f"s3://{bucket}/a", b"1", ctx) and not create_once(f"s3://{bucket}/a", b"2", ctx)
    assert create_only.honours_if_none_match(f"s3://{bucket}/a", ctx) is True
    create_only.forget_probes()
    store.behaviour.ignore_if_none_match = True
    assert create_only.honours_if_none_match(f"s3://{bucket}/b", ctx) is False
    assert create_once(f"s3://{bucket}/b", b"1", ctx) and not create_once(f"s3://{bucket}/b", b"2", ctx)
    client = ctx.boto3_client()
    assert client.get_object(Bucket=bucket, Key="b")["Body"].read() == b"1"
    listed = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in listed if "probe" in k], listed  # the probe's object is removed
