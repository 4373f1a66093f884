"""Where `workflows bench` keeps what it measured (benchmarks/results/) and the doc it renders
(docs/BENCHMARKS.md), and how one section of that doc is rewritten. Below the registry
(workflows.bench) and every bench: the benches and the GPU section import it, never the registry."""

from __future__ import annotations

import re
from pathlib import Path

from workflows.storage.atomic import atomic_write

RESULTS_DIR = Path("benchmarks/results")
DOC = Path("docs/BENCHMARKS.md")


def write_doc_section(name: str, body: str, doc: Path = DOC) -> None:
    """Replace the section between `<!-- bench:NAME -->` markers of `doc`, or append it."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = (
        doc.read_text()
        if doc.exists()
        else "# Benchmarks\n\nEvery figure here is written by `workflows bench NAME` (`--render`: from the stored"
        " results); none is typed by hand.\n"
    )
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    atomic_write(doc, text)
