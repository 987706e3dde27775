"""The lever table (issue 33): ddpm.py runs that each differ from a base in one lever, at an equal budget of
training images, scored at their last step by the same evaluation over several seeds, then one markdown
table: mean ± s.d. over seeds, and each arm against the base, a difference counting only beyond 2 s.d.

    python scripts/levers.py --data_dir DIR --kimg 150 --seeds 3 --out levers/            # the default arms
    python scripts/levers.py --base "--dataset=shapes ..." --arm "lr1e-3=--lr=1e-3" --metric bpd ...

Each run is <out>/<arm>-s<seed>/, a ddpm.py run folder. Runs go seed by seed: seed 0 of every arm, then
seed 1 of every arm, and so on, so that a study cut short still has every arm. A finished run (its
metrics.jsonl has the evaluation at the last step) is read, not run again; one with a checkpoint is continued
(--resume): an interrupted study goes on where it stopped, and --report writes the table of the runs
finished so far without running any. Budget: --kimg thousand images for every arm, so an arm that changes
--batch_size trains kimg * 1000 / batch steps. The wall-clock of each run is reported beside it: levers that
change the network's cost (width, depth, patches) are compared at equal images here, and their speed is
the other column (minutes to the end of the run, its evaluation included). Writes <out>/levers.md and
<out>/levers.json.

A run's minutes depend on what else the machine did meanwhile. --cost N measures each arm's cost per image
side by side instead, training nothing to the end: one training iteration of each arm in turn, N times, in
one process, so that the machine's load falls on every arm alike; each arm's median against the base's
(<out>/cost.md and cost.json).
"""
import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys

import reporting  # puts the repository root on sys.path
from reporting import ROOT, format_summary, summary, verdict

import torch

import data
import ddpm
from machinery import mfu, runs
from machinery.errors import UserError, reported

# the CPU study's base: Ho et al.'s network shape scaled to 2 CPU cores (2x2 patches, 3 levels, 6.5M
# parameters, ~48 img/s in fp32 on the AVX2 EPYC), Ho's objective (eps, linear betas, dropout 0.1, AdamW,
# clip 1) with batch, LR, warm-up and EMA sized for runs of a few hundred kimg (unmeasured guesses: the arms
# measure them); FID of 1,000 samples (DPM-Solver++, 20 steps) against 10,000 training images
BASE = ("--dataset=folder --image_size=32 --patch_size=2 --base_channels=64 --channel_mult=1,2,2 "
        "--num_res_blocks=2 --attn_resolutions=8 --batch_size=64 --lr=5e-4 --warmup_steps=200 "
        "--ema_decay=0.999 --loader=torch --compile=false --log_every_steps=100 --sample_every_steps=0 "
        "--ckpt_every_steps=500 --eval_fid_samples=1000 --fid_ref_images=10000 --eval_bpd_images=0 "
        "--ema_snapshot_kimg=0")
# the study's runs snapshot the post-hoc EMA (every 8 kimg, no sweep at the end), so that the EMA length is
# read from the base's snapshots afterwards (python -m machinery.phema) instead of costing runs
STUDY = BASE + " --ema_snapshot_kimg=8 --ema_eval_sigma_rels="
ARMS = {  # one lever each, named as the table shows it
    "base": "",
    "lr2.5e-4": "--lr=2.5e-4",
    "lr1e-3": "--lr=1e-3",
    "warmup0": "--warmup_steps=0",
    "batch32": "--batch_size=32",
    "batch128": "--batch_size=128",
    "dropout0": "--dropout=0",
    "v-pred": "--prediction=v",
    "min-snr5": "--loss_weighting=min_snr --min_snr_gamma=5",
    "deeper": "--num_res_blocks=3",
    "wider": "--base_channels=96",
    "patch1-narrow": "--patch_size=1 --base_channels=32 --channel_mult=1,2,2,2 --num_res_blocks=1 "
                     "--attn_resolutions=16 --norm_groups=16",  # the network of scripts/vs_diffusers_train.py
}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=STUDY, help="ddpm.py flags every arm shares (default: the CPU study's)")
    p.add_argument("--data_dir", default="", help="appended to the base as --data_dir")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="an arm: its name and the ddpm.py flags it changes (repeat; 'base' = no change); "
                        "default: " + ", ".join(ARMS))
    p.add_argument("--kimg", type=float, required=True, help="thousand training images per run")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--metric", choices=["fid", "bpd"], default="fid",
                   help="the base's FID (eval_fid_samples) or held-out bits/dim (eval_bpd_images, 1000 "
                        "unless the base says)")
    p.add_argument("--out", required=True, help="the study's folder: one run folder per arm and seed")
    p.add_argument("--report", action="store_true",
                   help="run nothing: the table of the runs finished so far, and the list of those to run")
    p.add_argument("--cost", type=int, default=0, metavar="N",
                   help="run nothing to the end: time N training iterations of each arm, the arms in turn, "
                        "and write each arm's cost per image against the base's (cost.md)")
    args = p.parse_args(argv)
    if not (1 <= args.seeds <= 100 and 0 < args.kimg <= 10**6):
        raise UserError("--seeds must lie in [1, 100] and --kimg in (0, 1e6]")
    if not 0 <= args.cost <= 10**5 or (args.cost and args.report):
        raise UserError("--cost N takes N in [1, 1e5] timed iterations per arm, and not with --report")
    arms = dict(a.partition("=")[::2] for a in args.arm) if args.arm else dict(ARMS)
    for name in arms:
        if not NAME.fullmatch(name):
            raise UserError(f"--arm {name!r}: a name is letters, digits, '.', '_' or '-' (a folder name)")
    if args.base == STUDY and not args.data_dir:
        raise UserError("give --data_dir: the image folder the study trains on (CIFAR-10's train/)")
    if "base" not in arms:
        arms = {"base": "", **arms}  # every arm is read against the base
    for what, flags in [("--base ", args.base), *((f"--arm {n}=", f) for n, f in arms.items())]:
        try:
            shlex.split(flags)
        except ValueError as e:  # an unclosed quote
            raise UserError(f"{what}{flags!r}: {e} (flags are split as a shell splits them)") from None
    return args, arms


def arm_argv(args, flags):
    """An arm's ddpm.py flags: the base's, the study's --data_dir, then the arm's own."""
    return [*shlex.split(args.base), *(["--data_dir=" + args.data_dir] if args.data_dir else []),
            *shlex.split(flags)]


def run_argv(args, flags, seed, out_dir):
    """-> (ddpm.py's arguments for one run, its last step): the budget in steps of the arm's batch."""
    argv = arm_argv(args, flags)
    batch = ddpm.parse_args(argv)[1].batch_size
    steps = max(1, round(args.kimg * 1000 / batch))
    metric = ["--eval_bpd_images=0"] if args.metric == "fid" else ["--eval_fid_samples=0"]
    if args.metric == "bpd" and not any(a.startswith("--eval_bpd_images=") for a in argv):
        metric.append("--eval_bpd_images=1000")
    argv += [*metric, f"--seed={seed}", f"--max_steps={steps}", f"--eval_every_steps={steps}",
             f"--out_dir={out_dir}"]
    ddpm.parse_args(argv)  # a bad flag is refused here, before any run starts
    return argv, steps


def finished(out_dir, steps, metric):
    """The evaluation row at the run's last step, or None. metrics.jsonl is read as ddpm.py reads it back
    (runs.read_metrics): a line cut by a crash, or one that is not a JSON object, is skipped."""
    rows, _ = runs.read_metrics(out_dir)
    return next((r for r in rows if r.get("step") == steps and metric in r), None)


def unusable(row, metric):
    """Why a finished run's evaluation row cannot enter the table, or None: its metric (a NaN is logged as
    null), wall_s and eval_s must be finite numbers, the times >= 0."""
    for key in (metric, "wall_s", "eval_s"):
        v = row.get(key)
        if not (type(v) in (int, float) and math.isfinite(v) and (key == metric or v >= 0)):
            return f"its {key} is {json.dumps(v)[:40] if key in row else 'missing'}"
    return None


def run(argv, out_dir, steps, metric, name):
    """One run, continued from its checkpoint where it has one; -> its evaluation row."""
    row = finished(out_dir, steps, metric)
    if row is not None:
        print(f"{name}: finished before, read from {out_dir}", flush=True)
        return row
    resume = ["--resume"] if os.path.exists(os.path.join(out_dir, "ckpt.pt")) else []
    print(f"{name}: python ddpm.py {shlex.join(argv + resume)}", flush=True)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "ddpm.py"), *argv, *resume], cwd=ROOT)
    row = finished(out_dir, steps, metric)
    if done.returncode != 0 or row is None:
        raise UserError(f"the run {name} failed (status {done.returncode}): its output is above, its folder "
                        f"{out_dir}; run the same command again to continue")
    return row


def minutes(row):
    """A run's wall-clock to the end of its last evaluation: the row's wall_s stops where that evaluation
    starts, and its eval_s (evaluate.py writes one in every evaluation row) is the evaluation's own time."""
    return (row["wall_s"] + row["eval_s"]) / 60


def table(results, metric, kimg):
    """The markdown table: each arm's mean ± s.d., its difference from the base and whether that exceeds 2
    s.d. (verdict), and its wall-clock."""
    base = summary(results["base"]["values"])
    lines = [[name, f"`{r['flags'] or '(none)'}`", format_summary(r["values"]), f"{len(r['values'])}",
              "—" if name == "base" else verdict(summary(r["values"]), base),
              f"{statistics.fmean(r['minutes']):.1f}"] for name, r in results.items()]
    return f"{kimg:g} kimg per run; lower is better\n\n" + reporting.table(
        ["arm", "flags", f"{metric} (mean ± s.d.)", "seeds", "against base", "minutes per run"], lines) + "\n"


def cost(args, arms, warmup=2):
    """Each arm's training cost per image, measured side by side: after `warmup` untimed iterations of each,
    one iteration of each arm in turn (ddpm.iteration: the step's LR, train_step, the EMA; the batch's
    gather from memory untimed), args.cost times, on random images of the base's shape, so that whatever
    else the machine does falls on every arm alike. -> {arm: ms (median), img/s, ratio: the median over the
    rounds of the arm's time over the base's in the same round}; writes <out>/cost.md and cost.json."""
    built = {}
    for name, flags in arms.items():
        mc, tc, _ = ddpm.parse_args(arm_argv(args, flags))
        rank, world, device = runs.distributed_setup(tc)
        if world > 1:
            raise UserError("--cost measures one process: run it without torchrun")
        torch.manual_seed(tc.seed)
        images = torch.randint(0, 256, (4 * tc.batch_size, mc.channels, mc.image_size, mc.image_size),
                               dtype=torch.uint8)
        labels = torch.randint(0, max(mc.num_classes, 1), (len(images),))
        loader = data.Loader(images, labels, tc.batch_size, tc.seed, device, with_labels=mc.num_classes > 0)
        runs.set_up_cpu(device, tc.cpu_threads, print)
        b = ddpm.build(mc, tc, device)
        for step in range(warmup):  # compilation, if any, and the first allocations
            ddpm.iteration(b, *loader.next(), tc, step)
        built[name] = (b, tc, loader, mfu.StepTimer(device))
    for step in range(warmup, warmup + args.cost):
        for b, tc, loader, timer in built.values():
            x0, y = loader.next()
            timer.start()
            ddpm.iteration(b, x0, y, tc, step)
            timer.stop()
    ms = {name: timer.read_ms() for name, (_, _, _, timer) in built.items()}
    per_image = {name: [t / built[name][1].batch_size for t in v] for name, v in ms.items()}  # batches differ
    results = {name: {"flags": arms[name], "ms": statistics.median(v),
                      "img_s": built[name][1].batch_size * 1e3 / statistics.median(v),
                      "ratio": statistics.median(a / b for a, b in zip(per_image[name], per_image["base"]))}
               for name, v in ms.items()}
    text = (f"{args.cost} timed iterations of each arm, in turn; lower is cheaper\n\n" + reporting.table(
        ["arm", "flags", "ms per iteration (median)", "img/s", "time per image against base"],
        [[name, f"`{r['flags'] or '(none)'}`", f"{r['ms']:.1f}", f"{r['img_s']:.1f}", f"{r['ratio']:.3f}"]
         for name, r in results.items()]) + "\n")
    os.makedirs(args.out, exist_ok=True)
    reporting.write_text(os.path.join(args.out, "cost.md"), text)
    reporting.write_json(os.path.join(args.out, "cost.json"),
                         {"base": args.base, "iterations": args.cost, "arms": results})
    print(text, end="")
    return results


def main(argv=None):
    with reported():
        args, arms = parse(argv)
        if args.cost:
            return cost(args, arms)
        metric = args.metric
        if not args.report:
            os.makedirs(args.out, exist_ok=True)
        plans = {name: [run_argv(args, flags, seed, os.path.join(args.out, f"{name}-s{seed}"))
                        for seed in range(args.seeds)] for name, flags in arms.items()}
        rows, missing, left_out = {name: [] for name in arms}, [], []
        for seed in range(args.seeds):  # seed 0 of every arm, then seed 1 of every arm, ...
            for name, planned in plans.items():
                (argv, steps), out_dir = planned[seed], os.path.join(args.out, f"{name}-s{seed}")
                row = finished(out_dir, steps, metric) if args.report else \
                    run(argv, out_dir, steps, metric, f"{name} seed {seed}")
                why = unusable(row, metric) if row is not None else None
                if why:  # finished, but not with a number the table can hold: said, never run again
                    print(f"note: {out_dir} finished, but {why}: left out of the table", flush=True)
                    left_out.append(f"{name}-s{seed} ({why})")
                elif row is None:
                    missing.append(f"{name}-s{seed}")
                else:
                    rows[name].append(row)
        if not rows["base"]:
            raise UserError(f"no run of the base has finished in {args.out}: nothing to read arms against")
        results = {name: {"flags": arms[name], "steps": plans[name][0][1],
                          "values": [r[metric] for r in done], "minutes": [minutes(r) for r in done]}
                   for name, done in rows.items() if done}
        text = table(results, metric, args.kimg)
        if missing:
            text += (f"\nNot finished yet ({len(missing)} of {len(arms) * args.seeds} runs): "
                     f"{', '.join(missing)}\n")
        if left_out:
            text += f"\nLeft out ({len(left_out)} runs): {', '.join(left_out)}\n"
        reporting.write_text(os.path.join(args.out, "levers.md"), text)
        reporting.write_json(os.path.join(args.out, "levers.json"), {
            "base": args.base, "kimg": args.kimg, "metric": metric, "arms": results, "not_finished": missing,
            "left_out": left_out})
        print(text, end="")
        return results


if __name__ == "__main__":
    main()
