import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpm import ModelConfig, TrainerConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARGS = ["--image_size=16", "--base_channels=16", "--channel_mult=1,2", "--num_res_blocks=1", "--attn_resolutions=8",
             "--dropout=0", "--timesteps=100", "--dataset=shapes", "--shapes_count=256", "--compile=false",
             "--precision=fp32", "--lr=2e-3", "--warmup_steps=2", "--sample_every_steps=0", "--ckpt_every_steps=0",
             "--num_samples=4", "--sampler=ddim", "--sample_steps=3"]  # tiny_model and tiny_trainer, as ddpm.py flags


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
                fid_stats_dir=str(out_dir) + "-fid_stats", batch_size=16, max_steps=30, lr=2e-3, warmup_steps=5,
                ema_decay=0.99, compile=False, precision="fp32", out_dir=str(out_dir), log_every_steps=5,
                sample_every_steps=0, ckpt_every_steps=0, num_samples=4, sampler="ddim", sample_steps=5)
    return TrainerConfig(**{**base, **kw})
