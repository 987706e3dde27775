import atexit
import json
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the measured CPU peaks the runs remember (mfu.PEAK_CACHE): the tests' own, never the user's
_peaks = tempfile.mkdtemp(prefix="ddpm-test-peaks-")
os.environ["DDPM_PEAK_CACHE"] = os.path.join(_peaks, "peaks.json")
atexit.register(shutil.rmtree, _peaks, ignore_errors=True)  # left behind by no test session

from ddpm import ModelConfig, TrainerConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--image_size=16", "--base_channels=16", "--channel_mult=1,2", "--num_res_blocks=1",
             "--attn_resolutions=8",
             "--dropout=0", "--timesteps=100", "--dataset=shapes", "--shapes_count=256", "--compile=false",
             "--precision=fp32", "--lr=2e-3", "--warmup_steps=2", "--sample_every_steps=0",
             "--ckpt_every_steps=0", "--num_samples=4", "--sampler=ddim", "--sample_steps=3"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_model(**kw):
    """A UNet small enough to train for a few steps on a CPU in seconds."""
    base = dict(image_size=16, base_channels=16, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=(8,),
                dropout=0.0, timesteps=100)
    return ModelConfig(**{**base, **kw})


def tiny_trainer(out_dir, **kw):
    base = dict(dataset="shapes", shapes_count=512, loader="torch", beton_dir=str(out_dir) + "-betons",
                fid_stats_dir=str(out_dir) + "-fid_stats", batch_size=16, max_steps=30, lr=2e-3,
                warmup_steps=5, ema_decay=0.99, compile="false", precision="fp32", out_dir=str(out_dir),
                log_every_steps=5, sample_every_steps=0, ckpt_every_steps=0, num_samples=4, sampler="ddim",
                sample_steps=5)
    return TrainerConfig(**{**base, **kw})


def read_metrics(run, key="loss"):
    """metrics.jsonl's rows that hold `key` (training rows by default; 'fid' or 'bpd' for evaluation rows)."""
    return [row for row in map(json.loads,
                               open(os.path.join(run, "metrics.jsonl"))) if key is None or key in row]


def one_line_error(capsys, main, argv, code=2):
    """main(argv) exits with `code` after exactly one 'error: ...' line on stderr and no traceback; -> that
    line."""
    capsys.readouterr()  # what earlier calls printed is not this call's
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") or err.startswith("[rank "), err  # under torchrun: "[rank N] error: ..."
    return err.strip()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A real 3-step run of the tiny class-conditional model: ckpt.pt, ema.pt and the rest of its folder."""
    out = tmp_path_factory.mktemp("run")
    from ddpm import train

    train(tiny_model(num_classes=4), tiny_trainer(out, max_steps=3), preset="test")
    return out


def nan_after(monkeypatch, first_bad, last_bad=10**9):
    """Make Diffusion.loss return NaN on calls first_bad..last_bad (0-based)."""
    import ddpm

    real, calls = ddpm.Diffusion.loss, []

    def loss(self, *args, **kw):
        losses, t = real(self, *args, **kw)
        calls.append(1)
        if first_bad <= len(calls) - 1 <= last_bad:
            return losses * float("nan"), t
        return losses, t

    monkeypatch.setattr(ddpm.Diffusion, "loss", loss)
