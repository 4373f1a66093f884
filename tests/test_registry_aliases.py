"""Registry aliases (workflows.registry_aliases) on a local store and on the embedded S3 endpoint: moves
as create-only records, NAME@ALIAS everywhere a model is named, the history, concurrent movers, the
promotion gate's config and its decision rule. No Ray."""

import contextlib
import json
import threading
from pathlib import Path

import pytest
import yaml

from workflows import registry, registry_aliases
from workflows.config import WorkflowConfig, load_config
from workflows.errors import UserError
from workflows.storage.uri import StorageContext
from workflows.tasks.text import TextClassification

QUICKSTART_CONFIG = "quickstart"


class NoComparableEvaluation(TextClassification.Evaluation):
    def comparable_metrics(self) -> dict[str, str]:
        return {}


class NoComparableMetric(TextClassification):
    """A task that registers its model but names no metric two versions can be compared by."""

    Evaluation = NoComparableEvaluation


CARD = {"task": "classification", "labels": ["a", "b"], "text_columns": ["text"], "label_column": "label",
        "max_length": 8, "lineage": {"dataset_version": "d1", "run": "r1"}}


@contextlib.contextmanager
def store(tmp_path: Path, kind: str):
    """(config, storage context) of a registry on the embedded S3 endpoint or a local directory."""
    from workflows.storage.embedded import EmbeddedS3

    with contextlib.ExitStack() as stack:
        if kind == "s3":
            s3 = stack.enter_context(EmbeddedS3(str(tmp_path / "s3")))
            s3.ensure_bucket("reg")
            root, ctx = "s3://reg/store", StorageContext(endpoint_url=s3.endpoint_url, region="us-east-1",
                                                         embedded=True)
        else:
            root, ctx = str(tmp_path / "store"), StorageContext()
        cfg = WorkflowConfig.model_validate({"data": {"source": str(tmp_path / "raw")},
                                             "storage": {"root": root, "embedded": {"enabled": False}},
                                             "cache": {"dir": str(tmp_path / "cache")}})
        yield cfg, ctx


def register(cfg, ctx, tmp_path: Path, n: int) -> None:
    for i in range(n):
        art = tmp_path / f"art{i}"
        art.mkdir(exist_ok=True)
        (art / "model.safetensors").write_bytes(f"weights {i}".encode())
        registry.register(cfg, ctx, str(art), "m", CARD)


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_an_alias_moves_resolves_and_keeps_its_history(tmp_path, kind):
    with store(tmp_path, kind) as (cfg, ctx):
        register(cfg, ctx, tmp_path, 3)
        with pytest.raises(UserError, match="has no alias 'production'"):
            registry.resolve(cfg, ctx, "m@production")
        first = registry.move_alias(cfg, ctx, "m", "production", 1, by="test", reason="first")
        assert (first.seq, first.previous, first.version) == (1, None, 1)
        registry.move_alias(cfg, ctx, "m", "staging", 3, by="test")
        registry.move_alias(cfg, ctx, "m", "production", 2, by="gate", reason="better")
        assert registry.resolve(cfg, ctx, "m@production").version == 2
        assert registry.resolve(cfg, ctx, "m").version == 3  # a bare name is still the newest version
        assert registry.model_card(cfg, ctx, "m@staging").version == 3
        assert registry.fetch(cfg, ctx, "m@production")[1].version == 2
        assert registry_aliases.aliases(cfg, ctx, "m") == {"production": 2, "staging": 3}
        registry.move_alias(cfg, ctx, "m", "production", 1, by="rollback")  # a rollback is a move back
        registry.move_alias(cfg, ctx, "m", "staging", None, by="test")  # removed
        assert registry_aliases.aliases(cfg, ctx, "m") == {"production": 1}
        moves = [(r.alias, r.previous, r.version, r.by) for r in registry_aliases.history(cfg, ctx, "m")]
        assert moves == [("production", None, 1, "test"), ("staging", None, 3, "test"),
                         ("production", 1, 2, "gate"), ("production", 2, 1, "rollback"), ("staging", 3, None, "test")]
        with pytest.raises(UserError, match="has no version 9"):
            registry.move_alias(cfg, ctx, "m", "production", 9, by="test")
        with pytest.raises(UserError, match="no alias 'staging' to delete"):
            registry.move_alias(cfg, ctx, "m", "staging", None, by="test")
        with pytest.raises(registry_aliases.AliasMovedMeanwhile, match=r"v2 -> v1 .* by rollback"):
            registry.move_alias(cfg, ctx, "m", "production", 3, by="gate", expect=2)
        # the alias directory is no version, and the record files are where the module docstring says
        assert registry.list_models(cfg, ctx) == {"m": [1, 2, 3]}
        if kind == "local":
            records = sorted(p.name for p in (tmp_path / "store/models/m/aliases/production").iterdir())
            assert records == ["00000001.json", "00000002.json", "00000003.json"]
            assert json.loads((tmp_path / "store/models/m/aliases/production/00000002.json").read_text())["from"] == 1


@pytest.mark.parametrize("spec, error", [
    ("m@v3", "would read as a version"), ("m@12", "would read as a version"), ("m@latest", "would read as a version"),
    ("m@../x", "invalid alias"), ("m:2@production", "not both"), ("m@", "invalid alias"),
])
def test_bad_alias_specs_are_refused_in_one_line(spec, error):
    with pytest.raises(UserError, match=error):
        registry.parse_spec(spec)


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_concurrent_moves_are_each_recorded_once_in_one_chain(tmp_path, kind, monkeypatch):
    """Six movers of one alias at once, each having read the same newest record (a barrier after the
    read makes the race certain): six records, numbered 1..6, each move's `from` the version the
    move before it set; no move lost, none twice. Then four conditional movers (the gate's `expect`)
    for an unset alias: one takes it, three are told who did."""
    with store(tmp_path, kind) as (cfg, ctx):
        register(cfg, ctx, tmp_path, 6)
        real_newest = registry_aliases.newest
        movers = 6
        read = threading.Barrier(movers)
        first_read: set[int] = set()

        def newest_then_wait(*args):
            found = real_newest(*args)
            me = threading.current_thread().name
            if me.startswith("mover") and me not in first_read:  # a mover's first read waits for the others'
                first_read.add(me)
                read.wait(timeout=60)
            return found

        monkeypatch.setattr(registry_aliases, "newest", newest_then_wait)
        errors: list[BaseException] = []

        def run(fn, *args, **kw):
            try:
                fn(*args, **kw)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(registry.move_alias, cfg, ctx, "m", "production", v + 1),
                                    kwargs={"by": f"mover {v + 1}"}, name=f"mover-{v}") for v in range(movers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        records = registry_aliases.history(cfg, ctx, "m")
        assert sorted(r.seq for r in records) == list(range(1, movers + 1))
        chain = sorted(records, key=lambda r: r.seq)
        assert [r.previous for r in chain] == [None] + [r.version for r in chain[:-1]]
        assert sorted(r.version for r in chain) == list(range(1, movers + 1))
        assert registry_aliases.holder(cfg, ctx, "m", "production") == chain[-1].version

        gate = 4
        read, first_read = threading.Barrier(gate), set()
        lost: list[str] = []

        def conditional(v: int):
            try:
                registry.move_alias(cfg, ctx, "m", "canary", v, by=f"gate {v}", expect=None)
            except registry_aliases.AliasMovedMeanwhile as e:
                lost.append(str(e))

        threads = [threading.Thread(target=run, args=(conditional, v + 1), name=f"mover-gate-{v}")
                   for v in range(gate)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        (won,) = [r for r in registry_aliases.history(cfg, ctx, "m") if r.alias == "canary"]
        assert len(lost) == gate - 1 and all(f"by gate {won.version}" in m for m in lost), lost


def test_the_gate_config_is_checked_when_it_loads(tmp_path):
    from workflows.tasks import check_task

    base = ["data.source=x", f"output_dir={tmp_path}"]
    assert load_config("quickstart").registry.promote.alias == "production"  # the demo shows the gate
    assert load_config(None, base).registry.promote is None  # off unless configured
    cfg = check_task(load_config(None, [*base, "registry.promote.alias=staging", "registry.promote.margin=0.01"]))
    assert cfg.registry.promote.metric is None and cfg.registry.promote.margin == 0.01
    with pytest.raises(UserError, match=r"registry\.promote\.alias: Value error, invalid alias 'v2'"):
        load_config(None, [*base, "registry.promote.alias=v2"])
    with pytest.raises(UserError, match=r"registry.promote.metric='bleu': model.task=classification compares "
                                        r"f1, precision, recall, accuracy$"):
        check_task(load_config(None, [*base, "registry.promote.metric=bleu"]))
    config = tmp_path / "plain.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": "x"}, "registry": {"promote": {"alias": "production"}},
                                      "model": {"task": "tests.test_registry_aliases:NoComparableMetric"}}))
    with pytest.raises(UserError) as e:
        check_task(load_config(config))
    assert str(e.value).count("\n") == 0 and "NoComparableMetric has no evaluation metric" in str(e.value)
    # a task that registers no model never reaches the gate: its commands (plan, train) take the config
    check_task(load_config(QUICKSTART_CONFIG, ["model.task=causal_lm"]))


def test_the_gate_decides_by_the_margin_in_the_metrics_direction():
    from workflows.pipeline.promote import wins

    assert wins(0.81, 0.80, "max", 0.0) and not wins(0.80, 0.80, "max", 0.0)  # a tie keeps the holder
    assert not wins(0.81, 0.80, "max", 0.02) and wins(0.83, 0.80, "max", 0.02)
    assert wins(1.9, 2.0, "min", 0.0) and not wins(2.1, 2.0, "min", 0.0)


def test_models_alias_and_history_commands(tmp_path, monkeypatch):
    """`workflows models alias NAME:V ALIAS [--delete]`, `workflows models` listing the aliases, and
    `workflows models history NAME` on a local store, in this process."""
    from typer.testing import CliRunner

    from workflows.cli import app

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"name": "c", "output_dir": f"{tmp_path}/runs", "data": {"source": "x"},
                                      "storage": {"root": f"{tmp_path}/store", "embedded": {"enabled": False}},
                                      "cache": {"dir": f"{tmp_path}/cache"}, "tracking": {"enabled": False}}))
    cfg = load_config(config)
    register(cfg, StorageContext(), tmp_path, 2)

    def cli(*args):
        out = CliRunner().invoke(app, [*args, "--config", str(config)])
        return out.exit_code, out.output

    first = cli("models", "alias", "m:1", "production", "--reason", "first")
    assert first == (0, "m@production: nothing -> v1 (move 1)\n")
    assert cli("models", "alias", "m:2", "production")[1] == "m@production: v1 -> v2 (move 2)\n"
    assert cli("models", "alias", "m:1", "staging")[0] == 0
    assert cli("models") == (0, "m: v1 @staging, v2 @production\n")
    code, out = cli("models", "alias", "m:1", "production", "--delete")
    assert code == 2 and "m@production moved meanwhile" in out  # --delete NAME:V only while it points there
    assert cli("models", "alias", "m", "staging", "--delete")[1] == "m@staging: v1 -> nothing (move 2)\n"
    code, out = cli("models", "alias", "m", "production")
    assert code == 2 and out.strip().endswith("name the version the alias is to point at, NAME:VERSION")
    code, out = cli("models", "history", "m")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 6, out
    assert lines[0].split("  ", 1)[1].startswith("v1 registered: data d1") and " registered" in lines[1]
    assert "@production: nothing -> v1 by workflows models alias" in lines[2] and lines[2].endswith(": first")
    assert "@production: v1 -> v2" in out and "@staging: v1 -> nothing" in lines[5]


def test_the_serving_follower_rolls_over_when_the_alias_moves_and_keeps_serving_when_it_goes(tmp_path, monkeypatch):
    """AliasFollower.check (what `workflows serve --model NAME@ALIAS` runs every serve.alias_poll_s):
    nothing while the alias stays; on a move, the new version deployed to the same application (Serve's
    rolling update; the real one is measured by `workflows bench serve` and tests/test_lifecycle.py);
    an alias removed leaves the served version in place, said once."""
    from types import SimpleNamespace

    import workflows.serve.app
    from workflows.serve.follow import AliasFollower, Followed

    deployed: list[tuple] = []
    monkeypatch.setattr(workflows.serve.app, "deploy",
                        lambda cfg, spec, name=None, route_prefix="/", served_as=None:
                        deployed.append((spec, name, route_prefix, served_as)))
    with store(tmp_path, "local") as (cfg, ctx):
        register(cfg, ctx, tmp_path, 2)
        registry.move_alias(cfg, ctx, "m", "production", 1, by="test")
        said: list[str] = []
        served = Followed("m@production", 1, "model-m", "/")
        follower = AliasFollower(SimpleNamespace(cfg=cfg, storage=ctx), [served], said.append)
        assert follower.check(served) is None and not deployed
        registry.move_alias(cfg, ctx, "m", "production", 2, by="the gate")
        done = follower.check(served)
        assert deployed == [("m:2", "model-m", "/", "m@production")] and served.version == 2
        assert done["from"] == 1 and done["to"] == 2 and done["move"] == 2 and served.rollovers == [done]
        assert said[0].startswith("serve: m@production moved v1 -> v2 (") and "by the gate): rolling over" in said[0]
        registry.move_alias(cfg, ctx, "m", "production", 1, by="rollback")  # a rollback is a move back
        follower.check(served)
        assert deployed[-1][0] == "m:1" and served.version == 1
        registry.move_alias(cfg, ctx, "m", "production", None, by="test")
        assert follower.check(served) is None and follower.check(served) is None and served.version == 1
        assert said[-1] == "serve: m@production is not set any more; still serving v1" and said.count(said[-1]) == 1


@pytest.mark.parametrize("edit, error", [
    # a record that claims another seq than its file's: the next move would land where no listing reads it
    (lambda r: {**r, "seq": 99999999}, "says alias 'production' seq 99999999, not the 'production' seq 2"),
    (lambda r: {**r, "seq": 0}, "seq 0, not the 'production' seq 2"),
    (lambda r: {**r, "seq": 1e999}, "not a valid alias record .OverflowError"),
    (lambda r: {**r, "alias": "staging"}, "says alias 'staging' seq 2"),
    (lambda r: {**r, "version": "2"}, "not a valid alias record .TypeError: a version is a positive integer below"),
    (lambda r: {**r, "version": True}, "a version is a positive integer below 1000000000, not true"),
    (lambda r: [r], "not a valid alias record .TypeError: a JSON object, not a list"),
    (lambda r: {**r, "reason": "x" * (2 << 20)}, r"is over 1048576 bytes: refused"),
])
def test_an_edited_alias_record_is_refused_in_one_line_until_a_real_move_goes_past_it(tmp_path, edit, error):
    """The newest record of an alias edited in the store: resolving the alias and the gate's conditional move
    each refuse it in one line naming the file; the history shows it refused; a plain move (`workflows models
    alias`, the operator's repair) lands after it, numbered by the file names, from the newest move that
    verifies, and resolving then follows it."""
    from workflows.registry_history import format_history, model_history

    with store(tmp_path, "local") as (cfg, ctx):
        register(cfg, ctx, tmp_path, 3)
        registry.move_alias(cfg, ctx, "m", "production", 1, by="test")
        registry.move_alias(cfg, ctx, "m", "production", 2, by="gate")
        place = tmp_path / "store/models/m/aliases/production"
        newest = place / "00000002.json"
        newest.write_text(json.dumps(edit(json.loads(newest.read_text()))))
        for attempt in (lambda: registry.resolve(cfg, ctx, "m@production"),
                        lambda: registry.move_alias(cfg, ctx, "m", "production", 3, by="the gate", expect=2)):
            with pytest.raises(UserError, match=error) as refused:
                attempt()
            assert len(str(refused.value).splitlines()) == 1 and str(newest) in str(refused.value)
        assert sorted(p.name for p in place.iterdir()) == ["00000001.json", "00000002.json"]
        shown = format_history(model_history(cfg, ctx, "m"))
        assert "@production: move 2 REFUSED: " in shown and str(newest) in shown, shown
        assert registry_aliases.aliases(cfg, ctx, "m") == {}  # no trusted move says where it points
        record = registry.move_alias(cfg, ctx, "m", "production", 3, by="operator")
        assert (record.seq, record.previous, record.version) == (3, 1, 3)
        assert registry.resolve(cfg, ctx, "m@production").version == 3
        events = model_history(cfg, ctx, "m")
        assert [(e["kind"], e.get("seq")) for e in events if e["kind"] != "registered"] == [
            ("alias", 1), ("refused", 2), ("alias", 3)]


@pytest.mark.parametrize("file", [registry.EVAL_FILE, registry.PROMOTION_FILE])
@pytest.mark.parametrize("content, error", [
    ("[]", "holds a JSON list, not an object"),
    ('"passed"', "holds a JSON str, not an object"),
    ("{not json", "is not valid JSON"),
    ('{"reason": "' + "x" * (2 << 20) + '"}', r"is over 1048576 bytes: refused"),
])
def test_a_versions_evaluation_or_promotion_record_is_read_bounded_and_typed(tmp_path, file, content, error):
    """evaluation.json and promotion.json beside a version are read at most MAX_RECORD_BYTES and only as a JSON
    object: else the card's readers (serve's replicas, evaluate, `models history`) get one line naming the
    file, never a traceback."""
    from workflows.registry_history import model_history

    with store(tmp_path, "local") as (cfg, ctx):
        register(cfg, ctx, tmp_path, 1)
        ref = registry.resolve(cfg, ctx, "m:1")
        registry.write_promotion(cfg, ctx, ref, {"promoted": True, "reason": "first version"})
        assert model_history(cfg, ctx, "m")[0]["gate"] == "first version"
        Path(ref.uri, file).write_text(content)
        for attempt in (lambda: registry.model_card(cfg, ctx, "m:1"), lambda: model_history(cfg, ctx, "m")):
            with pytest.raises(UserError, match=error) as refused:
                attempt()
            assert len(str(refused.value).splitlines()) == 1 and str(Path(ref.uri, file)) in str(refused.value)
