#!/usr/bin/env bash
# The GPU measurement in one call, without Ray (benchmarks/gpu/README.md):
#   OUT=DIR bash benchmarks/gpu/run.sh            # a CUDA machine: GPT-2 124M MFU, ResNet-50 images/s,
#                                                 # classification (after make bench-gpu-prepare here),
#                                                 # chat generation (the engine against static batching)
#   SMOKE=1 OUT=DIR bash benchmarks/gpu/run.sh    # every step at toy size on the CPU
# Extra arguments go to `python -m benchmarks.gpu.measure` (--steps lm, --limit resnet=300, --shards DIR,
# --prepared DIR).
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder the results go to}"
# packages the GPU machine lacks (pydantic) travel as wheels in .whl/ (carried; see the README);
# installed only where they are missing: here they would shadow the venv's with another Python's build
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import pydantic" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)
exec "$PY" -m benchmarks.gpu.measure --out "$OUT" "${smoke[@]}" "$@"
