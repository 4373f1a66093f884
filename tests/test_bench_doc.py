"""docs/BENCHMARKS.md is written by the benchmarks from their stored results, never typed by hand."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.record import render
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
        "report changed; regenerate it with `make bench-render` and commit it"
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
    """The registry names each kind once; the README states the same user commands."""
    import re

    from benchmarks.record import BENCHMARKS, HARNESS_BENCHMARKS, USER_BENCHMARKS
    from workflows.bench import BENCHMARKS as COMMANDS

    assert list(COMMANDS) == list(USER_BENCHMARKS)  # the product's command runs the user benchmarks only
    assert not set(USER_BENCHMARKS) & set(HARNESS_BENCHMARKS)
    assert BENCHMARKS == {**USER_BENCHMARKS, **HARNESS_BENCHMARKS}
    readme = " ".join((ROOT / "README.md").read_text().split())
    stated = re.search(r"`workflows bench ([a-z|-]+)` are user commands", readme)
    assert stated and stated.group(1).split("|") == list(USER_BENCHMARKS), (stated and stated.group(1))
    harness = re.search(r"are user commands\..*? ((?:`[a-z-]+`, )*`[a-z-]+`) and `([a-z-]+)` are the project's harness",
                        readme)
    assert harness and re.findall(r"`([a-z-]+)`", harness.group(1)) + [harness.group(2)] == list(HARNESS_BENCHMARKS)


def test_a_section_that_a_later_run_measured_again_is_marked_history(tmp_path):
    """A tagged run on the same settings (bench.rows only picks the rows) that measured a figure again
    makes the older section's figure history, named with the newer figure and a link to its section;
    a variant on other settings (bench.workers=1) does not, nor does the newer run's own section."""
    results = tmp_path / "results"
    results.mkdir()
    for name in ("images", "images-cold", "images-train-1worker"):
        shutil.copy(RESULTS / f"{name}.json", results / f"{name}.json")
    doc = tmp_path / "BENCHMARKS.md"
    render("images", results, doc)
    text = doc.read_text()
    sections = {m.group(1): m.group(2) for m in re.finditer(r"<!-- bench:(\S+) -->\n(.*?)<!-- /bench:", text, re.S)}
    old = sections["images"]
    heading = "## Images: a training loop's input pipeline\n\n"
    assert old.startswith(heading + "**History, not the current figures**"), old[:300]
    note = old.splitlines()[2]
    assert ("`cold_vs_best_peer` 0.901" in note and "(#images-a-training-loops-input-pipeline-cold)" in note
            and "2026-11-27" in note), note
    assert "two_workers_vs_one" not in note  # the train-1worker run is a variant: one decode process
    assert "History" not in sections["images-cold"] and "History" not in sections["images-train-1worker"]


def _rows(r: dict, row: str, phase: str) -> dict:
    return r["rows"][row][phase]


def _index_then_warm(r: dict) -> float:
    """Ours with the index built first, then a warm epoch, over the best peer's cold whole pass."""
    images = _rows(r, "ours", "ours_warm")["images"]
    seconds = _rows(r, "ours_index", "ours_index_build")["seconds"] + _rows(r, "ours", "ours_warm")["seconds"]
    return images / seconds / _rows(r, "webdataset", "webdataset")["images_per_s_whole_pass"]


def _preprocess_seconds(results: dict) -> list[float]:
    return sorted(results[f]["rows"]["train_ray_data"]["train_ray_data_preprocess"]["seconds"]
                  for f in ("images-train", "images-train-1worker"))


# Every figure the README and its guides cite from a benchmark's results: their words with `{}` where
# the figure stands, the results file(s), and the figure as read from them.
def _bf16_exact_match(r: dict) -> str:
    return f"{r['chat']['served_precisions']['bf16']['exact_match']:.4f}"


def _bf16_speed(r: dict) -> str:
    return f"{r['chat']['served_precisions']['bf16_vs_fp32_tokens_per_s']:.2f}"


def _packed_speedup(r: dict) -> str:
    """Static batching's tokens/s on the engine's packed weights over on transformers' own, one run."""
    return f"{_row(r, 'static_packed') / _row(r, 'static'):.2f}"


def _row(r: dict, row: str, run: str = "generate") -> float:
    """A generate run's tokens/s of one row (`run`: its results file, the full run's by default)."""
    return next(x["tokens_per_s"] for x in r[run]["rows"] if x["row"] == row)


def _bf16_vs_llama(concurrency: int):
    return lambda r: f"{r['generate-bf16'][f'vs_llama_cpp_c{concurrency}']:.2f}"


def _attention_time(r: dict, i: int) -> str:
    """The decode attention kernel's time over torch's operators', at the benchmark's i-th context."""
    ms = r["decode-attention"]["contexts"][i]["ms"]
    return f"{ms['kernel'] / ms['torch']:.2f}"


README_FIGURES: list[tuple[str, tuple[str, ...], object]] = [
    ("warm epoch is {}x the best peer's", ("images-cold",), lambda r: f"{r['images-cold']['warm_vs_best_peer']:.2f}"),
    ("runs at {}x WebDataset's steady rate", ("images-cold",), lambda r: "{:.2f}".format(
        _rows(r["images-cold"], "ours", "ours_cold")["images_per_s"]
        / _rows(r["images-cold"], "webdataset", "webdataset")["images_per_s"])),
    ("and {}x over the whole pass", ("images-cold",), lambda r: f"{r['images-cold']['cold_indexed_vs_best_peer']:.2f}"),
    ("its first batch, at {} s against", ("images-cold",),
     lambda r: f"{_rows(r['images-cold'], 'ours', 'ours_cold')['first_batch_s']:.1f}"),
    ("against {} s, waits", ("images-cold",),
     lambda r: f"{_rows(r['images-cold'], 'webdataset', 'webdataset')['first_batch_s']:.1f}"),
    ("and {}x when the index is built first", ("images-cold",),
     lambda r: f"{r['images-cold']['cold_vs_best_peer']:.2f}"),
    ("4 at a time: {} s per GB", ("images-cold",), lambda r: "{:.1f}".format(
        _rows(r["images-cold"], "ours_index", "ours_index_build")["seconds"]
        / (r["images-cold"]["set"]["bytes"] / 1e9))),
    ("would be {}x", ("images-cold",), lambda r: f"{_index_then_warm(r['images-cold']):.2f}"),
    ("delivers {}x what it delivers alone with 1 decode process", ("images-train-1worker",),
     lambda r: f"{r['images-train-1worker']['train_step_vs_loader']:.2f}"),
    ("and {}x with 2 (the trainer", ("images-train",), lambda r: f"{r['images-train']['train_step_vs_loader']:.2f}"),
    ("deliver {}x and", ("images-train-1worker",),
     lambda r: f"{r['images-train-1worker']['ray_data_train_step_vs_loader']:.2f}"),
    ("and {}x of the same figures", ("images-train",),
     lambda r: f"{r['images-train']['ray_data_train_step_vs_loader']:.2f}"),
    ("after {} s of preprocessing", ("images-train", "images-train-1worker"),
     lambda r: "{:.0f}-{:.0f}".format(*_preprocess_seconds(r))),
    ("cache with {} GiB of memory", ("images-scale",),
     lambda r: f"{max(p['ours_cold']['peak_pss_bytes'] for p in r['images-scale']['points']) / 2**30:.2f}"),
    ("at least {}x the 1 GB set's", ("images-scale",),
     lambda r: f"{min(p['images_per_s_vs_smallest'] for p in r['images-scale']['points']):.2f}"),
    ("held-out weighted F1 {} in", ("madewithml",), lambda r: f"{r['madewithml']['weighted_f1']:.3f}"),
    ("in {} epochs (", ("madewithml",), lambda r: str(r["madewithml"]["epochs"])),
    ("({} over `train.seed`", ("madewithml",), lambda r: "{:.3f}-{:.3f}".format(
        min(r["madewithml"]["weighted_f1_by_seed"].values()), max(r["madewithml"]["weighted_f1_by_seed"].values()))),
    ("SciBERT at {}", ("madewithml",), lambda r: f"{r['madewithml']['reference_f1']:.3f}"),
    ("({} errors in", ("madewithml",), lambda r: str(r["madewithml"]["test_errors"])),
    ("in {} held-out rows", ("madewithml",), lambda r: str(r["madewithml"]["test_rows"])),
    ("--config digits      # {} s on 2 cores", ("digits",), lambda r: f"{r['digits']['wall_seconds']:.0f}"),
    ("held-out weighted F1 {} (", ("digits",), lambda r: f"{r['digits']['weighted_f1']:.3f}"),
    ("0 of {} at concurrency", ("serve",), lambda r: f"{r['serve']['rolling_update']['requests']:,}"),
    ("at concurrency {}); it rolls over", ("serve",), lambda r: str(r["serve"]["rolling_update"]["concurrency"])),
    # the README's table of headline figures, a row per kind of model
    ("| `quickstart` | {} s |", ("quickstart",), lambda r: f"{r['quickstart']['wall_seconds']:.0f}"),
    ("| weighted F1 {} (majority class", ("quickstart",),
     lambda r: f"{r['quickstart']['weighted_f1']:.3f}"),
    ("(majority class {}) |", ("quickstart",), lambda r: f"{r['quickstart']['majority_baseline_f1']:.3f}"),
    ("| `digits` (run of 2026-11-25) | {} s |", ("digits",), lambda r: f"{r['digits']['wall_seconds']:.0f}"),
    ("| weighted F1 {} | raw, multipart", ("digits",), lambda r: f"{r['digits']['weighted_f1']:.3f}"),
    ("| `chat` | {} s |", ("chat",), lambda r: f"{r['chat']['wall_seconds']:.0f}"),
    ("| exact match {} (base model", ("chat",), lambda r: f"{r['chat']['exact_match']:.3f}"),
    ("(base model {}) |", ("chat",), lambda r: f"{r['chat']['base_exact_match']:.3f}"),
    ("| {} tokens/s at 16 streams over HTTP", ("generate",),
     lambda r: f"{_row(r, 'http_c16', 'generate'):.1f}"),
    ("over HTTP, {}x vLLM's CPU build on the same weights (run", ("generate",),
     lambda r: f"{r['generate']['vs_vllm_c16']:.2f}"),
    ("on the same fp32 weights, gives {}x our tokens/s at concurrency 1", ("generate",),
     lambda r: f"{_row(r, 'vllm_c1') / _row(r, 'http_c1'):.2f}"),
    ("our tokens/s at concurrency 1 and {}x at 16 (", ("generate",),
     lambda r: f"{_row(r, 'vllm_c16') / _row(r, 'http_c16'):.2f}"),
    ("ours gave {} tokens/s over HTTP: ", ("generate",),
     lambda r: f"{_row(r, 'http_c16', 'generate'):.1f}"),
    ("tokens/s over HTTP: {}x\nvLLM's", ("generate",), lambda r: f"{r['generate']['vs_vllm_c16']:.2f}"),
    ("vLLM's and {}x the engine called directly", ("generate",),
     lambda r: f"{r['generate']['http_vs_engine_c16']:.2f}"),
    ("its first token p50 at {}x vLLM's", ("generate",),
     lambda r: f"{r['generate']['ttft_c16_vs_best_peer']:.2f}"),
    ("a lone stream's step took {}x the dynamic graph's", ("step-profile",),
     lambda r: f"{1 / r['step-profile']['one_token_speedup_decode_1']:.2f}"),
    ("attention in {}x the time of torch's operators at a mean context of 88", ("decode-attention",),
     lambda r: _attention_time(r, 0)),
    ("mean context of 88 and {}x at 600", ("decode-attention",), lambda r: _attention_time(r, 1)),
    ("At concurrency 16 over HTTP it gives {}x the output tokens/s of static batching", ("generate",),
     lambda r: f"{r['generate']['http_vs_static_c16']:.2f}"),
    ("packed weights it gives {}x", ("generate",), lambda r: f"{r['generate']['http_vs_static_packed_c16']:.2f}"),
    ("static batching of 16 prompts ran {}x as fast on the packed weights", ("generate",), _packed_speedup),
    ("lengths and {}x with natural stopping", ("generate",),
     lambda r: f"{r['generate']['http_vs_static_natural_c16']:.2f}"),
    ("The inter-token p99 is {}x its p50", ("generate",), lambda r: f"{r['generate']['itl_p99_over_p50_c16']:.2f}"),
    ("the time to first token at 16 is {}x that at 1", ("generate",),
     lambda r: f"{r['generate']['ttft_c16_over_c1']:.2f}"),
    ("a decode step at 32 runs at {}x its roofline", ("generate",),
     lambda r: f"{r['generate']['decode_vs_roofline']:.2f}"),
    ("its matmuls alone (each weight once, timed in the same run) take {}x of its time", ("generate",),
     lambda r: f"{r['generate']['decode_vs_matmul_floor']:.2f}"),
    ("of its time, at {}x the roofline's", ("generate",), lambda r: f"{r['generate']['matmul_floor_vs_roofline']:.2f}"),
    ("gives {}x our\ntokens/s at concurrency 1", ("generate",),
     lambda r: f"{1 / r['generate']['vs_llama_cpp_c1']:.2f}"),
    ("our\ntokens/s at concurrency 1 and {}x at 16 in the same run", ("generate",),
     lambda r: f"{1 / r['generate']['vs_llama_cpp_c16']:.2f}"),
    ("it took {}x the time of transformers' own decode step", ("generate-decode-step",),
     lambda r: f"{1 / r['generate-decode-step']['decode_vs_transformers']:.2f}"),
    ("a `json_schema` response keeps {}x the unconstrained tokens/s at 16", ("generate",),
     lambda r: f"{r['generate']['json_schema_vs_unconstrained_c16']:.2f}"),
    ("Requests naming a LoRA adapter keep {}x the base model's tokens/s at 16", ("generate",),
     lambda r: f"{r['generate']['lora_vs_base_c16']:.2f}"),
    ("and {}x vLLM's with `--enable-lora` and the same adapter", ("generate",),
     lambda r: f"{r['generate']['lora_vs_vllm_lora_c16']:.2f}"),
    # bf16 served: the README's figures, then the serving guide's, the same four
    ("keeps its held-out exact match ({}, as in fp32)", ("chat",), _bf16_exact_match),
    ("as in fp32) at {}x fp32's tokens/s", ("chat",), _bf16_speed),
    ("it gives {}x llama.cpp's tokens/s at 16", ("generate-bf16",), _bf16_vs_llama(16)),
    ("llama.cpp's tokens/s at 16 and {}x at concurrency 1", ("generate-bf16",), _bf16_vs_llama(1)),
    ("SmolLM2-135M in bf16 gave {}x the tokens/s of llama.cpp's server", ("generate-bf16",), _bf16_vs_llama(16)),
    ("over HTTP and {}x at 1, where a step", ("generate-bf16",), _bf16_vs_llama(1)),
    ("kept their exact match in bf16 ({}, as in fp32", ("chat",), _bf16_exact_match),
    ("the same text) at {}x fp32's tokens/s", ("chat",), _bf16_speed),
    # the serving guide's two engines
    ("Our API over vLLM's engine gave {}x vLLM's own server's tokens/s at 16", ("generate-vllm-engine",),
     lambda r: f"{r['generate-vllm-engine']['vllm_engine_vs_vllm_server_c16']:.2f}"),
    ("vLLM's own server's tokens/s at 16 and {}x at 1", ("generate-vllm-engine",),
     lambda r: f"{r['generate-vllm-engine']['vllm_engine_vs_vllm_server_c1']:.2f}"),
    ("with vLLM's engine at {}x the builtin engine's", ("chat-engines",),
     lambda r: f"{r['chat-engines']['vllm_vs_builtin_tokens_per_s']:.2f}"),
    ("requests naming an adapter got {}x the tokens/s of vLLM's server with `--enable-lora`", ("generate",),
     lambda r: f"{r['generate']['lora_vs_vllm_lora_c16']:.2f}"),
]
# figures written as `N.Nx` in the README that no benchmark measured: goals, and this machine's RAM
NOT_MEASURED = [r"the {}x goal", r"the goal is {}x", r"{}x this machine's RAM"]
# changes after which an older run's figures are no longer what the command gives: a figure from a
# run before one of these must say the run's date in its paragraph
CHANGES = [("2026-11-26T13:25:32Z", "rows stored in a seeded shuffled order (d09766c)", {"madewithml", "digits",
                                                                                         "quickstart"}),
           ("2026-11-28T17:00:00Z", "the rolling update driven by an alias move at concurrency 32 (issue 64)",
            {"serve"}),
           ("2026-11-29T00:35:00Z", "a chunk streamed per token, each timed by the bench's client", {"generate"}),
           ("2026-11-29T02:54:00Z", "fp32 linears packed for oneDNN in the engine (9d2114d)", {"generate"}),
           ("2026-11-29T09:48:00Z", "the engine's prefill budget beside decoding rows (d66aaf4)", {"generate"}),
           ("2026-12-02T03:40:00Z", "train.num_workers auto: the quickstart trains one worker of every core",
            {"quickstart"}),
           ("2026-12-07T15:00:00Z", "the engine's decode attention kernel (serve.generate.attention_kernel)",
            {"generate", "step-profile"})]


def _readme() -> str:
    """The user docs that cite figures: the README and its guides (docs/guides/*.md), one text."""
    return "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))])


def test_the_readme_cites_each_benchmark_figure_from_its_latest_run():
    """Each figure the README cites is read from its results file, as the README words it; no later
    run of the same benchmark measured it again; a run from before a change that alters what the
    command gives names its date beside the figure; and no `N.Nx` figure stands in the README that is
    neither cited from a results file nor a goal."""
    from benchmarks.record import superseded

    stored = {p.stem: json.loads(p.read_text()) for p in RESULTS.glob("*.json")}
    readme = _readme()
    flat = " ".join(readme.split())
    paragraphs = [" ".join(p.split()) for p in readme.split("\n\n")]
    covered: list[tuple[int, int]] = []
    for words, files, figure in README_FIGURES:
        text = " ".join(words.format(figure(stored)).split())  # type: ignore[operator]
        assert text in flat, f"README: expected {text!r} (from {', '.join(files)})"
        start = flat.index(text)
        covered.append((start, start + len(text)))
        for f in files:
            later = superseded(stored[f], list(stored.values()))
            assert not later, f"README cites {f}.json for {text!r}, but a later run measured {sorted(later)} again"
            run = stored[f]
            for when, what, benches in CHANGES:
                if run["benchmark"] in benches and run["measured_at"] < when:
                    para = next(p for p in paragraphs if text in p)
                    assert run["measured_at"][:10] in para, (
                        f"README: {text!r} is from the run of {run['measured_at'][:10]}, before {what}: "
                        "say the run's date beside it")
    allowed = [re.compile(re.escape(p).replace(re.escape("{}"), r"\d+(?:\.\d+)?")) for p in NOT_MEASURED]
    for m in re.finditer(r"\b\d+\.\d+x\b", flat):
        if any(a <= m.start() < b for a, b in covered):
            continue
        around = flat[max(0, m.start() - 40): m.end() + 40]
        assert any(a.search(around) for a in allowed), (
            f"README figure {m.group()} in {around!r} is cited from no results file (add it to README_FIGURES)")


def test_the_readmes_links_into_benchmarks_md_reach_current_sections():
    """A README link to a section of docs/BENCHMARKS.md names a heading that exists, and not a section
    whose figures a later run measured again (marked history by the renderer)."""
    from benchmarks.record import anchor

    doc = DOC.read_text()
    headings = {anchor(ln): n for n, ln in enumerate(doc.splitlines()) if ln.startswith("## ")}
    lines = doc.splitlines()
    links = re.findall(r"(?:docs/|\.\./)BENCHMARKS\.md#([\w-]+)", _readme())
    assert links
    for link in links:
        assert link in headings, f"README links to docs/BENCHMARKS.md#{link}: no such section"
        assert not lines[headings[link] + 2].startswith("**History"), f"docs/BENCHMARKS.md#{link} is history"
