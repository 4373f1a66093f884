"""Ray, and what the product path needs that the GPU machine's Python lacks, packed to travel to it.

    python -m benchmarks.gpu.ray_pack build                 # make bench-gpu-ray: .gpu-ray/ for Python 3.12
    python -m benchmarks.gpu.ray_pack smoke [--keep DIR]    # here: the same recipe proven (below)

The GPU machine reaches no package registry and its Python 3.12 (`DEVICE`, as the device tool's notes
list it) has torch, transformers, pandas, pyarrow and Ray's own small dependencies, but not Ray, pydantic,
FastAPI or the rest of `PACK`. `build` downloads `PACK` at the versions constraints.txt pins, as wheels for
CPython 3.12 on x86-64 Linux, installs them into one folder (no dependencies resolved: `PACK` is the
list), drops what neither training nor serving imports (`TRIM`: Ray's Java jars, RLlib, its LLM
library, the dashboard's web pages, test folders), strips the symbol tables of Ray's binaries and
writes `.gpu-ray/site.tar.xz` and `.gpu-ray/manifest.json` (gitignored; benchmarks/gpu/carry.py puts the
archive into the folder a device call carries). On the device, benchmarks/gpu/run.sh unpacks it into
/tmp/ray-site and puts it on PYTHONPATH (none of `PACK` is among the device's packages, so it shadows none).

`smoke` proves what can be proven here, on a machine with Python 3.11 and (through pyenv) a bare 3.12:
1. the recipe, on 3.11: the same `PACK` and `TRIM` for CPython 3.11, unpacked beside a site folder that
   holds only the `DEVICE` packages (linked from this venv) under `python -S` (no other site-packages),
   runs `workflows preprocess` and `workflows train` of the digits config on a local storage root
   (Ray Data, Ray Train with two workers, a checkpoint, registration);
2. the 3.12 pack itself, where a Python 3.12 is found: `import ray` from it with the 3.12 wheels of
   Ray's required dependencies that the device has (`CORE_DEVICE`, fetched for this check only),
   `ray.init()` (its stripped raylet and GCS binaries start), a remote task, and imports of the packed
   packages with compiled parts or new pins (pydantic-core, rpds-py through jsonschema, FastAPI, Starlette,
   uvicorn, python-multipart, grpcio-reflection). ray.train, ray.tune and ray.serve need the device's
   numpy, pandas and pyarrow, not fetched for 3.12 here: part 1 imports and runs them on 3.11.
It cannot prove that the 3.12 pack trains with the device's torch 2.11 and transformers 5.17 (this
machine has no torch for 3.12), nor anything about CUDA: the GPU script's first step does that there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".gpu-ray"
ARCHIVE = "site.tar.xz"

# What the product path (workflows preprocess|train|pipeline|serve on a local storage root, tracking off)
# imports that the device's Python lacks; found by `smoke` (an ImportError there names the next one)
PACK = [
    "ray",  # Ray Data, Train, Tune and Serve
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",  # workflows.config; Ray Train, Serve
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",  # Ray's required dependencies
    # Ray Serve and the served app
    "fastapi", "starlette", "uvicorn", "python-multipart", "opentelemetry-api", "grpcio-reflection",
    "platformdirs",  # workflows.console
]
# Ray's required dependencies that the device has: fetched for the 3.12 check only, never packed
CORE_DEVICE = ["click", "filelock", "msgpack", "packaging", "protobuf", "pyyaml", "requests", "urllib3", "idna",
               "certifi", "charset-normalizer", "attrs", "typing-extensions", "aiohttp", "aiosignal", "frozenlist",
               "multidict", "yarl", "propcache", "aiohappyeyeballs", "anyio", "sniffio", "h11", "grpcio", "fsspec",
               "annotated-doc"]
TRIM = ["ray/jars", "ray/rllib", "ray/llm", "ray/dashboard/client", "bin"]
# The device's Python packages (the device tool's notes, KINDS.md, read on 2026-11-17)
DEVICE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp""".split()
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(names: list[str]) -> list[str]:
    """name==version for each of `names`, as constraints.txt pins it (else as installed here)."""
    pinned: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        name, sep, pin = line.strip().partition("==")
        if sep:
            pinned[norm(name)] = pin.strip()
    out = []
    for name in names:
        version: str | None = pinned.get(norm(name))
        if version is None:
            try:
                version = metadata.version(name)
            except metadata.PackageNotFoundError:
                out.append(name)
                continue
        out.append(f"{name}=={version}")
    return out


def target_args(python: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            *[a for p in PLATFORMS for a in ("--platform", p)]]


def install(names: list[str], dest: Path, python: str, wheels: Path) -> None:
    """`names` (pinned) as wheels for CPython `python` on x86-64 Linux, installed into `dest`, no deps."""
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "download", "--no-deps", *target_args(python), "-d", str(wheels), *pins(names)], check=True)
    files = [str(w) for w in sorted(wheels.glob("*.whl"))]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--no-compile", "--target", str(dest),
                    *target_args(python), *files], check=True)


def site_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def trim(site: Path) -> int:
    """Remove TRIM and test folders from an installed site, and strip the symbol tables of Ray's binaries
    (raylet, the GCS server, _raylet.so: about a third of their size; `strip --strip-unneeded` keeps what
    dynamic linking needs); returns the bytes saved."""
    before = site_bytes(site)
    for path in [site / t for t in TRIM] + [p for p in site.glob("ray/**/tests") if p.is_dir()]:
        shutil.rmtree(path, ignore_errors=True)
    if shutil.which("strip"):
        for f in [*site.glob("ray/**/*.so"), *(p for p in site.glob("ray/core/src/ray/*/*") if p.is_file())]:
            if f.read_bytes()[:4] == b"\x7fELF":
                subprocess.run(["strip", "--strip-unneeded", str(f)], check=True)
    return before - site_bytes(site)


def build(out: Path = OUT, python: str = "3.12") -> dict:
    """`out`/site.tar.xz and manifest.json: PACK for CPython `python`, trimmed (written to temp names, then
    renamed)."""
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ray-pack-") as tmp:
        site = Path(tmp) / "site"
        install(PACK, site, python, Path(tmp) / "wheels")
        removed = trim(site)
        unpacked = site_bytes(site)
        out.mkdir(parents=True, exist_ok=True)
        partial = out / (ARCHIVE + ".tmp")
        # xz -6 on every core (python's lzma is single-threaded); the archive holds the site's contents
        with open(partial, "wb") as f:
            tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-6", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait():
                raise RuntimeError("tar failed")
        partial.rename(out / ARCHIVE)
    digest = hashlib.sha256((out / ARCHIVE).read_bytes()).hexdigest()
    manifest = {"python": python, "packages": pins(PACK), "trimmed": TRIM + ["ray/**/tests"],
                "unpacked_bytes": unpacked, "trimmed_bytes": removed, "archive": ARCHIVE,
                "archive_bytes": (out / ARCHIVE).stat().st_size, "sha256": digest,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - t0, 1)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def unpack(archive: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return dest


def with_requirements(names: list[str]) -> set[str]:
    """`names` and, as installed here, what they require (markers without extras honoured): the device's
    packages stand in for themselves with the versions of this venv, whose dependencies may differ."""
    from packaging.requirements import Requirement

    packed = {norm(n) for n in PACK}  # what the device lacks, whoever requires it here
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen or name in packed:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


def device_site(dest: Path) -> Path:
    """A folder of links to this interpreter's installed DEVICE packages and their requirements (their
    modules and metadata): with `python -S`, the packages the device has and nothing else."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = with_requirements(DEVICE)
    for dist in metadata.distributions():
        if norm(dist.metadata["Name"]) not in wanted or not dist.files:
            continue
        base = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files if not f.parts[0].startswith("..")}:
            src, link = base / top, dest / top
            if src.exists() and not link.exists() and not top.endswith(".pth") and top != "__pycache__":
                link.symlink_to(src)
    return dest


def isolated_env(paths: list[Path]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


def smoke_recipe(work: Path) -> dict:
    """Part 1 (module docstring): the 3.11 pack beside the device's packages alone trains the digits config."""
    t0 = time.time()
    site = work / "pack311"
    install(PACK, site, f"{sys.version_info.major}.{sys.version_info.minor}", work / "wheels311")
    trim(site)
    env = isolated_env([ROOT, device_site(work / "device"), site])
    python = [sys.executable, "-S"]
    check = subprocess.run([*python, "-c", "import pydantic, s3fs"], env=env, capture_output=True, text=True)
    sets = ["storage.embedded.enabled=false", f"storage.root={work}/store", f"data.source={work}/raw/digits/",
            f"output_dir={work}/runs", f"cache.dir={work}/cache", "tracking.enabled=false", "tune.enabled=false",
            "serve.enabled=false", "train.epochs=1", "train.max_train_rows=256", "train.max_val_rows=64",
            "train.torch_threads=1"]
    args = [a for s in sets for a in ("--set", s)]
    for command in ("preprocess", "train"):
        subprocess.run([*python, "-m", "workflows", command, "--config", "digits", *args], env=env, check=True,
                       cwd=work)
    summary = json.loads(next((work / "runs").glob("*/train.json")).read_text())
    return {"python": sys.version.split()[0], "device_packages_linked": len(list((work / "device").iterdir())),
            "s3fs_importable": check.returncode == 0,
            "train": {k: summary[k] for k in ("registered", "best_metrics") if k in summary},
            "seconds": round(time.time() - t0, 1)}


def find_python312() -> str | None:
    """A Python 3.12 that runs (pyenv's own before a PATH entry, which may be a shim that refuses)."""
    for candidate in (*sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")), shutil.which("python3.12")):
        if candidate and subprocess.run([str(candidate), "-c", "pass"], capture_output=True).returncode == 0:
            return str(candidate)
    return None


def smoke_312(work: Path, archive: Path) -> dict:
    """Part 2 (module docstring): the 3.12 pack's Ray starts a node, runs a task and imports its libraries."""
    python = find_python312()
    if python is None:
        return {"skipped": "no Python 3.12 here"}
    t0 = time.time()
    site = unpack(archive, work / "pack312")
    core = work / "core312"
    if not core.exists():
        install(CORE_DEVICE, core, "3.12", work / "wheels312")
    code = ("import ray, sys; ray.init(num_cpus=1, include_dashboard=False); "
            "print('task', ray.get(ray.remote(lambda: sys.version.split()[0]).remote())); "
            "import fastapi, pydantic, starlette, uvicorn, jsonschema, multipart, grpc_reflection; "
            "print('imports ok'); ray.shutdown()")
    done = subprocess.run([python, "-S", "-c", code], env=isolated_env([site, core]), capture_output=True, text=True,
                          timeout=300)
    if done.returncode:
        raise RuntimeError(f"the 3.12 pack failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return {"python": python, "output": done.stdout.strip().splitlines()[-2:], "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu.ray_pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["build", "smoke"])
    ap.add_argument("--out", type=Path, default=OUT, help="build: the carried folder (default .gpu-ray)")
    ap.add_argument("--keep", type=Path, help="smoke: work here and keep it (default: a temp folder, removed)")
    a = ap.parse_args(argv)
    if a.command == "build":
        m = build(a.out)
        print(f"ray pack: {a.out / ARCHIVE}, {m['archive_bytes'] / 2**20:.1f} MiB ({m['unpacked_bytes'] / 2**20:.0f} "
              f"MiB unpacked, {len(m['packages'])} packages, Python {m['python']}) in {m['seconds']} s")
        return 0
    work = a.keep or Path(tempfile.mkdtemp(prefix="ray-pack-smoke-"))
    try:
        archive = a.out / ARCHIVE
        if not archive.exists():
            build(a.out)
        report = {"recipe_on_this_python": smoke_recipe(work / "recipe"), "pack_312": smoke_312(work / "p312", archive)}
        print(json.dumps(report, indent=2))
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
