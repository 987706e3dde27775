#!/usr/bin/env bash
# Issue 51's one GPU call: CIFAR-10 against the clock, then what it needs scored, then the speed rows, in
# priority order under one deadline (TOTAL_S seconds, 570 by default); each step's cap shrinks to what is
# left.
#   1. speedrun   python ddpm.py --preset=speedrun on CIFAR-10's training JPEGs (carried in .cifar/, the copy
#                 in ../shared/data), its own 5-minute clock from process start to the final weights
#   2. samples    the final EMA: 10,000 images (the run's sampler); each whole minute's EMA (minutes/): 1,000;
#                 the final EMA by DDIM 50 steps, eager and replayed as CUDA graphs, 2,000 each from the same
#                 noise (is the graphed sampler's difference from eager visible in FID?)
#   3. ladder     Ho et al.'s network at batch 512: the best ladder row so far (compiled, CUDA graphs) and the
#                 same with the fused GroupNorm+SiLU kernel (kernels.py), profiled, MFU against the card's
#                 datasheet bf16 peak (benchmark.py)
#   4. bench      scripts/gpu_bench.sh (our step against diffusers', sampling, the GPU tests) in the time left
# Everything comes back in at most 8 files of at most 16 MiB (the device tool's limit): results.tar.gz
# (logs, metrics.jsonl, config.json, the ladders; rewritten after every step, so a cut call keeps what it
# finished) and the samples as .npz files (uint8, N x 32 x 32 x 3): final_a.npz and final_b.npz (5,000
# each), minutes.npz (one key per minute, min001 ...), graphs.npz (keys eager, graphed). FID is computed on
# the machine with the Inception weights, from those files (scripts/speedrun_fid.py).
#
#   mkdir -p .cifar && cp ../shared/data/cifar10_jpeg.tar.gz .cifar/   # once (git-ignored; carry .cifar)
#   bash scripts/gpu_speedrun.sh OUT_DIR             # on the GPU
#   bash scripts/gpu_speedrun.sh --dry-run OUT_DIR   # every step on the CPU, tiny and on the built-in shapes
set -uo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:?usage: scripts/gpu_speedrun.sh [--dry-run] OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
work=$(mktemp -d)  # everything is written here first; $out holds only what comes back
deadline=$((SECONDS + ${TOTAL_S:-570}))

if [ $dry = 1 ]; then  # the same commands, tiny, on the CPU and the built-in shapes: tests the plumbing
  data=(--dataset=shapes --shapes_count=256)
  run_flags=(--device=cpu --image_size=16 --base_channels=16 --channel_mult=1,2 --attn_resolutions=8
             --batch_size=16 --compile=false --loader=torch --ema_snapshot_kimg=1 --num_samples=4
             --sample_steps=2 --time_budget_min=1.5)  # 90 s: a minute's EMA, after a set-up of seconds
  final=40 minute=8 graphs=8 steps=(--steps 2) on=(--device cpu) graphed=false
  ladder=(--preset demo --base_channels=16 --attn_head_dim=16 --base_batch 2 --iters 1 --warmup 1
          --rows "baseline,PyTorch SDPA,channels_last,fused GroupNorm+SiLU (Triton)")  # the last: skipped
else
  if [ ! -f .cifar/cifar10_jpeg.tar.gz ]; then
    echo "error: no .cifar/cifar10_jpeg.tar.gz: copy it there and carry .cifar"; exit 2
  fi
  mkdir -p "$work/cifar" && tar xzf .cifar/cifar10_jpeg.tar.gz -C "$work/cifar"
  data=(--dataset=folder "--data_dir=$work/cifar/train")
  run_flags=()
  final=10000 minute=1000 graphs=2000 steps=() on=() graphed=reduce-overhead
  # the best row so far (BENCHMARKS.md: 21.3% MFU on an H200) and the same with the fused kernel
  ladder=(--preset ho --batch 512 --warmup 3 --iters 10 --profile --start "CUDA graphs"
          --rows "CUDA graphs,fused GroupNorm+SiLU (Triton)")
fi

{ nvidia-smi 2>&1; $py -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
  lscpu | head -20; git rev-parse HEAD; } > "$work/env.txt" 2>&1
: > "$work/status.txt"
pack() {  # the text results, rewritten whole after each step (a fresh file renamed into place)
  tar czf "$out/.results.tmp" -C "$work" --exclude='*.pt' --exclude='*.npz' --exclude=cifar \
    --exclude='*.shards' --exclude=betons . && mv "$out/.results.tmp" "$out/results.tar.gz"
}
run() {  # NAME CAP COMMAND...: output in NAME.log, exit status in status.txt (124/130: cut at its cap)
  local name=$1 cap=$2; shift 2
  if [ $dry = 1 ]; then cap=3600  # a dry run checks plumbing, not speed: its cap is only a hang guard
  elif [ $((deadline - SECONDS - 10)) -lt "$cap" ]; then cap=$((deadline - SECONDS - 10)); fi
  if [ "$cap" -lt 15 ]; then
    echo "$name: not started, TOTAL_S spent" | tee "$work/$name.log"
    echo "$name skipped" >> "$work/status.txt"
  else
    timeout -s INT -k 10 "$cap" "$@" 2>&1 | tee "$work/$name.log"
    echo "$name ${PIPESTATUS[0]}" >> "$work/status.txt"
  fi
  pack
}
npz() {  # KIND OUT.npz KEY=SRC.npz ...: each sample.py .npz's images under KEY (split: in two halves)
  $py - "$@" <<'EOF'
import sys, numpy as np
kind, dest, pairs = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
arrays = {k: np.load(src)["arr_0"] for k, src in pairs}
if kind == "split":  # one set in two files of half each, as arr_0 (evaluate.py reads them as they are)
    (k, a), = arrays.items()
    for part, rows in (("a", a[: len(a) // 2]), ("b", a[len(a) // 2:])):
        np.savez(dest.replace(".npz", f"_{part}.npz"), arr_0=rows)
else:
    np.savez(dest, **arrays)
EOF
}

# 1. the speedrun: its clock is its own (ddpm.py's time_budget_min), the cap only a hang guard
run speedrun 420 $py ddpm.py --preset=speedrun "${data[@]}" "${run_flags[@]}" "--out_dir=$work/speedrun"

# 2. the samples, final first
sample() {  # NAME CKPT N [sample.py flags]: NAME.npz in $work
  local name=$1 ckpt=$2 n=$3; shift 3
  run "sample_$name" 150 $py sample.py --ckpt "$ckpt" --n "$n" "${on[@]}" "${steps[@]}" --seed 0 \
    --out "$work/$name.png" "$@"
}
if [ -f "$work/speedrun/ema.pt" ]; then
  sample final "$work/speedrun/ema.pt" $final
  [ -f "$work/final.npz" ] && npz split "$out/final.npz" final="$work/final.npz"
  pairs=()
  for f in "$work"/speedrun/minutes/ema_min*.pt; do
    [ -f "$f" ] || continue
    m=$(basename "$f" .pt); m=${m#ema_}
    sample "$m" "$f" $minute && [ -f "$work/$m.npz" ] && pairs+=("$m=$work/$m.npz")
  done
  [ ${#pairs[@]} -gt 0 ] && npz keys "$out/minutes.npz" "${pairs[@]}"
  sample eager "$work/speedrun/ema.pt" $graphs --sampler ddim --compile false
  sample graphed "$work/speedrun/ema.pt" $graphs --sampler ddim --compile $graphed
  [ -f "$work/eager.npz" ] && [ -f "$work/graphed.npz" ] \
    && npz keys "$out/graphs.npz" eager="$work/eager.npz" graphed="$work/graphed.npz"
else
  echo "the speedrun left no ema.pt: no samples" | tee -a "$work/status.txt"
fi

# 3. the MFU ladder of Ho's network with the new kernels
run ladder 150 $py benchmark.py "${on[@]}" "${ladder[@]}" --json "$work/ladder.json"

# 4. the rest, in the time left (a dry run leaves it to gpu_bench.sh's own dry run, tested on its own)
if [ $dry = 0 ]; then
  run bench $((deadline - SECONDS - 10)) env TOTAL_S=$((deadline - SECONDS - 20)) \
    bash scripts/gpu_bench.sh "$work/bench"
fi
cat "$work/status.txt"
pack
failed=$(grep -cv ' 0$' "$work/status.txt")
rm -rf "$work"
if [ $dry = 1 ] && [ "$failed" != 0 ]; then exit 1; fi  # a dry run fails if any step did
