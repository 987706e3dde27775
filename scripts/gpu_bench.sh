#!/usr/bin/env bash
# On one GPU (H100/H200 class): the GPU-only tests, then the efficiency ladder for 'seed' and 'ho'.
# Writes everything under OUT_DIR; meant to finish in under 8 minutes. What it cannot have, it skips:
# without ffcv the FFCV row is skipped, without torchinfo its column reads n/a.
#   bash scripts/gpu_bench.sh OUT_DIR
set -uo pipefail
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# pure-Python wheels carried in .whl/ (e.g. torchinfo) for machines without them
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; git rev-parse HEAD; } > "$out/env.txt" 2>&1
timeout 120 python3 -m pytest -q tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.txt"
timeout 200 python3 benchmark.py --preset seed --json "$out/seed.json" 2>&1 | tee "$out/seed.md"
timeout 150 python3 benchmark.py --preset ho --max_batch 2048 --json "$out/ho.json" 2>&1 | tee "$out/ho.md"
