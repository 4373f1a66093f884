"""docs/BENCHMARKS.md is written by the benchmarks from their stored results, never typed by hand."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from workflows.bench import render
from workflows.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"


def test_doc_is_what_the_stored_results_render(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    shutil.copy(DOC, doc)
    rendered = render("all", RESULTS, doc)
    assert {p.stem for p in rendered} >= {"quickstart", "data", "train", "tune", "serve", "lm", "madewithml"}
    assert doc.read_text() == DOC.read_text(), (
        "docs/BENCHMARKS.md differs from its stored results: a section was edited by hand, or a benchmark's "
        "report changed; regenerate it with `workflows bench all --render` and commit it"
    )


def test_render_rewrites_only_the_named_sections(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    quickstart = json.loads((RESULTS / "quickstart.json").read_text())
    quickstart["wall_vs_work_ratio"] = 9.99
    (results / "quickstart.json").write_text(json.dumps(quickstart))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\n<!-- bench:quickstart -->\nstale\n<!-- /bench:quickstart -->\n\nkept by hand\n")
    render("quickstart", results, doc)
    text = doc.read_text()
    assert "stale" not in text and "**9.99x**" in text and text.endswith("kept by hand\n")
    with pytest.raises(UserError, match="no stored results for 'train'"):
        render("train", results, doc)
    with pytest.raises(UserError, match="unknown benchmark 'nope'"):
        render("nope", results, doc)


def test_each_bench_is_a_user_command_or_the_harness_and_the_readme_says_which():
    """The decision of #38 lives once in the registry; the README states the same user commands."""
    import re

    from workflows.bench import BENCHMARKS, HARNESS_BENCHMARKS, USER_BENCHMARKS

    assert not set(USER_BENCHMARKS) & set(HARNESS_BENCHMARKS)
    assert BENCHMARKS == {**USER_BENCHMARKS, **HARNESS_BENCHMARKS}
    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"`workflows bench ([a-z|-]+)` are user commands", readme)
    assert stated and stated.group(1).split("|") == list(USER_BENCHMARKS), (stated and stated.group(1))
    harness = re.search(r"are user commands\..*? ((?:`[a-z-]+`, )*`[a-z-]+`) and `([a-z-]+)` are the project's harness",
                        readme)
    assert harness and re.findall(r"`([a-z-]+)`", harness.group(1)) + [harness.group(2)] == list(HARNESS_BENCHMARKS)
