import json

import pytest

from workflows.errors import UserError
from workflows.storage.atomic import atomic_write
from workflows.storage.embedded import EmbeddedS3
from workflows.storage.uri import StorageContext, check_bucket, filesystem, read_json, write_bytes_atomic, write_json


def ctx_for(s3: EmbeddedS3) -> StorageContext:
    return StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1", embedded=True)


def test_round_trip_over_http_with_boto3_and_s3fs(tmp_path):
    with EmbeddedS3(str(tmp_path / "s3")) as s3:
        assert s3.endpoint_url.startswith("http://127.0.0.1:")
        ctx = ctx_for(s3)
        s3.ensure_bucket("bkt")
        ctx.boto3_client().put_object(Bucket="bkt", Key="a/b.txt", Body=b"hello")
        fs, path = filesystem("s3://bkt/a/b.txt", ctx)
        assert fs.cat(path) == b"hello"
        write_json("s3://bkt/c.json", {"x": 1}, ctx)
        assert read_json("s3://bkt/c.json", ctx) == {"x": 1}


def test_objects_survive_a_restart(tmp_path):
    data_dir = str(tmp_path / "s3")
    with EmbeddedS3(data_dir) as s3:
        s3.ensure_bucket("keep")
        s3.ensure_bucket("empty")
        c = ctx_for(s3).boto3_client()
        c.put_object(Bucket="keep", Key="x/../../evil", Body=b"not a path")
        c.put_object(Bucket="keep", Key="model/v1/weights", Body=b"w" * 1000)
        c.put_object(Bucket="keep", Key="gone", Body=b"deleted later")
        s3.persist()
        c.delete_object(Bucket="keep", Key="gone")
    # nothing was written outside the data dir, whatever the key
    assert not (tmp_path / "evil").exists()
    with EmbeddedS3(data_dir) as s3:
        c = ctx_for(s3).boto3_client()
        assert c.get_object(Bucket="keep", Key="model/v1/weights")["Body"].read() == b"w" * 1000
        assert c.get_object(Bucket="keep", Key="x/../../evil")["Body"].read() == b"not a path"
        keys = [o["Key"] for o in c.list_objects_v2(Bucket="keep").get("Contents", [])]
        assert "gone" not in keys
        assert {b["Name"] for b in c.list_buckets()["Buckets"]} == {"keep", "empty"}


def test_second_process_reuses_the_running_endpoint(tmp_path):
    data_dir = str(tmp_path / "s3")
    with EmbeddedS3(data_dir) as owner:
        other = EmbeddedS3(data_dir)
        assert other.start() == owner.endpoint_url and not other.owner
        other.stop()  # not the owner: stops nothing
        owner.ensure_bucket("still-up")


def test_a_killed_owners_record_is_never_used(tmp_path):
    """A SIGKILLed owner leaves endpoint.json naming a dead endpoint: `running_endpoint` (serve
    run's lookup) reports none while the record is stale, and the next owner's record replaces it."""
    from workflows.storage.embedded import running_endpoint

    (tmp_path / "s3").mkdir()
    (tmp_path / "s3" / "endpoint.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": 1}))
    assert running_endpoint(str(tmp_path / "s3")) is None
    with EmbeddedS3(str(tmp_path / "s3")) as owner:
        other = EmbeddedS3(str(tmp_path / "s3"))
        assert other.start() == owner.endpoint_url == running_endpoint(str(tmp_path / "s3")) and not other.owner
    assert running_endpoint(str(tmp_path / "s3")) is None  # the owner's stop removed its record


def test_missing_bucket_names_the_uri(tmp_path):
    with EmbeddedS3(str(tmp_path / "s3")) as s3:
        with pytest.raises(UserError, match="s3://no-such-bucket/x"):
            check_bucket("s3://no-such-bucket/x", ctx_for(s3))


def test_unreachable_endpoint_is_a_clear_error():
    ctx = StorageContext(endpoint_url="http://127.0.0.1:9", region="us-east-1", embedded=True, retries=0)
    with pytest.raises(UserError, match="cannot reach s3://b"):
        check_bucket("s3://b/x", ctx)


def test_missing_credentials_are_a_clear_error(tmp_path):
    """An S3 source with no credentials anywhere: one line naming the URI, not botocore's traceback.
    A fresh process, so that no cached filesystem or session holds credentials from other tests."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    code = (
        "from workflows.storage.embedded import EmbeddedS3\n"
        "from workflows.storage.uri import StorageContext\n"
        "from workflows.preprocess.sources import list_shards\n"
        "from workflows.errors import UserError\n"
        f"with EmbeddedS3({str(tmp_path / 's3')!r}) as s3:\n"
        "    try:\n"
        "        list_shards('s3://raw/data/', StorageContext(endpoint_url=s3.endpoint_url, region='us-east-1'))\n"
        "    except UserError as e:\n"
        "        print('USER ERROR:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "USER ERROR: no credentials for s3://raw/data/ (endpoint http://127.0.0.1:" in out.stdout, out.stderr[-2000:]
    assert "AWS_ACCESS_KEY_ID" in out.stdout and "Traceback" not in out.stderr


def test_local_writes_are_atomic(tmp_path):
    target = tmp_path / "d" / "f.json"
    write_bytes_atomic(str(target), b'{"a": 1}', StorageContext())
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in target.parent.iterdir()] == ["f.json"]


def test_atomic_write_text_bytes_and_writer(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")
    assert atomic_write(target, '{"a": 1}') == target
    assert target.read_text() == '{"a": 1}'
    atomic_write(str(target), b"\x00bytes", fsync=True)
    assert target.read_bytes() == b"\x00bytes"
    # a writer fills the temp path it is given (savefig, a download); a custom temp name is honoured
    seen = []
    atomic_write(target, lambda tmp: (seen.append(tmp.name), tmp.write_text("w")), tmp=tmp_path / "t.tmp.json")
    assert seen == ["t.tmp.json"] and target.read_text() == "w"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
