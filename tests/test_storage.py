import json
import uuid

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


def _store_with_objects(data_dir, n: int) -> None:
    """A persisted store of `n` small objects: its next owner takes a few seconds to restore it."""
    with EmbeddedS3(data_dir) as s3:
        s3.ensure_bucket("many")
        c = ctx_for(s3).boto3_client()
        for i in range(n):
            c.put_object(Bucket="many", Key=f"k{i}", Body=b"x" * 64)


def _owner_process(data_dir):
    """A real process that owns `data_dir`'s store (spawn, restore), once its pid is in the lock file."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    code = "import sys, time; from workflows.storage.embedded import EmbeddedS3; EmbeddedS3(sys.argv[1]).start(); " \
           "time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code, data_dir], env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.time() + 60
    while (Path(data_dir) / "lock").read_text().strip() != str(proc.pid):
        assert proc.poll() is None and time.time() < deadline, "the owner process did not take the lock"
        time.sleep(0.02)
    return proc


def test_a_waiter_takes_the_store_over_when_its_owner_dies_starting(tmp_path):
    """An owner SIGKILLed while it restores frees the lock: the process waiting for its endpoint
    takes the store over within seconds (it used to wait 120 s for a record that never came)."""
    import threading
    import time

    import psutil

    data_dir = str(tmp_path / "s3")
    _store_with_objects(data_dir, 150)
    owner = _owner_process(data_dir)
    killed = []

    def kill_while_restoring():
        deadline = time.time() + 60
        while not any(c.status == psutil.CONN_LISTEN for p in psutil.Process(owner.pid).children()
                      for c in p.net_connections()):  # its moto server is up: the restore begins
            assert time.time() < deadline, "the owner's endpoint did not start"
            time.sleep(0.05)
        time.sleep(0.3)
        assert not (tmp_path / "s3" / "endpoint.json").exists()  # the owner is still restoring
        owner.kill()
        owner.wait()
        killed.append(time.time())

    # the waiter starts in this thread: its endpoint's process dies with the thread that started it
    threading.Thread(target=kill_while_restoring).start()
    waiter = EmbeddedS3(data_dir)
    waiter.start()
    try:
        assert killed and waiter.owner and time.time() - killed[0] < 30
        c = ctx_for(waiter).boto3_client()
        assert c.get_object(Bucket="many", Key="k149")["Body"].read() == b"x" * 64
    finally:
        waiter.stop()


def test_a_waiter_names_the_owner_still_restoring(tmp_path):
    import time

    data_dir = str(tmp_path / "s3")
    _store_with_objects(data_dir, 100)
    owner = _owner_process(data_dir)
    try:
        t0 = time.time()
        with pytest.raises(UserError, match=f"locked by pid {owner.pid}, still restoring its store after 1 s"):
            EmbeddedS3(data_dir).start(wait_s=1)
        assert time.time() - t0 < 10
    finally:
        owner.kill()
        owner.wait()


def test_running_endpoint_asks_the_lock_not_the_port(tmp_path):
    """A free lock means no owner, even where something (anyone, by now) listens on the recorded
    port; a held lock with a record means the endpoint runs."""
    import fcntl
    import os
    import socket

    from workflows.storage.embedded import running_endpoint

    data_dir = tmp_path / "s3"
    data_dir.mkdir()
    from workflows.net import free_port

    with socket.socket() as listener:
        port = free_port()
        listener.bind(("127.0.0.1", port))
        listener.listen()
        url = f"http://127.0.0.1:{port}"
        (data_dir / "endpoint.json").write_text(json.dumps({"url": url, "pid": 1}))
        (data_dir / "lock").touch()
        assert running_endpoint(str(data_dir)) is None
        fd = os.open(data_dir / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            assert running_endpoint(str(data_dir)) == url
            (data_dir / "endpoint.json").unlink()  # locked, no record yet: still starting
            assert running_endpoint(str(data_dir)) is None
        finally:
            os.close(fd)


def test_store_command_runs_in_the_runtime_and_persists_on_sigterm(tmp_path):
    """`workflows store`: the runtime's endpoint (with the config's buckets), found by
    running_endpoint while it runs; SIGTERM persists and stops it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from workflows.storage.embedded import running_endpoint

    data_dir = tmp_path / "s3"
    proc = subprocess.Popen([sys.executable, "-m", "workflows", "store",
                             "--set", f"storage.embedded.data_dir={data_dir}",
                             "--set", f"output_dir={tmp_path}/runs", "--set", "tracking.enabled=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        lines = []
        deadline = time.time() + 120
        while not any("Ctrl-C to stop" in ln for ln in lines):
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        url = running_endpoint(str(data_dir))
        assert url and url in lines[-1]
        ctx = StorageContext(endpoint_url=url, region="us-east-1", embedded=True)
        ctx.boto3_client().put_object(Bucket="workflows", Key="from-outside", Body=b"kept")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0 and f"store: stopped; data persisted in {data_dir}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert running_endpoint(str(data_dir)) is None
    with EmbeddedS3(str(data_dir)) as s3:
        assert ctx_for(s3).boto3_client().get_object(Bucket="workflows", Key="from-outside")["Body"].read() == b"kept"
    proc = subprocess.run([sys.executable, "-m", "workflows", "store", "--set", "storage.embedded.enabled=false",
                           "--set", f"storage.root={tmp_path}/plain"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=120)
    assert proc.returncode == 2 and "storage.embedded.enabled is false" in proc.stdout + proc.stderr


def test_a_conditional_put_is_atomic_on_the_embedded_endpoint(monkeypatch):
    """Eight PUTs with If-None-Match: * for one key at once: one succeeds, the others get 412, as on
    S3 (the registry claims a version that way). moto checks the key, then writes: here its check is
    slowed, so that without the embedded endpoint's lock every PUT would pass it. In this process,
    with moto's classes restored afterwards."""
    import threading
    import time

    from botocore.exceptions import ClientError
    from moto.s3.models import S3Backend
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer

    from tests.helpers import free_port
    from workflows.storage.s3_server import conditional_puts_are_atomic

    monkeypatch.setattr(S3Response, "put_object", S3Response.put_object)
    real_get = S3Backend.get_object
    monkeypatch.setattr(S3Backend, "get_object", lambda self, *a, **k: (real_get(self, *a, **k), time.sleep(0.2))[0])
    conditional_puts_are_atomic()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    try:
        host, port = server.get_host_and_port()
        ctx = StorageContext(endpoint_url=f"http://{host}:{port}", region="us-east-1", embedded=True)
        clients = [ctx.boto3_client() for _ in range(8)]
        clients[0].create_bucket(Bucket="race")
        start, won, lost = threading.Barrier(len(clients)), [], []

        def put(i: int) -> None:
            start.wait(timeout=60)
            try:
                clients[i].put_object(Bucket="race", Key="claim", Body=str(i).encode(), IfNoneMatch="*")
                won.append(i)
            except ClientError as e:
                lost.append(e.response["Error"]["Code"])

        threads = [threading.Thread(target=put, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(won) == 1 and lost == ["PreconditionFailed"] * (len(clients) - 1), (won, lost)
        assert clients[0].get_object(Bucket="race", Key="claim")["Body"].read() == str(won[0]).encode()
    finally:
        server.stop()


def test_the_embedded_store_serves_its_own_bucket_and_a_users_bucket_stays_where_it_is(tmp_path, monkeypatch):
    """With the embedded store on (the quickstart and digits configs), `data.source=s3://my-bucket/...`
    is the user's bucket at the endpoint their environment names (AWS_ENDPOINT_URL; else
    storage.endpoint_url, else AWS), read with their credentials: listed, read through the shard
    cache, and never built into or created in the embedded store. storage.root's bucket is the
    embedded store's."""
    import boto3
    from moto.server import ThreadedMotoServer

    from workflows.config import load_config
    from workflows.pipeline.stages import ensure_raw_data
    from workflows.preprocess.sources import list_shards
    from workflows.runtime import runtime
    from workflows.storage.cache import ShardCache

    # moto's servers in one process share one backend: bucket names of this test's own
    mine, empty = f"my-bucket-{uuid.uuid4().hex[:8]}", f"empty-bucket-{uuid.uuid4().hex[:8]}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    try:
        url = f"http://127.0.0.1:{server._server.server_port}"
        for k, v in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
            monkeypatch.setenv(k, v)
        users = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        users.create_bucket(Bucket=mine)
        users.put_object(Bucket=mine, Key="tickets/a.jsonl", Body=b'{"text": "x y", "label": "a"}\n')
        users.create_bucket(Bucket=empty)
        base = [f"storage.embedded.data_dir={tmp_path}/s3", f"output_dir={tmp_path}/runs", f"cache.dir={tmp_path}/c"]
        cfg = load_config("quickstart", [*base, f"data.source=s3://{mine}/tickets/"])
        with runtime(cfg, ray_needed=False) as rt:
            assert rt.storage.for_uri("s3://workflows/raw/").endpoint_url == rt.cfg.storage.endpoint_url != url
            assert rt.storage.for_uri(f"s3://{mine}/tickets/").endpoint_url == url
            shards, fmt = list_shards(f"s3://{mine}/tickets/", rt.storage)
            assert [s.uri for s in shards] == [f"s3://{mine}/tickets/a.jsonl"] and fmt == "jsonl"
            assert ensure_raw_data(rt) == {"built": False, "shards": 1}
            with ShardCache(str(tmp_path / "c"), rt.storage).open_local(shards[0].uri) as path:
                assert open(path, "rb").read().startswith(b'{"text": "x y"')
            embedded = rt.storage.boto3_client()
            assert {b["Name"] for b in embedded.list_buckets()["Buckets"]} == {"workflows"}
        # an empty bucket of the user's is an error naming it, not a place to build the demo data in
        cfg = load_config("quickstart", [*base, f"data.source=s3://{empty}/raw/"])
        with runtime(cfg, ray_needed=False) as rt, pytest.raises(UserError, match="is built only into the embedded"):
            ensure_raw_data(rt)
        assert "Contents" not in users.list_objects_v2(Bucket=empty)
    finally:
        server.stop()
