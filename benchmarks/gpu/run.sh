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
# what one call carries (make bench-gpu-carry): the prepared folder, and Ray with what the product path needs
# beside it (pydantic, FastAPI, ...; none of them is on the machine), on PYTHONPATH where python3 has no Ray
if [ -d .gpu-carry ]; then
  "$PY" -m benchmarks.gpu.carry unpack || exit
  "$PY" -c 'import ray' 2>/dev/null || export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/ray-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)
exec "$PY" -m benchmarks.gpu.measure --out "$OUT" "${smoke[@]}" "$@"
