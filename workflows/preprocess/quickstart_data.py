"""The quickstart dataset, built offline from human-written text that ships with the dependencies.

Each row is the summary of the docstring of a public function, class or method of one installed
library; the label is the library. Four libraries, four domains of scientific Python:

  torch       -> deep-learning        pandas   -> dataframes
  matplotlib  -> plotting             scipy    -> scientific-computing

The rows are deterministic for a given environment (same library versions -> same rows): modules
are walked in a fixed order, texts deduplicated across classes, and the kept subset chosen by a
hash of the text, not by a random generator. A module that fails to import (missing from this
version of its library, or broken) is skipped, which changes the rows and so the dataset's
version: `build_dataset` names each one and why, and the data line of `workflows preprocess` /
`workflows pipeline` and the preprocess summary repeat it. See docs/data/quickstart.md for the data card.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import logging
import re
import warnings
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LIBRARIES: dict[str, list[str]] = {
    "deep-learning": [
        "torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.nn.utils", "torch.optim",
        "torch.optim.lr_scheduler", "torch.autograd", "torch.distributed", "torch.utils.data", "torch.linalg",
        "torch.fft", "torch.special", "torch.distributions", "torch.sparse", "torch.cuda", "torch.amp",
        "torch.jit", "torch.export", "torch.func", "torch.nn.parallel", "torch.utils.checkpoint",
    ],
    "dataframes": [
        "pandas", "pandas.api.types", "pandas.api.extensions", "pandas.plotting", "pandas.tseries.offsets",
        "pandas.core.groupby", "pandas.core.window.rolling", "pandas.core.resample", "pandas.io.formats.style",
        "pandas.core.strings.accessor", "pandas.core.indexes.accessors",
    ],
    "plotting": [
        "matplotlib", "matplotlib.pyplot", "matplotlib.axes", "matplotlib.figure", "matplotlib.colors",
        "matplotlib.patches", "matplotlib.ticker", "matplotlib.text", "matplotlib.lines", "matplotlib.transforms",
        "matplotlib.collections", "matplotlib.legend", "matplotlib.axis", "matplotlib.animation", "matplotlib.cm",
        "matplotlib.dates", "matplotlib.path", "matplotlib.artist", "matplotlib.widgets", "matplotlib.image",
        "matplotlib.backend_bases", "matplotlib.gridspec", "matplotlib.scale", "matplotlib.spines",
    ],
    "scientific-computing": [
        "scipy.stats", "scipy.optimize", "scipy.linalg", "scipy.signal", "scipy.sparse", "scipy.sparse.linalg",
        "scipy.integrate", "scipy.interpolate", "scipy.special", "scipy.spatial", "scipy.ndimage", "scipy.fft",
        "scipy.cluster.hierarchy", "scipy.cluster.vq", "scipy.io", "scipy.spatial.distance", "scipy.sparse.csgraph",
        "scipy.signal.windows", "scipy.constants", "scipy.odr", "scipy.differentiate",
    ],
}

MIN_CHARS, MAX_CHARS = 40, 600
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.*)?\n")
_SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Returns|Example|Examples|Note|Notes|See Also|Raises|Warning|Attributes)\s*:?\s*$"
)


def _summary(doc: str) -> str | None:
    """First one or two paragraphs of prose, before any section header, code or directive."""
    paras: list[str] = []
    doc = _SIGNATURE.sub("", doc.strip())  # torch-style "name(args) -> Tensor" first lines
    for para in re.split(r"\n\s*\n", doc.strip()):
        lines = para.strip().splitlines()
        if not lines or _SECTION.match(lines[0]) or lines[0].lstrip().startswith((">>>", "..", "---", "===", "::")):
            break
        if len(lines) > 1 and set(lines[1].strip()) <= set("-="):
            break  # numpydoc section underline
        paras.append(" ".join(line.strip() for line in lines))
        if len(paras) == 2 or sum(map(len, paras)) > MAX_CHARS:
            break
    text = " ".join(paras)
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) < MIN_CHARS or text.count(" ") < 5:
        return None
    return text[:MAX_CHARS]


def _public_objects(module):
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    for name in sorted(set(names)):
        if name.startswith("_"):
            continue
        try:
            obj = getattr(module, name)
        except Exception:
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj) or callable(obj):
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for mname, member in sorted(vars(obj).items()):
                    if not mname.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                        yield f"{module.__name__}.{name}.{mname}", member


@dataclass
class BuiltDataset:
    rows: list[dict]
    skipped: dict[str, str] = field(default_factory=dict)  # module -> why it was not read ("ImportError: ...")


def collect(libraries: dict[str, list[str]] = LIBRARIES, skipped: dict[str, str] | None = None) -> list[dict]:
    """Every usable docstring summary, labelled; texts seen under two labels are dropped. A module
    that fails to import is left out, and recorded in `skipped` (module -> the error, one line)."""
    rows: dict[str, dict] = {}
    conflicted: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, modules in libraries.items():
            for modname in modules:
                try:
                    module = importlib.import_module(modname)
                except Exception as e:  # missing in this version of the library, or broken here
                    if skipped is not None:
                        skipped[modname] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]
                    continue
                for qualname, obj in _public_objects(module):
                    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj)
                    text = _summary(doc) if doc else None
                    if text is None:
                        continue
                    prev = rows.get(text)
                    if prev is None:
                        rows[text] = {"text": text, "label": label, "source": qualname}
                    elif prev["label"] != label:
                        conflicted.add(text)
    return [r for t, r in rows.items() if t not in conflicted]


def _rank(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def build_dataset(rows_per_class: int = 800, libraries: dict[str, list[str]] | None = None) -> BuiltDataset:
    """Up to `rows_per_class` rows per label, chosen by text hash, sorted by id; and the modules
    skipped because they failed to import. `libraries`: LIBRARIES by default."""
    skipped: dict[str, str] = {}
    by_label: dict[str, list[dict]] = {}
    for row in collect(LIBRARIES if libraries is None else libraries, skipped):
        by_label.setdefault(row["label"], []).append(row)
    out = []
    for label in sorted(by_label):
        kept = sorted(by_label[label], key=lambda r: _rank(r["text"]))[:rows_per_class]
        out.extend(kept)
    for row in out:
        row["id"] = _rank(row["text"])[:16]
    return BuiltDataset(sorted(out, key=lambda r: r["id"]), skipped)


def build(rows_per_class: int = 800) -> list[dict]:
    """The rows of `build_dataset`; each skipped module is logged as a warning."""
    built = build_dataset(rows_per_class)
    for modname, why in built.skipped.items():
        log.warning("quickstart dataset: skipped module %s (%s)", modname, why)
    return built.rows


def describe_skipped(skipped: dict[str, str]) -> str:
    """One line naming the skipped modules and why, for the data line of a command."""
    return (f"skipped {len(skipped)} module(s) that failed to import, so these rows (and the dataset's version) "
            "differ from a build where they import: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()))


def write_shards(rows: list[dict], uri: str, ctx, num_shards: int = 4) -> list[str]:
    """Write rows as JSONL shards `part-0000N.jsonl` under `uri`."""
    from workflows.storage.uri import join, write_bytes_atomic

    uris = []
    for i in range(num_shards):
        buf = io.StringIO()
        for row in rows[i::num_shards]:
            buf.write(json.dumps(row, ensure_ascii=False) + "\n")
        shard = join(uri, f"part-{i:05d}.jsonl")
        write_bytes_atomic(shard, buf.getvalue().encode(), ctx)
        uris.append(shard)
    return uris
