"""docs/CONFIG.md is rendered from workflows/config/ and must not drift from it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from workflows import config_reference as ref
from workflows.config import WorkflowConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG_MD = ROOT / "docs" / "CONFIG.md"


def test_config_md_is_up_to_date():
    rendered = ref.render()
    current = CONFIG_MD.read_text() if CONFIG_MD.is_file() else ""
    assert current == rendered, (
        f"{CONFIG_MD.relative_to(ROOT)} is stale or missing (workflows/config/ changed): "
        f"regenerate it with `{ref.REGENERATE}` and commit it"
    )


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        sub = ref._model_of(field.annotation)
        keys += _all_keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
    return keys


def test_every_section_and_field_is_in_the_reference():
    text = ref.render()
    keys = _all_keys(WorkflowConfig)
    assert len(keys) > 60
    for key in keys:
        assert f"| `{key}` |" in text, key
    for section in ("storage", "storage.embedded", "cache", "ray", "data", "preprocess", "model", "train", "tune",
                    "evaluate", "registry", "serve"):
        assert f"## `{section}`" in text, section
    for key in ("uniform", "loguniform", "choice", "grid"):
        assert f"| `tune.space.<train field>.{key}` |" in text
    # descriptions, defaults, constraints and required keys come from the models
    assert "| `train.lr` | `float` | `0.0001` | > 0 |" in text
    assert "| `data.source` | `str` | *required* |" in text
    assert "URI of a raw shard, a directory of shards or a glob" in text
    assert '`"fsdp" \\| "ddp"`' in text
    # the built-in tasks' options, and the keys that moved to them
    from workflows.tasks.causal_lm.options import CausalLMOptions
    from workflows.tasks.image import ImageOptions
    from workflows.tasks.text import TextOptions

    for options in (TextOptions, ImageOptions, CausalLMOptions):
        for key in _all_keys(options, "model.options."):
            assert f"| `{key}` |" in text, key
    assert "## Task `image_classification`: `model.options.augment`" in text
    assert "| `model.pooling` | `model.options.pooling` | `classification` |" in text
    assert "| `train.head_lr` | `model.options.head_lr` | `classification` |" in text
    assert "| `model.lm.seq_len` | `model.options.seq_len` | `causal_lm` |" in text
    assert "| `model.pooling` | `" not in text.split("## Keys that moved")[0]  # no longer a key of the config


class _Documented(BaseModel):
    """A section documented by its docstring."""

    plain: int = 1  # from the comment on its line
    # from the comment
    # above its line
    above: str = "x"
    described: float | None = Field(None, ge=0, description="from Field(description=...)")  # not this
    mode: Literal["a", "b"] = "a"
    bare: bool = False


def test_descriptions_come_from_field_then_comments():
    (_, model, rows), = list(ref.sections(_Documented))
    assert ref.class_doc(model) == "A section documented by its docstring."
    got = {name: ref.description(model, name, field) for _, name, field in rows}
    assert got == {"plain": "from the comment on its line", "above": "from the comment above its line",
                   "described": "from Field(description=...)", "mode": "", "bare": ""}
    fields = _Documented.model_fields
    assert ref.type_name(fields["described"].annotation) == "float | null"
    assert ref.type_name(fields["mode"].annotation) == '"a" | "b"'
    assert ref.constraints_text(fields["described"]) == "≥ 0"
    assert ref.default_text(fields["above"]) == "`x`" and ref.default_text(fields["described"]) == "`null`"


def test_check_mode_exits_1_when_stale_and_0_when_fresh(tmp_path, capsys):
    out = tmp_path / "CONFIG.md"
    assert ref.main(["--check", "--output", str(out)]) == 1  # missing
    assert "python -m workflows.config_reference" in capsys.readouterr().err
    assert ref.main(["--output", str(out)]) == 0
    assert ref.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("| `train.lr` |", "| `train.learning_rate` |"))
    assert ref.main(["--check", "--output", str(out)]) == 1
