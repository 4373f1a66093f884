"""Where the project's benchmarks keep what they measured (benchmarks/results/) and the doc they render
(docs/BENCHMARKS.md), and how one section of that doc is rewritten: benchmarks.record and the GPU
section (workflows.bench.gpu_doc) import it. It belongs in benchmarks/, with gpu_doc."""

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
        else "# Benchmarks\n\nEvery figure here is written by `python -m benchmarks.NAME` (`make bench-render`: from"
        " the stored results); none is typed by hand.\n"
    )
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    atomic_write(doc, text)
