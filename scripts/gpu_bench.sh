#!/usr/bin/env bash
# On one GPU (H100/H200 class), in at most TOTAL_S seconds (560 by default), everything under OUT_DIR, the
# most wanted first (the caps add up to more than TOTAL_S: what is left for the last commands shrinks):
#   env.txt           nvidia-smi, torch, the host's CPU, git HEAD
#   ho.*              the ladder for 'ho' (Ho et al.'s network) through its compiled rows: baseline, scale up
#                     batch, SDPA, bf16, channels_last, torch.compile, device-resident data, CUDA graphs, each
#                     with its profile (benchmark.py --profile: where the GPU time goes)
#   vs_diffusers.*    our training step, eager and compiled, against diffusers' on the same network, profiled
#                     (scripts/gpu_vs_diffusers.py)
#   vs_sampling.*     our DDIM sampling, eager and replayed as CUDA graphs, against diffusers' DDIMPipeline in
#                     fp32 and bf16, and the graphed images against the eager ones, profiled
#                     (scripts/gpu_vs_diffusers_sampling.py)
#   gpu_tests.md      the GPU-only tests (tests/test_gpu.py), 4 at a time
#   seed.*            the ladder for 'seed' through its compiled rows
#   patch.*           the paper's memory claim: lsun-p4's largest batch at its own P = 4 against P = 1 (bf16,
#                     SDPA: the rows above 'bf16 autocast' taken as given, benchmark.py --start)
#   sample.*          sampling speed across P = 1, 2, 4, 8 (benchmark.py --sample, lsun-p4)
# The caps follow the first run on an H200 (BENCHMARKS.md): there the 'ho' ladder's 180 s ended in its second
# compiled row; gpu_vs_diffusers.py's compiled Ho step was still compiling at its 105 s cap and did not stop
# at SIGINT (killed, it wrote nothing); lsun-p4's batch search at P = 4 took most of a minute.
# Each .md is a command's output, each .json its rows, status.txt the exit statuses. Each command has a time
# cap (the *_S variables, in seconds; at its cap a command gets SIGINT and then prints and saves what it
# measured, and 10 s later SIGKILL), shortened where less of TOTAL_S is left; a command with under 15 s left
# is not started (status 'skipped'). A dry run has none but an hour per command, a hang guard: it tests the
# plumbing on any machine, however slow or busy. Needs bash >= 4.4.
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
  few=(--base_batch 2 --iters 1 --warmup 1 --profile)
  ho=(--preset demo "${tiny[@]}" "${few[@]}" --rows "baseline,PyTorch SDPA,channels_last,torch.compile")
  seed=(--preset demo "${tiny[@]}" "${few[@]}" --skip "FFCV loading" --rows "$(
        )baseline,PyTorch SDPA,grad accumulation x4,activation checkpointing,patch_size 2")  # ffcv's JIT: 20 s
  patch=(--preset demo "${tiny[@]}" "${few[@]}" --patch_size 1 --start "PyTorch SDPA"
         --rows "PyTorch SDPA,patch_size 1")
  samp=(--preset demo "${tiny[@]}" --patch_sizes 1,2 --sample_steps 1 --sample_batch 2)
  vs=(--device cpu --batch 2 --ours eager --theirs bf16 --warmup 1 --timed 1 --profile)
  vss=(--device cpu --base_channels 64 --batch 2 --steps 2 --ours eager,graphed --theirs bf16 --warmup 1
       --timed 1 --profile)
  tests=()
else
  on=()
  compiled="torch.compile,device-resident data,CUDA graphs,fused GroupNorm+SiLU (Triton)"  # each compiles anew
  ho=(--preset ho --max_batch 512 --warmup 3 --iters 10 --profile
      --rows "baseline,scale up batch,PyTorch SDPA,bf16 autocast,channels_last,$compiled")
  seed=(--preset seed --max_batch 512 --warmup 3 --iters 10 --profile
        --rows "baseline,scale up batch,PyTorch SDPA,bf16 autocast,channels_last,torch.compile,CUDA graphs")
  # the memory claim in bf16 with SDPA: the largest batch at P = 4 against P = 1 (a 256x256 image at P = 1
  # needs small batches, so the searches start at 8)
  patch=(--preset lsun-p4 --patch_size 1 --base_batch 8 --max_batch 1024 --warmup 1 --iters 2
         --start "bf16 autocast" --rows "bf16 autocast,patch_size 1 at the largest batch")
  samp=(--preset lsun-p4 --patch_sizes 1,2,4,8 --sample_steps 10 --sample_batch 16)
  vs=(--batch 128 --warmup 3 --timed 10 --profile)
  vss=(--batch 256 --steps 10 --ours eager,graphed --theirs bf16,fp32 --warmup 2 --timed 5 --profile)
  tests=(-n 4)  # pytest-xdist: the compiling tests side by side
fi

{ nvidia-smi; $py -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; lscpu | head -20
  git rev-parse HEAD; } > "$out/env.txt" 2>&1
: > "$out/status.txt"
deadline=$((SECONDS + ${TOTAL_S:-560}))
run() {  # NAME CAP COMMAND...: its output in NAME.md, its exit status in status.txt (124/130: cut at its cap)
  local name=$1 cap=$2; shift 2
  if [ $dry = 1 ]; then cap=3600  # a dry run checks plumbing, not speed: its cap is only a hang guard
  elif [ $((deadline - SECONDS - 10)) -lt "$cap" ]; then cap=$((deadline - SECONDS - 10)); fi
  if [ "$cap" -lt 15 ]; then
    echo "$name: not started, TOTAL_S spent" | tee "$out/$name.md"; echo "$name skipped" >> "$out/status.txt"
    return
  fi
  timeout -s INT -k 10 "$cap" "$@" 2>&1 | tee "$out/$name.md"
  echo "$name ${PIPESTATUS[0]}" >> "$out/status.txt"
}
run ho "${HO_S:-200}" $py benchmark.py "${on[@]}" "${ho[@]}" --json "$out/ho.json"
run vs_diffusers "${VS_S:-150}" $py scripts/gpu_vs_diffusers.py "${vs[@]}" --json "$out/vs_diffusers.json"
run vs_sampling "${VS_SAMPLING_S:-90}" $py scripts/gpu_vs_diffusers_sampling.py "${vss[@]}" \
  --json "$out/vs_sampling.json"
if $py -c "import pytest" 2>/dev/null; then
  run gpu_tests "${TESTS_S:-85}" $py -m pytest -q -p no:cacheprovider "${tests[@]}" tests/test_gpu.py
else
  echo "pytest is not installed: GPU tests skipped" | tee "$out/gpu_tests.md"
fi
run seed "${SEED_S:-60}" $py benchmark.py "${on[@]}" "${seed[@]}" --json "$out/seed.json"
run patch "${PATCH_S:-90}" $py benchmark.py "${on[@]}" "${patch[@]}" --json "$out/patch.json"
run sample "${SAMPLE_S:-25}" $py benchmark.py "${on[@]}" --sample "${samp[@]}" --json "$out/sample.json"
cat "$out/status.txt"
# a dry run fails if any command did (on the GPU a capped ladder is expected and keeps its rows)
if [ $dry = 1 ] && grep -qv ' 0$' "$out/status.txt"; then exit 1; fi
