"""Figures written as PNG without pyplot: no global backend switch inside a notebook or a Ray worker."""

from __future__ import annotations

from pathlib import Path

from workflows.storage.atomic import atomic_write


def new_figure(width: float = 6, height: float = 3.5):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def save_png(fig, path: Path, dpi: int = 110) -> Path:
    """Write to a temp name, then rename: a reader never sees half a PNG."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # the temp name keeps the .png suffix: savefig picks the format from it
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi), tmp=path.with_name(path.stem + ".tmp.png"))
