"""Training, side by side: diffusers' own example script (examples/unconditional_image_generation/
train_unconditional.py) against ddpm.py on the same network, data, batch, number of steps and learning
rate; every model scored by the same sampler and FID protocol, over several runs per side (issue 33).

    # once: the example needs accelerate and datasets, which stay outside the project's environment
    python3 -m venv .venv-peer && .venv-peer/bin/pip install torch==2.14.1 torchvision==0.29.1 \\
        diffusers==0.42.1 accelerate datasets tensorboard
    curl -LO https://raw.githubusercontent.com/huggingface/diffusers/v0.42.1/examples/\\
unconditional_image_generation/train_unconditional.py
    .venv/bin/python scripts/vs_diffusers_train.py --data_dir DIR --peer_python .venv-peer/bin/python \\
        --peer_script train_unconditional.py --epochs 2 --seeds 3 --out vs_diffusers/

The network is ddpm.py's --network flags (default: an unpatched network of the CPU study's size, since
UNet2DModel has no patches). Theirs is built from the config.json that `sample.py --export_diffusers` writes
for ours, so both sides train the same function, each from its own initialisation. Per seed, in order:
  ours       python ddpm.py --ours --network --seed S --max_steps E * ceil(N / B): the lever study's base
             training settings (AdamW, constant LR after warm-up, EMA 0.999, dropout 0.1, flips), no grid or
             evaluation inside the run.
  theirs     their script with that config, --train_batch_size B, --num_epochs E, --learning_rate,
             --lr_warmup_steps, --use_ema, --random_flip and ours' T, betas and target; the rest their
             defaults (cosine LR decay, AdamW betas 0.95/0.999 and weight decay 1e-6, EMA ramped to 0.9999,
             fp32, where ours uses bf16 autocast on a CPU that has it). Only its
             sampling knobs are made cheap (--eval_batch_size 1, --ddpm_num_inference_steps 2: the grid it
             draws after the first and last epoch). It takes no seed: its runs are independent, not seeded.
  ours-wall  ours for as many steps as it makes in theirs' wall-clock (ours' own rate in its equal-steps
             run): that run itself when the count is the same; when it is larger and the LR is constant
             after warm-up (nothing in a run then depends on its length), that run continued with --resume
             in a copy of its folder, its wall-clock both parts' (resume is bitwise a straight run); else
             a run from scratch. Not with --no-equal_wall; a study run without it gains it later.
Wall-clock is each training command's, start to exit, with both data caches built first (untimed). Each
seed's models (ours: the run's ema.pt; theirs: the pipeline folder, EMA weights) are scored before the next
seed trains, so an interrupted study keeps its whole seeds, by sample.py --eval fid:
the same sampler, steps, n, seed and reference (--fid_ref_images training images of DIR) for all. A finished
step is read back from <out>/vs_diffusers.json, not run again: the same command with a larger --seeds
trains only the new seeds. Writes <out>/vs_diffusers.md and .json.
FID's Inception weights (--inception_weights, $DDPM_INCEPTION_WEIGHTS or torch.hub's cache) are loaded once
before anything trains: a machine without them is told so at once.
"""
import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

import data  # noqa: E402
import ddpm  # noqa: E402
import levers  # noqa: E402
import reporting  # noqa: E402
from machinery import fid, files  # noqa: E402
from machinery.errors import UserError, reported  # noqa: E402

NETWORK = levers.ARMS["patch1-narrow"]  # 1.53M parameters, unpatched: one group count diffusers can hold
OURS = levers.BASE + " --eval_fid_samples=0 --num_samples=0"
RECORD = "vs_diffusers.json"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", required=True, help="the image folder both sides train on")
    p.add_argument("--peer_python", required=True, help="the python of the environment with accelerate, "
                                                        "datasets and diffusers")
    p.add_argument("--peer_script", required=True, help="diffusers' train_unconditional.py")
    p.add_argument("--network", default=NETWORK, help="ddpm.py's network flags, written --network='...' "
                                                      "(default: %(default)s)")
    p.add_argument("--ours", default=OURS, help="ddpm.py's other flags, written --ours='...' (default: the "
                                                "lever study's base without evaluation); --network's win")
    p.add_argument("--epochs", type=int, required=True, help="their --num_epochs; ours trains as many steps")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--equal_wall", action=argparse.BooleanOptionalAction, default=True,
                   help="also train ours for theirs' wall-clock (--no-equal_wall: equal steps only, for runs "
                        "so long that a third one per seed does not fit)")
    p.add_argument("--fid_samples", type=int, default=1000)
    p.add_argument("--sampler", default="dpm++", choices=ddpm.SAMPLERS)
    p.add_argument("--sample_steps", type=int, default=20)
    p.add_argument("--inception_weights", help="FID's Inception weights file, for sample.py (default: "
                   "$DDPM_INCEPTION_WEIGHTS, else torch.hub's cache); found before anything trains")
    p.add_argument("--out", required=True, help="the comparison's folder")
    args = p.parse_args(argv)
    if not (1 <= args.seeds <= 100 and 1 <= args.epochs <= 10**4 and 2 <= args.fid_samples <= 10**6):
        raise UserError("--seeds must lie in [1, 100], --epochs in [1, 1e4] and --fid_samples in [2, 1e6] "
                        "(FID needs 2 samples or more)")
    for name in ("peer_python", "peer_script"):  # the user's own files: a link is the user's choice
        if not os.path.isfile(getattr(args, name)):
            raise UserError(f"--{name} {getattr(args, name)}: no such file")
    argv = [*shlex.split(args.ours), *shlex.split(args.network), f"--data_dir={args.data_dir}"]
    mc, tc = ddpm.parse_args(argv)[:2]  # bad flags are refused here, before anything runs
    if not 1 <= args.sample_steps <= mc.timesteps:
        raise UserError(f"--sample_steps {args.sample_steps} must lie in [1, {mc.timesteps}] (the network's "
                        "timesteps)")
    if tc.dataset != "folder" or tc.grad_accum_steps != 1:
        raise UserError("--ours: the comparison trains on --data_dir as an image folder "
                        "('--dataset=folder'), one batch per step")
    # their script builds DDPMScheduler(num_train_timesteps, beta_schedule, prediction_type) from its flags
    if (mc.prediction == "v" or mc.num_classes
            or mc.schedule == "linear" and (mc.beta_start, mc.beta_end) != (1e-4, 0.02)):
        raise UserError(f"the network: their script trains an unconditional eps or x model with "
                        f"DDPMScheduler's default betas, not prediction={mc.prediction}, "
                        f"num_classes={mc.num_classes}, betas {mc.beta_start}..{mc.beta_end}")
    images = len(data.image_files(args.data_dir).files)
    if images == 0:
        raise UserError(f"--data_dir {args.data_dir}: no images")
    return args, argv, mc, tc, args.epochs * math.ceil(images / tc.batch_size)


class Record:
    """<out>/vs_diffusers.json: every finished step's result, written again after each."""

    def __init__(self, out, settings):
        self.path, self.settings, self.done = os.path.join(out, RECORD), settings, {}
        if files.is_regular(self.path):
            with files.open_regular(self.path, "r") as f:
                try:
                    saved = json.load(f)
                except ValueError as e:
                    raise UserError(f"{self.path}: not this script's record ({e}); move it away") from None
            if not isinstance(saved, dict) or saved.get("settings") != settings:
                raise UserError(f"{self.path} holds a comparison with other settings: give another --out")
            self.done = saved.get("done")
            if not isinstance(self.done, dict):
                raise UserError(f"{self.path}: not this script's record (no 'done' table); move it away")
            for name, entry in self.done.items():
                why = unusable(name, entry, out)
                if why:
                    raise UserError(f"{self.path}: its entry {name!r} is not what this script writes "
                                    f"({why}): remove that entry, and the step is run again")

    def step(self, name, work):
        """work() -> a dict, unless `name` has finished before."""
        if name in self.done:
            print(f"{name}: finished before, read from {self.path}", flush=True)
        else:
            self.done[name] = work()
            reporting.write_json(self.path, {"settings": self.settings, "done": self.done})
        return self.done[name]


def unusable(name, entry, out):
    """Why a finished step read back from the record cannot be used, or None: its times are seconds in
    [1 ms, 1e7 s], its FID a finite number (a NaN FID, written as null, is no result), its models in --out."""
    if not isinstance(entry, dict):
        return "not a table"
    number = lambda v, lo, hi: type(v) in (int, float) and lo <= v <= hi  # noqa: E731  (NaN fails)
    times = {"caches": ("ours", "theirs"), "network": ("s",)}.get(name, ("wall_s",) * ("-fid" not in name))
    for key in times:
        if not number(entry.get(key), 1e-3, 1e7):
            return f"{key} {json.dumps(entry.get(key))[:40]}, not a time in seconds"
    if name.endswith("-fid") and not number(entry.get("fid"), -1, 1e6):
        return f"fid {json.dumps(entry.get('fid'))[:40]}: no FID (a NaN is written as null)"
    if name.endswith("-fid") and not (type(entry.get("n")) is int and entry["n"] >= 2):
        return f"n {json.dumps(entry.get('n'))[:40]}"
    if name.endswith("-fid") or name in ("caches", "network"):
        return None
    if name.startswith("ours") and not (type(entry.get("steps")) is int and entry["steps"] >= 1):
        return f"steps {json.dumps(entry.get('steps'))[:40]}"
    for key in ("model", "continued")[:1 + ("continued" in entry)]:
        model = entry.get(key)
        root = os.path.abspath(out)
        if not isinstance(model, str) or os.path.commonpath([root, os.path.abspath(model)]) != root:
            return f"{key} {json.dumps(model)[:60]}, not a model in {out}"
    return None


def timed(cmd, name, env=None):
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise UserError(f"{name} failed (status {done.returncode}): its output is above")
    return time.perf_counter() - t0


def peer_env():
    """Their process: offline (every input is local) and unbuffered."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def train_ours(argv, steps, out_dir, seed, name, continued=None):
    """ddpm.py for `steps` in out_dir; with `continued` (a finished run of ours, constant LR after warm-up:
    its weights do not depend on its --max_steps) that run trained on in a copy of its folder, the
    wall-clock both parts'."""
    if os.path.exists(out_dir):  # an interrupted run: our own folder, started again from scratch
        raise UserError(f"{out_dir} exists but did not finish: remove it and run the same command again")
    if continued:
        shutil.copytree(os.path.dirname(continued["model"]), out_dir, symlinks=True)  # ours: no links
    cmd = [sys.executable, os.path.join(ROOT, "ddpm.py"), *argv, f"--seed={seed}", f"--max_steps={steps}",
           f"--out_dir={out_dir}", *(["--resume"] if continued else [])]
    row = {"steps": steps, "wall_s": timed(cmd, name), "model": os.path.join(out_dir, "ema.pt")}
    if continued:
        row.update(wall_s=continued["wall_s"] + row["wall_s"], continued=continued["model"])
    return row


def train_theirs(args, mc, tc, config_dir, out_dir, name):
    with files.open_regular(os.path.join(config_dir, "scheduler_config.json"), "r") as f:
        scheduler = json.load(f)  # written by sample.py --export_diffusers just now
    cmd = [args.peer_python, args.peer_script, "--train_data_dir", args.data_dir,
           "--resolution", str(mc.image_size), "--output_dir", out_dir, "--model_config_name_or_path",
           config_dir, "--train_batch_size", str(tc.batch_size), "--num_epochs", str(args.epochs),
           "--learning_rate", str(tc.lr), "--lr_warmup_steps", str(tc.warmup_steps), "--use_ema",
           "--ddpm_num_steps", str(scheduler["num_train_timesteps"]), "--ddpm_beta_schedule",
           scheduler["beta_schedule"], "--prediction_type", scheduler["prediction_type"],
           "--eval_batch_size", "1",
           "--ddpm_num_inference_steps", "2", "--save_images_epochs", str(10**6), "--save_model_epochs",
           str(10**6), "--checkpointing_steps", str(10**9), *(["--random_flip"] if tc.hflip else [])]
    return {"wall_s": timed(cmd, name, peer_env()), "model": out_dir}


def score_argv(args, tc, model, out):
    """sample.py's arguments that score `model`: the same sampler, steps, n, seed and reference for all."""
    return ["--ckpt", model, "--n", str(args.fid_samples), "--sampler", args.sampler, "--steps",
            str(args.sample_steps), "--seed", "0", "--eval", "fid", "--dataset", "folder", "--data_dir",
            args.data_dir, "--fid_ref_images", str(tc.fid_ref_images), "--stats_dir", tc.fid_stats_dir,
            "--out", out] + (["--inception_weights", args.inception_weights] if args.inception_weights
                             else [])


def read_fid(out):
    """The FID in the <out>.json that sample.py --eval fid wrote just now (None where it holds none)."""
    try:
        with files.open_regular(os.path.splitext(out)[0] + ".json", "r") as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {os.path.splitext(out)[0]}.json ({type(e).__name__})") from None
    return result.get("fid") if isinstance(result, dict) else None


def score(args, tc, model, out, name):
    timed([sys.executable, os.path.join(ROOT, "sample.py"), *score_argv(args, tc, model, out)], name)
    row = {"fid": read_fid(out), "n": args.fid_samples}
    why = unusable("-fid", row, args.out)  # a NaN FID (its samples diverged) is no result for the table
    if why:
        raise UserError(f"{name}: {why}; see {os.path.splitext(out)[0]}.json")
    return row


def comparisons(equal_wall):
    """(label, ours' side) of each comparison the study makes; theirs is the same run in both."""
    return (("equal steps", "ours"), ("equal wall-clock", "ours-wall"))[:1 + equal_wall]


def table(done, seeds, steps, equal_wall):
    """Mean ± s.d. of each side's FID over the seeds at equal steps and at equal wall-clock, ours against
    theirs read against 2 s.d. (reporting.verdict)."""
    theirs = [done[f"theirs-s{s}-fid"]["fid"] for s in range(seeds)]
    lines = []
    for label, side in comparisons(equal_wall):
        ours = [done[f"{side}-s{s}-fid"]["fid"] for s in range(seeds)]
        runs = [done[f"{side}-s{s}"] for s in range(seeds)]
        lines.append([label, "ours", ", ".join(sorted({str(r["steps"]) for r in runs})),
                      f"{reporting.summary([r['wall_s'] / 60 for r in runs])[0]:.1f}",
                      reporting.format_summary(ours), f"{seeds}",
                      reporting.verdict(reporting.summary(ours), reporting.summary(theirs))])
    walls = [done[f"theirs-s{s}"]["wall_s"] / 60 for s in range(seeds)]
    lines.append(["both", "theirs", f"{steps}", f"{reporting.summary(walls)[0]:.1f}",
                  reporting.format_summary(theirs), f"{seeds}", "—"])
    return reporting.table(["comparison", "side", "steps", "wall-clock (min)", "FID (mean ± s.d.)", "runs",
                            "ours against theirs"], lines) + "\n"


def main(argv=None):
    with reported():
        args, ours_argv, mc, tc, steps = parse(argv)
        fid.inception("cpu", args.inception_weights)  # found now, not after the first seed's hour of training
        os.makedirs(args.out, exist_ok=True)
        settings = {k: v for k, v in vars(args).items()  # a study may gain seeds or equal wall-clock
                    if k not in ("out", "inception_weights", "seeds", "equal_wall")}
        settings["steps"] = steps
        record = Record(args.out, settings)
        at = lambda *name: os.path.join(args.out, *name)  # noqa: E731
        record.step("caches", lambda: {
            "ours": timed([sys.executable, os.path.join(ROOT, "ddpm.py"), *ours_argv, "--max_steps=0",
                           f"--out_dir={at(f'cache-warmup-{time.time_ns()}')}"], "ours' decoded data cache"),
            "theirs": timed([args.peer_python, "-c", "import datasets, sys; datasets.load_dataset("
                             "'imagefolder', data_dir=sys.argv[1], split='train')", args.data_dir],
                            "their datasets cache", peer_env())})
        scores = {}  # model -> its score: ours-wall is often the equal-steps run itself, scored once
        for s in range(args.seeds):
            record.step(f"ours-s{s}", lambda: train_ours(ours_argv, steps, at(f"ours-s{s}"), s,
                                                         f"ours seed {s}"))
            if s == 0:  # their network: the config ours exports
                record.step("network", lambda: {"s": timed(
                    [sys.executable, os.path.join(ROOT, "sample.py"), "--ckpt", at("ours-s0", "ema.pt"),
                     "--export_diffusers", at("network")], "our network as a diffusers folder")})
            their = record.step(f"theirs-s{s}", lambda: train_theirs(
                args, mc, tc, at("network"), at(f"theirs-s{s}"), f"theirs run {s}"))
            ours = record.done[f"ours-s{s}"]
            if args.equal_wall:
                wall_steps = max(1, round(steps * their["wall_s"] / ours["wall_s"]))
                go_on = wall_steps > steps and tc.lr_schedule == "constant"
                record.step(f"ours-wall-s{s}", lambda: ours if wall_steps == steps else train_ours(
                    ours_argv, wall_steps, at(f"ours-wall-s{s}"), s, f"ours seed {s} in theirs' wall-clock",
                    continued=ours if go_on else None))
            # scored now, so that an interrupted study keeps whole seeds
            for side in ("ours", "theirs", "ours-wall")[:2 + args.equal_wall]:
                name, model = f"{side}-s{s}", record.done[f"{side}-s{s}"]["model"]
                scores[model] = record.step(name + "-fid", lambda: scores.get(model) or score(
                    args, tc, model, at("fid", f"{name}.png"), f"FID of {name}"))
        text = (f"{args.data_dir}: {steps} steps of batch {tc.batch_size} ({args.epochs} epochs), FID of "
                f"{args.fid_samples} samples ({args.sampler}, {args.sample_steps} steps) against "
                f"{tc.fid_ref_images or 'all'} training images; lower is better\n\n" + table(
                    record.done, args.seeds, steps, args.equal_wall))
        reporting.write_text(at("vs_diffusers.md"), text)
        print(text, end="")
        return record.done


if __name__ == "__main__":
    main()
