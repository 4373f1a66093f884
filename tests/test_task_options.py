"""The built-in tasks take their settings through their typed `Options` (`model.options`), as a
plug-in does. A setting under the key it had before it became a task's option (`train.head_lr`,
`model.lm.seq_len`, `model.pooling`, ...) is refused when the config loads, in one line naming the
file (or the --set), the old key and its new place. No Ray."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import DIGITS, QUICKSTART
from workflows.config import load_config
from workflows.config.moved import MOVED
from workflows.errors import UserError
from workflows.tasks import get_task, task_class


def test_the_shipped_configs_set_the_options_of_their_task():
    digits = get_task(load_config(DIGITS, [])).options
    assert digits.image_size == 32
    assert (digits.augment.flip, digits.augment.crop_scale, digits.augment.crop_ratio) == (False, (0.7, 1.0),
                                                                                           (0.9, 1.1))
    assert (digits.image_input, digits.image_column) == ("pixels", "image")
    made = get_task(load_config("madewithml", ["data.source=/nowhere.csv"])).options
    assert (made.pooling, made.head_init, made.linear_probe_l2) == ("mean", "linear_probe", 1e-3)
    assert (made.head_lr, made.freeze_embeddings) == (None, False)
    text = get_task(load_config(QUICKSTART, [])).options
    assert (text.pooling, text.head_init) == ("cls", "random")
    assert (text.head_lr, text.freeze_embeddings) == (None, True)  # quickstart freezes MiniLM's embeddings
    assert not get_task(load_config(QUICKSTART, [])).training.needs_probe_batches()
    assert get_task(load_config("madewithml", ["data.source=/nowhere.csv"])).training.needs_probe_batches()
    lm = get_task(load_config(QUICKSTART, ["model.task=causal_lm", "model.options={}"])).options
    assert (lm.size, lm.n_layer, lm.n_embd, lm.n_head, lm.seq_len) == ("gpt2-124m", None, None, None, 1024)


def test_a_built_in_option_is_checked_like_a_plug_ins():
    for key, named in (("model.options.poolng=mean", "model.options.poolng: unknown option"),
                       ("model.options.pooling=max", "model.options.pooling: Input should be 'cls' or 'mean'"),
                       ("model.options.head_lr=0", "model.options.head_lr: Input should be greater than 0 (got 0)"),
                       ("model.options.freeze_embedings=true", "model.options.freeze_embedings: unknown option"),
                       ("model.options.freeze_embeddings=maybe",
                        "model.options.freeze_embeddings: Input should be a valid boolean")):
        with pytest.raises(UserError, match="task classification") as err:
            get_task(load_config(QUICKSTART, [key])).check_config()
        assert named in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="model.options.image_size: Input should be greater than or equal to 8"):
        get_task(load_config(DIGITS, ["model.options.image_size=4"])).check_config()
    for key, named in (("model.options.image_input=rgb", "model.options.image_input: Input should be 'raw' or "
                                                         "'pixels' (got 'rgb')"),
                       ("model.options.image_colum=png", "model.options.image_colum: unknown option")):
        with pytest.raises(UserError, match="task image_classification") as err:
            get_task(load_config(DIGITS, [key])).check_config()
        assert named in str(err.value)
    lm = ["model.task=causal_lm", "model.options={}"]
    for key, named in (("model.options.seq_len=4", "model.options.seq_len: Input should be greater than or equal "
                                                   "to 8"),
                       ("model.options.size=huge", "model.options.size: Input should be 'tiny', 'small'"),
                       ("model.options.sise=tiny", "model.options.sise: unknown option (its options: size, n_layer, "
                                                   "n_embd, n_head, seq_len)")):
        with pytest.raises(UserError, match="task causal_lm") as err:
            get_task(load_config(QUICKSTART, [*lm, key])).check_config()
        assert named in str(err.value)


# each old key, a value it took, and its new place named in the error
OLD_KEYS = [
    ("model.pooling", "mean", "model.options.pooling (the classification task's options)"),
    ("train.head_init", "linear_probe", "model.options.head_init (the classification task's options)"),
    ("train.linear_probe_l2", 0.5, "model.options.linear_probe_l2 (the classification task's options)"),
    ("train.head_lr", 1e-3, "model.options.head_lr (the classification task's options)"),
    ("train.freeze_embeddings", True, "model.options.freeze_embeddings (the classification task's options)"),
    ("preprocess.image_size", 48, "model.options.image_size (the image_classification task's options)"),
    ("train.augment.flip", True, "model.options.augment (the image_classification task's options)"),
    ("train.image_input", "raw", "model.options.image_input (the image_classification task's options)"),
    ("data.image_column", "png", "model.options.image_column (the image_classification task's options)"),
    ("model.lm.size", "tiny", "model.options.size (the causal_lm task's options)"),
    ("model.lm.n_layer", 2, "model.options.n_layer (the causal_lm task's options)"),
    ("model.lm.n_embd", 64, "model.options.n_embd (the causal_lm task's options)"),
    ("model.lm.n_head", 2, "model.options.n_head (the causal_lm task's options)"),
    ("model.lm.seq_len", 32, "model.options.seq_len (the causal_lm task's options)"),
]


def _nested(key: str, value) -> dict:
    out: dict = {}
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _old_key(key: str) -> str:
    return "train.augment" if key.startswith("train.augment.") else key


@pytest.mark.parametrize("key, value, place", OLD_KEYS, ids=[k for k, _, _ in OLD_KEYS])
def test_an_old_key_in_a_file_is_a_one_line_error_naming_its_new_place(tmp_path, key, value, place):
    data = yaml.safe_load(QUICKSTART.read_text())
    for section, body in _nested(key, value).items():
        data[section] = {**data.get(section, {}), **body}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError) as err:
        load_config(path, [])
    assert str(err.value) == f"invalid config: {path}: {_old_key(key)} moved to {place}"


@pytest.mark.parametrize("key, value, place", OLD_KEYS, ids=[k for k, _, _ in OLD_KEYS])
def test_an_old_key_in_a_set_is_the_same_error(key, value, place):
    with pytest.raises(UserError) as err:
        load_config(QUICKSTART, [f"{key}={value}"])
    assert str(err.value) == f"invalid config: {QUICKSTART} (with --set): {_old_key(key)} moved to {place}"


def test_several_old_keys_are_named_on_one_line(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"data": {"source": "x"}, "model": {"task": "causal_lm", "lm": {
        "size": "tiny", "seq_len": 32}}, "train": {"head_lr": 1e-3}}, sort_keys=False))
    with pytest.raises(UserError) as err:
        load_config(path, [])
    assert str(err.value) == (
        f"invalid config: {path}: model.lm.size moved to model.options.size (the causal_lm task's options); "
        f"{path}: model.lm.seq_len moved to model.options.seq_len (the causal_lm task's options); "
        f"{path}: train.head_lr moved to model.options.head_lr (the classification task's options)")
    # model.lm set whole, or with a key that never was one of its own: named as model.lm
    with pytest.raises(UserError, match=r"model.lm moved to model.options \(the causal_lm task's options\)$"):
        load_config(QUICKSTART, ["model.lm={size: tiny, depth: 2}"])
    with pytest.raises(UserError, match=r"model.lm moved to model.options \(the causal_lm task's options\)$"):
        load_config(QUICKSTART, ["model.lm=null"])


def test_a_tune_dimension_over_an_old_key_names_its_new_place():
    with pytest.raises(UserError, match=r"search dimension train.head_lr moved to model.options.head_lr \(the "
                                        r"classification task's options\)") as err:
        load_config(QUICKSTART, ['tune.space={"train.head_lr": {"loguniform": [1.0e-4, 1.0e-2]}}'])
    assert "\n" not in str(err.value)
    cfg = load_config(QUICKSTART, ['tune.space={"model.options.head_lr": {"loguniform": [1.0e-4, 1.0e-2]}}'])
    assert "model.options.head_lr" in cfg.tune.space


def test_every_new_place_is_an_option_of_its_task():
    for old, (place, task) in MOVED.items():
        fields = task_class(task).Options.model_fields  # type: ignore[union-attr]
        option = place.removeprefix("model.options").lstrip(".")
        assert option == "" or option in fields, (old, place)
        assert option == "" or old.rsplit(".", 1)[-1] == option, (old, place)  # the same name, one level down


def test_the_image_options_keep_the_dataset_version():
    """The dataset versions of the image options are the ones the same settings had under their old
    keys (`preprocess.image_size`, `data.image_column`): a dataset preprocessed before is found again."""
    from workflows.preprocess.image_dataset import dataset_version
    from workflows.storage.shards import Shard

    shards = [Shard(uri=f"s3://b/raw/{i}.tar", version=str(i), size=100 + i) for i in range(2)]
    cfg = load_config(DIGITS, [])
    options = get_task(cfg).options
    # the versions of these shards with digits.yaml (32 px) before the move
    assert dataset_version(shards, "tar", cfg, options.image_size, options.image_column) == "296ab136f8c4d22a"
    parquet = [Shard(uri=f"s3://b/raw/{i}.parquet", version=str(i), size=100 + i) for i in range(2)]
    assert dataset_version(parquet, "parquet", cfg, 32, "image") == "86ccc965ade9418c"
    png = load_config(DIGITS, ["model.options.image_column=png"])
    assert dataset_version(parquet, "parquet", png, 32, get_task(png).options.image_column) == "81c16d797df173aa"
    other = load_config(DIGITS, ["model.options.image_size=48"])
    assert dataset_version(shards, "tar", other, get_task(other).options.image_size, "image") != "296ab136f8c4d22a"
