"""Figures written as PNG without pyplot: no global backend switch inside a notebook or a Ray worker."""

from __future__ import annotations

import os
from pathlib import Path


def new_figure(width: float = 6, height: float = 3.5):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def save_png(fig, path: Path, dpi: int = 110) -> Path:
    """Write to a temp name, then rename: a reader never sees half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)
    return path
