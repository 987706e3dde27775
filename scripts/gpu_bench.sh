#!/usr/bin/env bash
# On one GPU (H100/H200 class), in 8 to 10 minutes, everything under OUT_DIR:
#   env.txt           nvidia-smi, torch, git HEAD
#   gpu_tests.md      the GPU-only tests (tests/test_gpu.py)
#   seed.*            the efficiency ladder (benchmark.py) for 'seed', every row
#   ho.*              'ho' (Ho et al.'s network), its eager rows: SDPA, bf16, and the fp16, accumulation and
#                     activation-checkpointing rows
#   patch.*           the paper's memory claim: lsun-p4 at its own P = 4 against P = 1, largest batches
#   sample.*          sampling speed across P = 1, 2, 4, 8 (benchmark.py --sample, lsun-p4)
#   vs_diffusers.*    our training step against diffusers' on the same network (scripts/gpu_vs_diffusers.py)
#   vs_sampling.*     our DDIM sampling, eager and replayed as CUDA graphs, against diffusers' DDIMPipeline in
#                     fp32 and bf16, and the graphed images against the eager ones
#                     (scripts/gpu_vs_diffusers_sampling.py)
# Each .md is a command's output, each .json its rows, status.txt the exit statuses. Each command has a time
# cap (the *_S variables, in seconds; at its cap a command gets SIGINT and then prints and saves what it
# measured, and 20 s later SIGKILL): the caps add up to 460 s, 600 s at the very most. A dry run has none but an
# hour per command, a hang guard: it tests the plumbing on any machine, however slow or busy. Needs bash >= 4.4.
# Never yet run on a GPU: how far each ladder gets within its cap is unmeasured.
# What it cannot have, it skips: without ffcv the FFCV row, without torchinfo its column, without diffusers the
# comparison. Missing pure-Python packages travel as wheels in .whl/ (git-ignored; carry it), fetched here with
#   python3 -m pip download --no-deps -d .whl torchinfo diffusers==0.42.1 importlib_metadata zipp
#
#   bash scripts/gpu_bench.sh OUT_DIR             # on the GPU
#   bash scripts/gpu_bench.sh --dry-run OUT_DIR   # every command on the CPU with tiny settings (tests its plumbing)
set -uo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:?usage: scripts/gpu_bench.sh [--dry-run] OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ $dry = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then  # (a dry run uses the environment it is given)
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if [ $dry = 1 ]; then  # tiny models and a step or two per row, on the CPU
  on=(--device cpu)
  tiny=(--base_channels=16 --attn_head_dim=16)
  seed=(--preset demo "${tiny[@]}" --skip "FFCV loading" --base_batch 2 --iters 1 --warmup 1)  # ffcv's JIT: 20 s
  ho=(--preset demo "${tiny[@]}" --rows "baseline" --base_batch 2 --iters 1 --warmup 1)
  patch=(--preset demo "${tiny[@]}" --patch_size 1 --rows "baseline,patch_size 1" --base_batch 2 --iters 1
         --warmup 1)
  samp=(--preset demo "${tiny[@]}" --patch_sizes 1,2 --sample_steps 1 --sample_batch 2)
  vs=(--device cpu --batch 2 --ours eager --theirs bf16 --warmup 1 --timed 1)
  vss=(--device cpu --base_channels 64 --batch 2 --steps 2 --ours eager,graphed --theirs bf16 --warmup 1 --timed 1)
else
  on=()
  seed=(--preset seed --max_batch 1024 --warmup 5 --iters 20)
  ho=(--preset ho --max_batch 512 --warmup 5 --iters 20 --rows "baseline,PyTorch SDPA,bf16 autocast,$(
      )fp16 autocast,grad accumulation x4,activation checkpointing,checkpointing at the largest batch")
  # the rows of the memory claim: the largest batch at P = 4 (bf16 autocast) against P = 1, and with
  # checkpointing; a 256x256 image at P = 1 needs small batches, so the searches start at 8
  patch=(--preset lsun-p4 --patch_size 1 --base_batch 8 --max_batch 2048 --warmup 2 --iters 5
         --rows "baseline,PyTorch SDPA,bf16 autocast,checkpointing at the largest batch,patch_size 1,$(
                 )patch_size 1 at the largest batch")
  samp=(--preset lsun-p4 --patch_sizes 1,2,4,8 --sample_steps 10 --sample_batch 16)
  vs=(--batch 128 --warmup 5 --timed 20)
  vss=(--batch 256 --steps 10 --ours eager,graphed --theirs bf16,fp32 --warmup 2 --timed 10)
fi

{ nvidia-smi; $py -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; git rev-parse HEAD; } \
  > "$out/env.txt" 2>&1
: > "$out/status.txt"
run() {  # NAME CAP COMMAND...: its output in NAME.md, its exit status in status.txt (124/130: cut at its cap)
  local name=$1 cap=$2; shift 2
  if [ $dry = 1 ]; then cap=3600; fi  # a dry run checks plumbing, not speed: its cap is only a hang guard
  timeout -s INT -k 20 "$cap" "$@" 2>&1 | tee "$out/$name.md"
  echo "$name ${PIPESTATUS[0]}" >> "$out/status.txt"
}
if $py -c "import pytest" 2>/dev/null; then
  run gpu_tests "${TESTS_S:-70}" $py -m pytest -q -p no:cacheprovider tests/test_gpu.py
else
  echo "pytest is not installed: GPU tests skipped" | tee "$out/gpu_tests.md"
fi
run seed "${SEED_S:-90}" $py benchmark.py "${on[@]}" "${seed[@]}" --json "$out/seed.json"
run ho "${HO_S:-50}" $py benchmark.py "${on[@]}" "${ho[@]}" --json "$out/ho.json"
run patch "${PATCH_S:-50}" $py benchmark.py "${on[@]}" "${patch[@]}" --json "$out/patch.json"
run sample "${SAMPLE_S:-30}" $py benchmark.py "${on[@]}" --sample "${samp[@]}" --json "$out/sample.json"
run vs_diffusers "${VS_S:-70}" $py scripts/gpu_vs_diffusers.py "${vs[@]}" --json "$out/vs_diffusers.json"
run vs_sampling "${VS_SAMPLING_S:-100}" $py scripts/gpu_vs_diffusers_sampling.py "${vss[@]}" \
  --json "$out/vs_sampling.json"
cat "$out/status.txt"
# a dry run fails if any command did (on the GPU a capped ladder is expected and keeps its rows)
if [ $dry = 1 ] && grep -qv ' 0$' "$out/status.txt"; then exit 1; fi
