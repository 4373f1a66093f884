import tempfile
from pathlib import Path

import pytest

from tests.conftest import QUICKSTART, run_cli
from workflows.config import load_config
from workflows.errors import UserError


def write(tmp_path, text: str):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_quickstart_config_loads():
    cfg = load_config(QUICKSTART)
    assert cfg.train.strategy == "fsdp" and cfg.train.num_workers == "auto"
    assert cfg.storage.embedded.enabled and cfg.serve.host == "127.0.0.1"


def test_overrides_are_typed():
    cfg = load_config(
        QUICKSTART, ["train.lr=3e-5", "train.epochs=5", "serve.enabled=false", "data.text_columns=[title, description]"]
    )
    assert cfg.train.lr == pytest.approx(3e-5) and cfg.train.epochs == 5
    assert cfg.serve.enabled is False and cfg.data.text_columns == ["title", "description"]


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "data: {source: x}\ntrain: {learning_rate: 0.1}\n")
    with pytest.raises(UserError) as e:
        load_config(p)
    assert "train.learning_rate" in str(e.value) and str(p) in str(e.value) and "unknown key" in str(e.value)


def test_wrong_type_names_key(tmp_path):
    p = write(tmp_path, "data: {source: x}\ntrain: {epochs: three}\n")
    with pytest.raises(UserError, match=r"train\.epochs.*integer"):
        load_config(p)


def test_missing_required_and_missing_file(tmp_path):
    with pytest.raises(UserError, match="data: required key is missing"):
        load_config(write(tmp_path, "name: x\n"))
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_a_shipped_config_by_name_from_any_directory(tmp_path, monkeypatch):
    """`--config quickstart` is the config shipped in the package; a path still wins, and an unknown
    name lists the shipped ones."""
    monkeypatch.chdir(tmp_path)
    assert load_config("quickstart") == load_config(QUICKSTART)
    assert load_config("madewithml").registry.name == "madewithml"
    (tmp_path / "quickstart").write_text("name: mine\ndata: {source: x}\n")
    assert load_config("quickstart").name == "mine"
    with pytest.raises(UserError, match="config file not found: nope .*quickstart"):
        load_config("nope")
    # the default (no --config) outside the repository: `plan` needs no store and no Ray
    res = run_cli("plan", "--devices", "1", timeout=120, cwd=tmp_path)
    assert res.returncode == 0 and "fsdp" in res.stdout.lower(), res.stderr[-2000:]


def test_bad_override_key_and_form():
    with pytest.raises(UserError, match=r"train\.nope"):
        load_config(QUICKSTART, ["train.nope=1"])
    with pytest.raises(UserError, match="KEY=VALUE"):
        load_config(QUICKSTART, ["train.lr"])


def test_names_that_become_paths_are_validated():
    for bad in ["../etc", "a/b", ".hidden", ""]:
        with pytest.raises(UserError, match="registry.name"):
            load_config(QUICKSTART, [f"registry.name={bad}"])


def test_search_space_must_name_train_fields(tmp_path):
    with pytest.raises(UserError, match="train"):
        load_config(QUICKSTART, ["tune.space={serve.port: {choice: [1, 2]}}"])
    with pytest.raises(UserError, match="exactly one"):
        load_config(QUICKSTART, ["tune.space={train.lr: {choice: [1], uniform: [0, 1]}}"])


def test_cli_reports_config_errors_in_one_line(tmp_path):
    p = write(tmp_path, "data: {source: x}\ntrain: {epochz: 1}\n")
    res = run_cli("train", "--config", str(p), timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "train.epochz" in res.stderr and str(p) in res.stderr and "Traceback" not in res.stderr


def test_cli_reports_a_moved_key_in_one_line_naming_its_new_place(tmp_path):
    p = write(tmp_path, "data: {source: x}\ntrain: {head_lr: 1.0e-3}\n")
    res = run_cli("train", "--config", str(p), timeout=120)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert f"{p}: train.head_lr moved to model.options.head_lr (the classification task's options)" in res.stderr
    res = run_cli("plan", "--set", "model.task=causal_lm", "--set", "model.lm.seq_len=256", timeout=120)
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "quickstart (with --set): model.lm.seq_len moved to model.options.seq_len (the causal_lm task's " \
           "options)" in res.stderr


def test_cli_help_on_every_command():
    for cmd in ["preprocess", "train", "tune", "evaluate", "serve", "predict", "pipeline", "bench", "models", "plan",
                "store"]:
        res = run_cli(cmd, "--help", timeout=120)
        assert res.returncode == 0 and "--help" in res.stdout, (cmd, res.stderr)


def test_unknown_model_fails_before_ray_starts(tmp_path):
    """evaluate / predict / serve check the registry (object store only) before starting Ray: an
    unknown model is a one-line error in seconds, and no Ray instance is started for it."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a", "label": "b"}\n')
    store = [f"storage.embedded.data_dir={tmp_path}/s3", f"output_dir={tmp_path}/runs", f"cache.dir={tmp_path}/cache"]
    sets = [a for s in store for a in ("--set", s)]
    # where a Ray instance started by the command would put its session (short: Ray's socket paths)
    ray_tmp = Path(tempfile.mkdtemp(prefix="wf-", dir="/tmp"))
    for args in (
        ["evaluate", "--model", "nope", "--data", str(data)],
        ["predict", "--model", "nope:3", "--data", str(data), "--output", "s3://workflows/out"],
        ["serve", "--model", "nope", "--no-block"],
    ):
        res = run_cli(
            *args, "--config", str(QUICKSTART), *sets, timeout=120, env={"RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""}
        )
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert "model 'nope' not found" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert not list(ray_tmp.iterdir()), (args, list(ray_tmp.iterdir()))
    ray_tmp.rmdir()


def test_tuned_params_make_a_new_validated_config():
    from pydantic import ValidationError

    from workflows.pipeline.stages import apply_params

    cfg = load_config(QUICKSTART)
    tuned = apply_params(cfg, {"train.lr": "3e-5", "train.batch_size": 7})
    assert tuned.train.lr == pytest.approx(3e-5) and tuned.train.batch_size == 7  # typed as on loading
    assert cfg.model_dump() == load_config(QUICKSTART).model_dump()  # the given config is unchanged
    assert tuned.model_dump(exclude={"train"}) == cfg.model_dump(exclude={"train"})
    with pytest.raises(ValidationError):
        apply_params(cfg, {"train.lr": -1})


def test_without_config_a_model_commands_outputs_go_under_the_models_name():
    """`evaluate --model wine` and `predict --model wine:2` without --config: the summary, plots and
    logs go under runs/wine/, not runs/quickstart/ (the shipped config's name); an explicit --config
    or --set name=... keeps its own. The command lines are parsed by the real commands."""
    import typer

    from workflows import cli

    def loaded(command: str, *args: str):
        cmd = typer.main.get_command(cli.app).commands[command]  # type: ignore[attr-defined]
        ctx = cmd.make_context(command, [*args])
        return load_config(ctx.params["config"], cli.named_after_model(ctx.params["set"], ctx, ctx.params["model"]))

    assert loaded("evaluate", "--model", "wine", "--split", "test").name == "wine"
    assert loaded("predict", "--model", "wine:2", "--data", "d/", "--output", "o/").name == "wine"
    assert loaded("evaluate", "--model", "wine", "--split", "test", "--config", "quickstart").name == "quickstart"
    assert loaded("evaluate", "--model", "wine", "--split", "test", "--set", "name=mine").name == "mine"
