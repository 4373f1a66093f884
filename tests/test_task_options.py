"""The built-in tasks take their settings through their typed `Options` (`model.options`), as a
plug-in does; the keys they had before (`model.pooling`, `train.head_init`, `train.linear_probe_l2`,
`train.augment`, `preprocess.image_size`) are still read, with a deprecation message, and setting
one both ways to different values is an error. No Ray."""

from __future__ import annotations

import pytest

from tests.conftest import DIGITS, QUICKSTART
from workflows.config import load_config
from workflows.errors import UserError
from workflows.tasks import check_task, get_task


def test_the_shipped_configs_set_the_options_of_their_task():
    digits = get_task(load_config(DIGITS, [])).options
    assert digits.image_size == 32
    assert (digits.augment.flip, digits.augment.crop_scale, digits.augment.crop_ratio) == (False, (0.7, 1.0),
                                                                                           (0.9, 1.1))
    made = get_task(load_config("madewithml", ["data.source=/nowhere.csv"])).options
    assert (made.pooling, made.head_init, made.linear_probe_l2) == ("mean", "linear_probe", 1e-3)
    text = get_task(load_config(QUICKSTART, [])).options
    assert (text.pooling, text.head_init) == ("cls", "random")
    assert not get_task(load_config(QUICKSTART, [])).needs_probe_batches()
    assert get_task(load_config("madewithml", ["data.source=/nowhere.csv"])).needs_probe_batches()


def test_a_built_in_option_is_checked_like_a_plug_ins():
    for key, named in (("model.options.poolng=mean", "model.options.poolng: unknown option"),
                       ("model.options.pooling=max", "model.options.pooling: Input should be 'cls' or 'mean'")):
        with pytest.raises(UserError, match="task classification") as err:
            get_task(load_config(QUICKSTART, [key])).check_config()
        assert named in str(err.value)
    with pytest.raises(UserError, match="model.options.image_size: Input should be greater than or equal to 8"):
        get_task(load_config(DIGITS, ["model.options.image_size=4"])).check_config()


def test_the_old_keys_are_read_as_the_options_and_said_deprecated_once(capsys, monkeypatch):
    import workflows.tasks

    monkeypatch.setattr(workflows.tasks, "_DEPRECATION_SAID", set())
    old = load_config(QUICKSTART, ["model.pooling=mean", "train.head_init=linear_probe", "train.linear_probe_l2=0.5"])
    check_task(old)
    err = capsys.readouterr().err
    for key, option in (("model.pooling", "pooling"), ("train.head_init", "head_init"),
                        ("train.linear_probe_l2", "linear_probe_l2")):
        assert f"workflows: {key} is deprecated: it is the classification task's model.options.{option}" in err
    check_task(old)
    assert capsys.readouterr().err == ""  # once per process
    options = get_task(old).options
    assert (options.pooling, options.head_init, options.linear_probe_l2) == ("mean", "linear_probe", 0.5)

    # an image config of before: the keys under preprocess and train, none under model.options
    images = load_config(DIGITS, ["model.options={}", "preprocess.image_size=48", "train.augment.flip=true",
                                  "train.augment.crop_scale=[0.5,1.0]"])
    check_task(images)
    assert "train.augment is deprecated" in capsys.readouterr().err
    options = get_task(images).options
    assert options.image_size == 48 and options.augment.flip and options.augment.crop_scale == (0.5, 1.0)
    assert options.augment.crop_ratio == (3 / 4, 4 / 3)  # the rest of the section keeps its defaults


def test_an_option_set_both_ways_to_different_values_is_an_error_naming_both():
    cfg = load_config(DIGITS, ["preprocess.image_size=16"])  # digits sets model.options.image_size: 32
    with pytest.raises(UserError, match=r"model.options.image_size and preprocess.image_size \(its deprecated name\) "
                                        r"are both set, to 32 and 16"):
        check_task(cfg)
    same = load_config(DIGITS, ["preprocess.image_size=32"])  # the same value both ways is read once
    assert get_task(same).options.image_size == 32


def test_moving_image_size_into_the_options_keeps_the_dataset_version(tmp_path):
    """A dataset preprocessed with `preprocess.image_size` is the one the options form finds again."""
    from workflows.preprocess.image_dataset import dataset_version
    from workflows.storage.shards import Shard

    shards = [Shard(uri=f"s3://b/raw/{i}.tar", version=str(i), size=100 + i) for i in range(2)]
    new = load_config(DIGITS, [])
    old = load_config(DIGITS, ["model.options={}", "preprocess.image_size=32", "train.augment.flip=false"])
    versions = {dataset_version(shards, "tar", cfg, get_task(cfg).options.image_size) for cfg in (new, old)}
    assert len(versions) == 1
    other = load_config(DIGITS, ["model.options.image_size=48"])
    assert dataset_version(shards, "tar", other, get_task(other).options.image_size) not in versions
