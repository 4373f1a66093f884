#!/usr/bin/env bash
# The GPU measurement in one call (benchmarks/gpu/README.md):
#   OUT=DIR bash benchmarks/gpu/run.sh            # a CUDA machine: GPT-2 124M MFU, ResNet-50 images/s,
#                                                 # classification (after make bench-gpu-prepare here),
#                                                 # chat generation (the engine against static batching),
#                                                 # chat fine-tuning (LoRA, bf16 against fp32)
#   SMOKE=1 OUT=DIR bash benchmarks/gpu/run.sh    # every step at toy size on the CPU
# Extra arguments go to `python -m benchmarks.gpu.measure` (--steps lm, --limit resnet=300, --shards DIR,
# --prepared DIR).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder the results go to}"
# packages the GPU machine lacks (pydantic; peft and accelerate, the chat step's LoRA) travel as wheels in
# .whl/ (carried; see the README); each installed only where its module is missing: here they would shadow
# the venv's with another Python's build
missing=()
if compgen -G ".whl/*.whl" >/dev/null; then
  mapfile -t missing < <("$PY" -c 'import importlib.util as u, os, sys
for w in sys.argv[1:]:
    if u.find_spec(os.path.basename(w).split("-")[0]) is None:
        print(w)' .whl/*.whl)
fi
if [ ${#missing[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${missing[@]}" || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Ray and what the product path needs beside it (pydantic, FastAPI, ...) travel packed in .gpu-ray/ (make
# bench-gpu-ray): unpacked where python3 has no Ray, behind the machine's own packages on PYTHONPATH
if [ -f .gpu-ray/site.tar.xz ] && ! "$PY" -c 'import ray' 2>/dev/null; then
  mkdir -p /tmp/ray-site && tar -xJf .gpu-ray/site.tar.xz -C /tmp/ray-site || exit
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ray-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)
exec "$PY" -m benchmarks.gpu.measure --out "$OUT" "${smoke[@]}" "$@"
