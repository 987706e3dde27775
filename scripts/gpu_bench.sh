#!/usr/bin/env bash
# On one GPU (H100/H200 class): the GPU-only tests, then the efficiency ladder for 'seed' and 'ho'.
# Writes everything under OUT_DIR in about 8 minutes at most (the timeouts below: 120 + 190 + 150 s, each ladder
# then 20 s to print its table); never yet run on a GPU, so how far each ladder gets in its time is unmeasured. What it cannot have, it skips:
# without ffcv the FFCV row is skipped, without torchinfo its column reads n/a.
#   bash scripts/gpu_bench.sh OUT_DIR            # TESTS_S=, SEED_S=, HO_S= change the timeouts (seconds)
set -uo pipefail
out=${1:?usage: scripts/gpu_bench.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# pure-Python wheels carried in .whl/ (torchinfo, pytest, pluggy, iniconfig, packaging; on Python < 3.11 also
# exceptiongroup, tomli) for machines without them
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{ nvidia-smi; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; git rev-parse HEAD; } > "$out/env.txt" 2>&1
if python3 -c "import pytest" 2>/dev/null; then
  timeout "${TESTS_S:-120}" python3 -m pytest -q tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.txt"
else
  echo "pytest is not installed: GPU tests skipped (carry pytest, pluggy, iniconfig, packaging wheels in .whl/)" | tee "$out/gpu_tests.txt"
fi
# batch searches are capped so that 5 warm-up + 50 timed steps per row fit the budget; rows are saved
# to the JSON as they finish, and SIGINT at the timeout makes benchmark.py print the table of the rows it measured
timeout -s INT -k 20 "${SEED_S:-190}" python3 benchmark.py --preset seed --max_batch 1024 --warmup 5 --json "$out/seed.json" 2>&1 | tee "$out/seed.md"
timeout -s INT -k 20 "${HO_S:-150}" python3 benchmark.py --preset ho --max_batch 512 --warmup 5 --json "$out/ho.json" 2>&1 | tee "$out/ho.md"
