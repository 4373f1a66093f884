"""What one device call carries, in one gitignored folder under the 64 MiB that travels: .gpu-carry/

    python -m benchmarks.gpu.carry pack      # here, after make bench-gpu-prepare (make bench-gpu-carry)
    python -m benchmarks.gpu.carry unpack    # there (benchmarks/gpu/run.sh): .gpu-prep/ and /tmp/ray-site

- `site.tar.xz`: the Ray pack (.gpu-ray/, benchmarks.gpu.ray_pack), as it is;
- `prep.tar.xz`: the prepared folder (.gpu-prep/) with each safetensors file's data stored as its two byte
  planes, high bytes first. For bf16 weights the high byte is the sign and most of the exponent, which
  compresses to about a third, while the low byte (mantissa) hardly compresses: MiniLM's 45 MB of bf16
  weights become about 31 MB, where plain xz leaves about 40. The transform is a permutation of bytes,
  lossless for any content; `unpack` undoes it.
`pack` refuses a folder over LIMIT_BYTES beside the working tree (tracked files), naming the sizes.
Standard library and numpy only: the device's python3 runs `unpack` before anything is on its path.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY, PREP, RAY = ROOT / ".gpu-carry", ROOT / ".gpu-prep", ROOT / ".gpu-ray"
LIMIT_BYTES = 64 * 2**20  # what travels to the device: the working tree and the carried folders together
PLANES = ".planes"  # the suffix of a safetensors file stored as byte planes


def safetensors_split(blob: bytes) -> int:
    """Where a safetensors file's data starts: after its 8-byte header length and JSON header."""
    return 8 + int.from_bytes(blob[:8], "little")


def to_planes(blob: bytes) -> bytes:
    import numpy as np

    start = safetensors_split(blob)
    data = np.frombuffer(blob, np.uint8, offset=start)
    if len(data) % 2:
        return blob
    pairs = data.reshape(-1, 2)
    return blob[:start] + pairs[:, 1].tobytes() + pairs[:, 0].tobytes()


def from_planes(blob: bytes) -> bytes:
    import numpy as np

    start = safetensors_split(blob)
    data = np.frombuffer(blob, np.uint8, offset=start)
    half = len(data) // 2
    out = np.empty((half, 2), np.uint8)
    out[:, 1], out[:, 0] = data[:half], data[half:]
    return blob[:start] + out.tobytes()


def as_planes(name: str, data: bytes) -> tuple[str, bytes]:
    """xz_tar's transform: a safetensors file as its byte planes (named with PLANES), any other as it is."""
    return (name + PLANES, to_planes(data)) if name.endswith(".safetensors") else (name, data)


def xz_tar(source: Path, archive: Path, transform=None) -> None:
    """`source`'s files into `archive` (tar, xz -6 on every core); `transform(path, bytes)` -> (name, bytes)."""
    partial = archive.with_name(archive.name + ".tmp")
    with open(partial, "wb") as f:
        xz = subprocess.Popen(["xz", "-6", "-T0", "-c"], stdin=subprocess.PIPE, stdout=f)
        assert xz.stdin is not None
        with tarfile.open(fileobj=xz.stdin, mode="w|") as tar:
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                name, data = str(path.relative_to(source)), path.read_bytes()
                if transform is not None:
                    name, data = transform(name, data)
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        xz.stdin.close()
        if xz.wait():
            raise RuntimeError("xz failed")
    partial.rename(archive)


def tree_bytes() -> int:
    """The working tree's size as the device call counts it (tracked files)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def pack(prep: Path = PREP, ray: Path = RAY, out: Path = CARRY) -> dict:
    for need in (prep / "cpu-pipeline.json", ray / "site.tar.xz"):
        if not need.exists():
            raise SystemExit(f"bench gpu carry: {need} is missing: run make bench-gpu-prepare (and bench-gpu-ray)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(ray / "site.tar.xz", out / "site.tar.xz")

    xz_tar(prep, out / "prep.tar.xz", as_planes)
    sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file() and p.suffix == ".xz"}
    report = {**sizes, "working_tree": tree_bytes()}
    report["total"] = sum(report.values())
    report["limit"] = LIMIT_BYTES
    (out / "sizes.json").write_text(json.dumps(report, indent=2))
    if report["total"] > LIMIT_BYTES:
        mib = {k: f"{v / 2**20:.1f}" for k, v in report.items()}
        raise SystemExit(f"bench gpu carry: {mib['total']} MiB would travel (Ray {mib['site.tar.xz']}, prepared "
                         f"{mib['prep.tar.xz']}, tree {mib['working_tree']}), over the {mib['limit']} MiB of a call")
    return report


def unpack(carry: Path = CARRY, prep: Path = PREP, site: Path = Path("/tmp/ray-site")) -> None:
    """The prepared folder (byte planes undone) and the Ray site, from `carry`; each only if not there yet
    (a device whose python3 has Ray ignores the site: run.sh puts it on the path only where Ray is missing)."""
    if (carry / "prep.tar.xz").exists() and not prep.exists():
        tmp = Path(tempfile.mkdtemp(dir=prep.parent, prefix=".gpu-prep-"))  # renamed whole, or removed
        try:
            with tarfile.open(carry / "prep.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            for path in tmp.rglob("*" + PLANES):
                path.with_name(path.name.removesuffix(PLANES)).write_bytes(from_planes(path.read_bytes()))
                path.unlink()
            os.rename(tmp, prep)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if (carry / "site.tar.xz").exists() and not (site / "ray").exists():
        site.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xJf", str(carry / "site.tar.xz"), "-C", str(site)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.carry", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["pack", "unpack"])
    a = ap.parse_args(argv)
    if a.command == "pack":
        r = pack()
        print(f"bench gpu carry: {CARRY}: {r['total'] / 2**20:.1f} MiB with the working tree "
              f"(limit {LIMIT_BYTES / 2**20:.0f}); carry [\".gpu-carry\"]", file=sys.stderr)
    else:
        unpack()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
