"""The project's benchmark records: run a benchmark, store benchmarks/results/NAME[-TAG].json and
rewrite its section of docs/BENCHMARKS.md, or rewrite sections from the stored results without running
anything (--render). Every figure in docs/BENCHMARKS.md is written here; none is typed by hand.

    python -m benchmarks.NAME [--config C] [--set k=v ...] [--tag T]   (make bench-NAME)
    python -m benchmarks.record --render NAME|all|gpu                   (make bench-render)

Two kinds, from what each measures:
- the user commands run on the shipped configs (USER_BENCHMARKS): data, train, tune, serve, lm, generate. Each
  is `workflows bench NAME`'s measurement (workflows.bench) with the section that reports it, and for data and
  serve what only the project's claims need (the preprocessing speedup on one node; the latency figure);
- the harness (HARNESS_BENCHMARKS): claims about the project itself: quickstart and digits (the shipped
  configs' pipeline against their plain-PyTorch work), chat (the chat demo's time and exact-match gain),
  chat-engines (the chat demo's answers through the builtin engine and vLLM's),
  madewithml (a reference F1), signing (signed versions' cost beside evaluate and a replica's start),
  request-bodies (what reading a chat request holds a replica's event loop, whatever its body),
  prefill-join (a long prompt joining running streams: their token gaps under each prefill budget),
  step-profile (where the engine's step goes: torch.profiler of its decode and mixed steps),
  openmp-pool (the engine's decode steps with the building thread's OpenMP pool released or kept),
  serve-levers (Serve's flags against the peer), shuffle and images (peers from `make bench-peers`'s .venv-peers).
The GPU measurement runs without Ray on a CUDA machine (benchmarks/gpu/, `make bench-gpu`); `--render gpu`
writes its section from the stored gpu-*.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import sys
from pathlib import Path

from workflows.bench import measure
from workflows.errors import UserError
from workflows.storage.atomic import atomic_write

RESULTS_DIR = Path("benchmarks/results")  # what each run measured, NAME[-TAG].json
DOC = Path("docs/BENCHMARKS.md")  # the doc rendered from them

USER_BENCHMARKS = {"data": "benchmarks.data", "train": "benchmarks.train", "tune": "benchmarks.tune",
                   "serve": "benchmarks.serve", "lm": "benchmarks.lm", "generate": "benchmarks.generate"}
HARNESS_BENCHMARKS = {"quickstart": "benchmarks.quickstart", "digits": "benchmarks.digits",
                      "madewithml": "benchmarks.madewithml", "serve-levers": "benchmarks.serve_levers",
                      "shuffle": "benchmarks.shuffle", "images": "benchmarks.images", "chat": "benchmarks.chat",
                      "chat-engines": "benchmarks.chat_engines",
                      "signing": "benchmarks.signing", "request-bodies": "benchmarks.request_bodies",
                      "prefill-join": "benchmarks.prefill_join", "step-profile": "benchmarks.step_profile",
                      "openmp-pool": "benchmarks.openmp_pool", "decode-attention": "benchmarks.decode_attention"}
BENCHMARKS = {**USER_BENCHMARKS, **HARNESS_BENCHMARKS}


def write_doc_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the section between `<!-- bench:NAME -->` markers of `doc`, or append it."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = (
        doc.read_text()
        if doc.exists()
        else "# Benchmarks\n\nEvery figure here is written by `python -m benchmarks.NAME` (`make bench-render`: from"
        " the stored results); none is typed by hand.\n"
    )
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    atomic_write(doc, text)


def record(name: str, config: str | None, overrides: list[str], command: str, tag: str | None = None,
           results_dir: str | Path = RESULTS_DIR, doc: str | Path = DOC) -> dict:
    """Run benchmark `name`; write `results_dir/NAME[-TAG].json` and its section of `doc`.

    A tag keeps a variant (another size, another cluster) beside the default run instead of over it.
    """
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    if tag is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,39}", tag):
        raise UserError(f"--tag {tag!r}: lower-case letters, digits and '-' (it names a file)")
    key = f"{name}-{tag}" if tag else name
    module = importlib.import_module(BENCHMARKS[name])
    result = {**measure(module.run, name, config, overrides, command), "tag": tag}
    results_dir, doc = Path(results_dir), Path(doc)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{key}.json"
    text = json.dumps(result, indent=2, sort_keys=True)
    atomic_write(path, text)
    result = json.loads(text)  # the doc renders what was stored, as `--render` will later
    # every section of this benchmark: this run may have measured again what an older one shows
    render(name, results_dir, doc)
    print(f"results written to {path} and {doc}")
    return result


def heading(module, result: dict) -> str:
    """The section's heading, as its markdown writes it (with its tag)."""
    first = next(ln for ln in module.markdown(result).splitlines() if ln.startswith("## "))
    return f"{first} ({result['tag']})" if result.get("tag") else first


def anchor(title: str) -> str:
    """GitHub's anchor of a markdown heading ("## Images: a loop (cold)" -> "images-a-loop-cold")."""
    return re.sub(r"[^\w\- ]", "", title.removeprefix("## ").strip().lower()).replace(" ", "-")


def _settings(command: str, selection: tuple[str, ...]) -> tuple[str, ...]:
    """The `--set` values of a stored command line, less those that only choose what is measured."""
    args = shlex.split(command)
    sets = [v for flag, v in zip(args, args[1:]) if flag == "--set"]
    return tuple(sorted(v for v in sets if v.split("=", 1)[0] not in selection))


def superseded(result: dict, results: list[dict]) -> dict[str, dict]:
    """The figures of `result` that a later run of the same benchmark, on the same settings (the
    module's SELECTION_SETTINGS aside, which only pick the rows to run), measured again: figure ->
    the newest such run. Only a module's FIGURES count (its headline numbers, not its settings)."""
    module = importlib.import_module(BENCHMARKS[result["benchmark"]])
    selection = tuple(getattr(module, "SELECTION_SETTINGS", ()))
    mine = _settings(result.get("command", ""), selection)
    out: dict[str, dict] = {}
    for other in sorted(results, key=lambda r: r.get("measured_at") or ""):
        if (other is result or other.get("benchmark") != result["benchmark"]
                or (other.get("measured_at") or "") <= (result.get("measured_at") or "")
                or _settings(other.get("command", ""), selection) != mine):
            continue
        for key in getattr(module, "FIGURES", ()):
            if isinstance(result.get(key), (int, float)) and isinstance(other.get(key), (int, float)):
                out[key] = other  # the newest wins: sorted by time
    return out


def history_note(result: dict, later: dict[str, dict]) -> str:
    """The line under a section's heading whose figures a later run measured again."""
    by_run: dict[str, tuple[dict, list[str]]] = {}
    for key, other in later.items():
        by_run.setdefault(other.get("measured_at") or "", (other, []))[1].append(key)
    where = []
    for when, (other, keys) in sorted(by_run.items()):
        title = heading(importlib.import_module(BENCHMARKS[other["benchmark"]]), other)
        figures = ", ".join(f"`{k}` {other[k]}" for k in keys)
        where.append(f"{figures} in [{title.removeprefix('## ')}](#{anchor(title)}) ({when[:10]})")
    return (f"**History, not the current figures**: a later run measured {len(later)} of this run's figures again: "
            f"{'; '.join(where)}. This section is the earlier run's, kept for what no later run measured.")


def section_body(module, result: dict, later: dict[str, dict] | None = None) -> str:
    body = module.markdown(result)
    if result.get("tag"):  # the section's heading names its variant
        body = re.sub(r"^(## .*)$", rf"\1 ({result['tag']})", body, count=1, flags=re.M)
    if later:
        body = re.sub(r"^(## .*)$", lambda m: f"{m.group(1)}\n\n{history_note(result, later)}", body,
                      count=1, flags=re.M)
    return body


def render(name: str, results_dir: str | Path = RESULTS_DIR, doc: str | Path = DOC) -> list[Path]:
    """Rewrite `doc`'s sections from the stored results of benchmark `name` ("all": every one, tags
    included) without running anything: after a change to a benchmark's report, or to check that
    the doc is what its results say."""
    if name not in ("all", "gpu") and name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; available: all, gpu, {', '.join(sorted(BENCHMARKS))}")
    paths = []
    if name in ("all", "gpu"):  # run on a GPU machine by benchmarks/gpu/run.sh; "not lent yet" without results
        from benchmarks.gpu import doc as gpu_doc  # imports this module: not at the top

        paths += gpu_doc.render(results_dir, Path(doc))
        if name == "gpu":
            return paths
    stored = {path: json.loads(path.read_text()) for path in sorted(Path(results_dir).glob("*.json"))}
    for path, result in stored.items():
        bench = result.get("benchmark")
        if bench in BENCHMARKS and name in ("all", bench):
            key = f"{bench}-{result['tag']}" if result.get("tag") else bench
            later = superseded(result, list(stored.values()))
            write_doc_section(key, section_body(importlib.import_module(BENCHMARKS[bench]), result, later),
                              Path(doc))
            paths.append(path)
    if not paths:
        raise UserError(f"no stored results for {name!r} in {results_dir}")
    return paths


def main(name: str | None = None, argv: list[str] | None = None) -> None:
    """`python -m benchmarks.NAME` (name given) or `python -m benchmarks.record NAME`."""
    module = BENCHMARKS.get(name or "", "benchmarks.record")
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=__doc__.split("\n\n")[0])
    if name is None:
        p.add_argument("name", help=f"all, gpu or one of: {', '.join(sorted(BENCHMARKS))} (all and gpu: --render)")
    p.add_argument("--config", "-c", default=None, help="config (default: the benchmark's own)")
    p.add_argument("--set", action="append", default=[], help="override a config key (repeatable)")
    p.add_argument("--tag", default=None, help="a variant: results in NAME-TAG.json, its own doc section")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="directory for the results JSON")
    p.add_argument("--doc", default=str(DOC), help="markdown file whose bench section is rewritten")
    p.add_argument("--render", action="store_true", help="run nothing: rewrite NAME's sections (NAME 'all': "
                   "every one) of --doc from the results stored in --results-dir")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    name = name or args.name
    try:
        if args.render:
            paths = render(name, args.results_dir, args.doc)
            print(f"{args.doc} rewritten from {len(paths)} result file(s) in {args.results_dir}")
        else:
            given = list(sys.argv[1:] if argv is None else argv)
            if module == "benchmarks.record":
                given.remove(name)
            command = " ".join(["python", "-m", BENCHMARKS.get(name, module), *map(shlex.quote, given)])
            record(name, args.config, args.set, command, tag=args.tag, results_dir=args.results_dir, doc=args.doc)
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
