"""Ho et al.'s network against diffusers' UNet2DModel (the oracle), and the diffusers folder format both
ways."""
import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_trainer

import ddpm
import sample
import unet
from ddpm import ModelConfig, train
from machinery import diffusers_io
from unet import UNet

diffusers = pytest.importorskip("diffusers")


def wide(**kw):
    """A tiny model whose every GroupNorm has 32 groups, as diffusers' norm_num_groups requires."""
    return tiny_model(base_channels=64, **kw)


def randomise(model):
    """Random values in every tensor (the ~zero output layers and the norms too), at a scale that keeps
    activations O(1) through the whole network."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = p[0].numel() ** -0.5 if p.dim() > 1 else 0.3
            norm_weight = "norm" in name and name.endswith("weight")
            p.copy_(torch.randn_like(p) * scale + (1.0 if norm_weight else 0.0))
    return model


def their_model(model):
    config = {k: v for k, v in unet.diffusers_config(model).items() if not k.startswith("_")}
    theirs = diffusers.UNet2DModel(**config).to(next(model.parameters()).dtype).eval()
    theirs.load_state_dict(unet.diffusers_state_dict(model), strict=True)
    return theirs


@pytest.mark.parametrize("mc", [ModelConfig(dropout=0.0),  # the 'ho' preset: Ho et al.'s CIFAR-10 network
                                wide(channel_mult=(1, 2, 2), num_res_blocks=2, attn_resolutions=(16, 4),
                                     attn_heads=0, attn_head_dim=32),
                                tiny_model(base_channels=32, norm_groups=16),  # a budget study's width
                                wide(scale_shift_norm=True),  # ADM's scale and shift after the norm
                                # BigGAN's resampling blocks, with and without attention on either path
                                wide(channel_mult=(1, 2, 2), attn_resolutions=(8,), resample="resblock")],
                         ids=["ho", "multihead", "base32", "scale_shift", "resblock"])
def test_float64_output_equals_diffusers(mc):
    torch.manual_seed(0)
    ours = randomise(UNet(mc)).double().eval()
    theirs = their_model(ours)
    x = torch.randn(4, 3, mc.image_size, mc.image_size, dtype=torch.float64)
    t = torch.tensor([0, 1, 500, mc.timesteps - 1])
    with torch.no_grad():
        a, b = ours(x, t), theirs(x, t).sample
    assert a.dtype == torch.float64 and b.abs().max() > 0.05  # a real output, not a vanishing one
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel <= 1e-9, rel


def test_round_trip_is_bitwise(tmp_path):
    ours = randomise(UNet(wide()))
    back = unet.load_diffusers_state_dict(UNet(wide()), unet.diffusers_state_dict(ours))
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    diffusers_io.write(str(tmp_path / "hub"), ours, wide(), unet)  # and through the files
    fields, state, _ = diffusers_io.read(str(tmp_path / "hub"), unet)
    again = unet.load_diffusers_state_dict(UNet(dataclasses.replace(wide(), **fields)), state)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


def test_every_tensor_is_used_exactly_once():
    state = unet.diffusers_state_dict(randomise(UNet(wide())))
    missing = dict(state)
    del missing["mid_block.attentions.0.to_k.weight"]
    with pytest.raises(ValueError, match="no tensor mid_block.attentions.0.to_k.weight"):
        unet.load_diffusers_state_dict(UNet(wide()), missing)
    with pytest.raises(ValueError, match="1 tensor.* no place for: extra.weight"):
        unet.load_diffusers_state_dict(UNet(wide()), {**state, "extra.weight": torch.zeros(1)})
    bad = {**state, "conv_in.weight": torch.zeros(64, 3, 1, 1)}
    with pytest.raises(ValueError, match=r"conv_in.weight has shape \(64, 3, 1, 1\)"):
        unet.load_diffusers_state_dict(UNet(wide()), bad)


def test_older_attention_names_load():
    """Older exports (the official DDPM checkpoints among them) name the attention layers query, key, value,
    proj_attn."""
    ours = randomise(UNet(wide()))
    old = {k.replace(".to_q.", ".query.").replace(".to_k.", ".key.").replace(".to_v.", ".value.")
           .replace(".to_out.0.", ".proj_attn."): v for k, v in unet.diffusers_state_dict(ours).items()}
    back = unet.load_diffusers_state_dict(UNet(wide()), old)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))


@pytest.mark.parametrize("kw,field", [(dict(patch_size=2, attn_resolutions=(4,)), "patch_size"),
                                      (dict(num_classes=4), "num_classes"), (dict(pos_emb=True), "pos_emb"),
                                      (dict(base_channels=16), "norm_groups")])
def test_models_diffusers_cannot_express_are_refused(kw, field):
    with pytest.raises(ValueError, match=f"cannot express {field}="):
        unet.diffusers_state_dict(UNet(tiny_model(**{"base_channels": 64, **kw})))


def test_a_narrow_network_goes_both_ways_with_one_group_count(tmp_path):
    """Widths 32 and 64 give per-width group counts [16, 32], which diffusers cannot hold: the refusal names
    --norm_groups and the counts that would work; with norm_groups=16 the network exports, and a folder of
    norm_num_groups 16 loads back as that network, bit for bit (Ho's 32 loads as the per-width default)."""
    with pytest.raises(ValueError, match=r"train with --norm_groups set to one of \[1, 2, 4, 8, 16\]"):
        unet.diffusers_state_dict(UNet(tiny_model(base_channels=32)))
    mc = tiny_model(base_channels=32, norm_groups=16)
    ours = randomise(UNet(mc))
    diffusers_io.write(str(tmp_path / "hub"), ours, mc, unet)
    fields, state, _ = diffusers_io.read(str(tmp_path / "hub"), unet)
    assert fields["norm_groups"] == 16
    assert json.load(open(tmp_path / "hub" / "config.json"))["norm_num_groups"] == 16
    again = unet.load_diffusers_state_dict(UNet(dataclasses.replace(mc, **fields)), state)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), again.state_dict().values()))
    ho = unet.model_fields_from_diffusers(unet.diffusers_config(UNet(ModelConfig())))
    assert ho["norm_groups"] == 0  # the config a run of the 'ho' preset records


def save_ema(model, mc, path):
    torch.save({"ema": model.state_dict(), "model_config": dataclasses.asdict(mc), "step": 0}, path)


def test_export_loads_in_diffusers_and_a_pipeline_runs(tmp_path):
    mc = wide(prediction="v", schedule="cosine", reverse_variance="small")
    ours = randomise(UNet(mc))
    save_ema(ours, mc, tmp_path / "ema.pt")
    sample.main(["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers", str(tmp_path / "hub")])
    theirs = diffusers.UNet2DModel.from_pretrained(str(tmp_path / "hub")).eval()
    scheduler = diffusers.DDPMScheduler.from_pretrained(str(tmp_path / "hub"))
    config = scheduler.config
    assert (config.prediction_type, config.variance_type) == ("v_prediction", "fixed_small")
    ref = diffusers.DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2")
    torch.testing.assert_close(scheduler.alphas_cumprod, ref.alphas_cumprod, rtol=0, atol=0)
    x, t = torch.randn(2, 3, 16, 16), torch.tensor([3, 97])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x, t).sample, ours.eval()(x, t), rtol=1e-5, atol=1e-5)
    images = diffusers.DDPMPipeline(unet=theirs, scheduler=scheduler)(batch_size=2, num_inference_steps=2,
                                                                      output_type="np").images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()


def test_sampling_a_save_pretrained_folder_equals_our_checkpoint(tmp_path):
    """The same weights as a folder diffusers wrote (a pipeline's unet/ and scheduler/) and as our ema.pt."""
    mc = wide()  # T = 100, linear, ε, σ² = β
    ours = randomise(UNet(mc))
    save_ema(ours, mc, tmp_path / "ema.pt")
    their_model(ours).save_pretrained(str(tmp_path / "pipe" / "unet"))
    diffusers.DDPMScheduler(num_train_timesteps=100, variance_type="fixed_large").save_pretrained(
        str(tmp_path / "pipe" / "scheduler"))
    for name, ckpt in (("ours", tmp_path / "ema.pt"), ("theirs", tmp_path / "pipe"),
                       ("unet", tmp_path / "pipe" / "unet")):
        sample.main(["--ckpt", str(ckpt), "--n", "3", "--steps", "4", "--sampler", "ddpm",
                     "--out", str(tmp_path / f"{name}.png")])
    a = np.load(tmp_path / "ours.npz")["arr_0"]
    assert a.std() > 0
    assert np.array_equal(a, np.load(tmp_path / "theirs.npz")["arr_0"])
    assert np.array_equal(a, np.load(tmp_path / "unet.npz")["arr_0"])


@pytest.mark.parametrize("file,change,needle", [
    ("config.json", {"down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"]}, "down_block_types="),
    ("config.json", {"out_channels": 6}, "out_channels=6 .*learned variance"),
    ("config.json", {"class_embed_type": "timestep"}, "class_embed_type="),
    ("config.json", {"norm_eps": 1e-5}, "norm_eps=1e-05"),
    ("config.json", {"flip_sin_to_cos": True}, "flip_sin_to_cos=True"),
    ("config.json", {"cross_attention_dim": 768}, "unknown UNet2DModel field cross_attention_dim"),
    ("config.json", {"_class_name": "UNet2DConditionModel"}, "_class_name="),
    ("scheduler_config.json", {"variance_type": "learned_range"}, "variance_type='learned_range'"),
    ("scheduler_config.json", {"beta_schedule": "scaled_linear"}, "beta_schedule='scaled_linear'"),
])
def test_configs_our_unet_cannot_express_are_one_line(tmp_path, capsys, file, change, needle):
    diffusers_io.write(str(tmp_path / "hub"), UNet(wide()), wide(), unet)
    path = tmp_path / "hub" / file
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(SystemExit) as e:
        sample.main(["--ckpt", str(tmp_path / "hub"), "--n", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(needle, err), err


@pytest.mark.parametrize("args,needle", [
    (["--ckpt", "{d}/hub", "--eval", "bpd"], "needs --dataset"),  # a folder records no training data
    (["--ckpt", "{d}/hub", "--eval", "fid"], "needs --dataset"),
    (["--ckpt", "{d}/missing"], "no checkpoint at"),
    (["--ckpt", "{d}/plain", "--export_diffusers", "{d}/out"],  # a folder with no ema.pt and no config.json
     "neither a run's checkpoint nor a diffusers model folder"),
    (["--ckpt", "{d}/cond.pt", "--export_diffusers", "{d}/out"], "cannot express num_classes=4"),
    (["--ckpt", "{d}/ema.pt", "--export_diffusers", "{d}/ema.pt"], "exists and is not an empty folder"),
])
def test_bad_folders_and_exports_are_one_line(tmp_path, capsys, args, needle):
    save_ema(UNet(wide()), wide(), tmp_path / "ema.pt")
    save_ema(UNet(wide(num_classes=4)), wide(num_classes=4), tmp_path / "cond.pt")
    diffusers_io.write(str(tmp_path / "hub"), UNet(wide()), wide(), unet)
    (tmp_path / "plain").mkdir()
    with pytest.raises(SystemExit) as e:
        sample.main([a.format(d=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_init_from_a_diffusers_folder(tmp_path):
    """ddpm.py --init_from=DIR starts model and EMA from the folder's weights (lr 0: they stay as loaded)."""
    mc = wide()
    src = randomise(UNet(mc))
    their_model(src).save_pretrained(str(tmp_path / "hub"))
    diffusers.DDPMScheduler(num_train_timesteps=100).save_pretrained(str(tmp_path / "hub"))
    out = train(mc, tiny_trainer(tmp_path / "run", max_steps=1, lr=0.0, warmup_steps=0,
                                 init_from=str(tmp_path / "hub")))
    ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True)
    for key in ("model", "ema"):
        assert all(torch.equal(a, ckpt[key][k]) for k, a in src.state_dict().items()), key


def test_sharded_safetensors_load(tmp_path):
    """A large export is sharded: diffusion_pytorch_model-0000N-of-0000M.safetensors and an index.json."""
    from safetensors.torch import load_file, save_file

    ours = randomise(UNet(wide()))
    diffusers_io.write(str(tmp_path / "hub"), ours, wide(), unet)
    state = load_file(str(tmp_path / "hub" / diffusers_io.WEIGHTS))
    (tmp_path / "hub" / diffusers_io.WEIGHTS).unlink()
    names = sorted(state)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "hub" / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "hub" / (diffusers_io.WEIGHTS + ".index.json")).write_text(json.dumps(index))
    model, _, _ = ddpm.load_ema(str(tmp_path / "hub"), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("prediction,theirs", [("v", "v_prediction"), ("eps", "epsilon"), ("x", "sample")])
def test_targets_and_the_clean_image_estimate_match_diffusers_schedulers(prediction, theirs):
    """The training target (ε, x₀ or v = √ᾱ ε − √(1−ᾱ) x₀) against DDPMScheduler's noise / sample /
    get_velocity, and the x̂₀ that every sampler builds on (predict_x0_eps) against DDIMScheduler's step with
    the same network output: on Ho's linear schedule, at low, middle and high noise (their ᾱ is float32)."""
    d = ddpm.Diffusion(ModelConfig(prediction=prediction))
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type=theirs)
    g = torch.Generator().manual_seed(0)
    x0, noise, out = (torch.randn(3, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    t = torch.tensor([0, 500, 999])
    their_target = {"v": ref.get_velocity(x0, noise, t), "eps": noise, "x": x0}[prediction]
    torch.testing.assert_close(d.target(x0, noise, t), their_target, rtol=1e-5, atol=1e-5)
    z = d.q_sample(x0, t, noise)
    torch.testing.assert_close(z, ref.add_noise(x0, noise, t), rtol=1e-5, atol=1e-5)
    ddim = diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", prediction_type=theirs,
                                   clip_sample=False, set_alpha_to_one=True)
    ddim.set_timesteps(1000)
    for i in range(3):
        ours, _ = d.predict_x0_eps(out[i:i + 1], z[i:i + 1], t[i:i + 1], threshold="none")
        step = ddim.step(out[i:i + 1], int(t[i]), z[i:i + 1], eta=0.0)
        torch.testing.assert_close(ours, step.pred_original_sample, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sigma_data", [0.5, 1.3])
def test_edm_preconditioning_matches_diffusers_edm_scheduler(sigma_data):
    """prediction='edm': the network's input (net_input) and the x̂₀ built from its output F (predict_x0_eps)
    against EDMEulerScheduler's precondition_inputs and precondition_outputs (Karras et al. 2022's c_in,
    c_skip, c_out) at the same σ, in EDM's variable x = z_t/√ᾱ_t; and the training target F is what makes
    their D(x; σ) the clean image."""
    d = ddpm.Diffusion(ModelConfig(prediction="edm", sigma_data=sigma_data))
    ref = diffusers.EDMEulerScheduler(sigma_data=sigma_data, prediction_type="epsilon")
    g = torch.Generator().manual_seed(0)
    x0, noise, out = (torch.randn(3, 3, 4, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for t in (0, 300, 999):
        tt = torch.full((3,), t)
        z = d.q_sample(x0, tt, noise)
        ab = d.alpha_bar[t].item()
        x, sigma = z / ab**0.5, torch.tensor(((1 - ab) / ab) ** 0.5, dtype=torch.float64)
        torch.testing.assert_close(d.net_input(z, tt), ref.precondition_inputs(x, sigma), rtol=1e-10, atol=0)
        x0_hat, _ = d.predict_x0_eps(out, z, tt, threshold="none")
        torch.testing.assert_close(x0_hat, ref.precondition_outputs(x, out, sigma), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ref.precondition_outputs(x, d.target(x0, noise, tt), sigma), x0,
                                   rtol=1e-9, atol=1e-9)


def test_scale_shift_config_goes_both_ways():
    """A scale-shift network's config.json reads back as the same network (its mid-block attention keeps its
    norm through attn_norm_num_groups); one without that norm is refused."""
    model = UNet(wide(scale_shift_norm=True))
    config = unet.diffusers_config(model)
    fields = unet.model_fields_from_diffusers(config)
    assert fields["scale_shift_norm"]
    unet.check_diffusers_config(UNet(dataclasses.replace(model.cfg, **fields)), config)
    with pytest.raises(ValueError, match="attn_norm_num_groups"):
        unet.check_diffusers_config(model, {**config, "attn_norm_num_groups": None})


def test_resample_config_goes_both_ways():
    """A network with BigGAN's resampling blocks reads back from its config.json as the same network; a
    config that resamples one way on the down path and another on the up path is refused."""
    model = UNet(wide(channel_mult=(1, 2, 2), attn_resolutions=(8,), resample="resblock"))
    config = unet.diffusers_config(model)
    assert config["down_block_types"] == ["ResnetDownsampleBlock2D", "AttnDownBlock2D",
                                          "ResnetDownsampleBlock2D"]
    fields = unet.model_fields_from_diffusers(config)
    assert fields["resample"] == "resblock"
    unet.check_diffusers_config(UNet(dataclasses.replace(model.cfg, **fields)), config)
    with pytest.raises(ValueError, match="upsample_type='conv' cannot be expressed"):
        unet.model_fields_from_diffusers({**config, "upsample_type": "conv"})
    with pytest.raises(ValueError, match="down_block_types=.*cannot be expressed"):
        unet.model_fields_from_diffusers({**config, "downsample_type": "conv", "upsample_type": "conv"})
