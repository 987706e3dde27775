"""Survive round 3, a diffusers model folder from strangers (diffusers_io.py): every size in its configs
bounded and type-checked before anything is built, its files confined to the folder and regular, its weights
floating point, every malformed structure one `error:` line; and an export that replaces links planted in its
folder, never follows them."""
import dataclasses
import json
import os
import resource
import shutil
import signal

import pytest
import safetensors.torch
import torch
from conftest import one_line_error, tiny_model
from safetensors.torch import load_file, save_file

import ddpm
import sample
import unet
from machinery import diffusers_io, files
from machinery.errors import UserError
from unet import UNet

INDEX = diffusers_io.WEIGHTS + ".index.json"


def mc():
    return tiny_model(base_channels=64)  # every GroupNorm 32 groups, as diffusers' norm_num_groups wants


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One exported folder (config.json, the weights, scheduler_config.json) and the model it holds."""
    model = UNet(mc())
    path = tmp_path_factory.mktemp("export") / "hub"
    diffusers_io.write(str(path), model, mc(), unet)
    return path, model


@pytest.fixture
def hub(tmp_path, exported):
    """A fresh copy of the exported folder, for a test to spoil."""
    shutil.copytree(exported[0], tmp_path / "hub")
    return tmp_path / "hub"


def edit(path, **change):
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def load_error(folder):
    """ddpm.load_ema(folder) raises a UserError of one line (no traceback) -> that line."""
    with pytest.raises(UserError) as e:
        ddpm.load_ema(str(folder), "cpu")
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


NAN, INF = float("nan"), float("inf")  # json.dumps writes them as NaN and Infinity, which json.loads reads
CONFIGS = [  # (field, value, what the line says)
    ("layers_per_block", 1000000, "layers_per_block=1000000: must be an integer in [1, 64]"),
    ("layers_per_block", 10**40, "must be an integer in [1, 64]"),
    ("layers_per_block", 1e9, "layers_per_block=1000000000.0: must be an integer"),
    ("layers_per_block", True, "layers_per_block=True: must be an integer"),
    ("layers_per_block", "2", "layers_per_block='2': must be an integer"),
    ("layers_per_block", None, "layers_per_block=None: must be an integer"),
    ("layers_per_block", 0, "must be an integer in [1, 64]"), ("layers_per_block", -1, "must be an integer"),
    ("layers_per_block", 2.0, "must be an integer"), ("layers_per_block", [2], "must be an integer"),
    ("layers_per_block", {"a": 2}, "must be an integer"),
    ("sample_size", 10**9, "sample_size=1000000000: must be an integer in [1, 4096] or a list"),
    ("sample_size", 1e9, "must be an integer in [1, 4096]"), ("sample_size", NAN, "sample_size=nan"),
    ("sample_size", None, "sample_size=None: must be"), ("sample_size", "16", "must be an integer"),
    ("sample_size", True, "sample_size=True"), ("sample_size", [[16]], "must be an integer"),
    ("sample_size", [16, 16, 16], "or a list [height, width]"), ("sample_size", 0, "must be"),
    ("sample_size", [16, 32], "sample_size=[16, 32] cannot be expressed by this UNet (square images"),
    ("block_out_channels", [10**9, 2 * 10**9], ": must be a list of 1 to 16 integers in [2, 16384]"),
    ("block_out_channels", [32768, 65536], "integers in [2, 16384]"), ("block_out_channels", [64, "128"],
                                                                       "integers"),
    ("block_out_channels", "64", "must be a list"), ("block_out_channels", 64, "must be a list"),
    ("block_out_channels", [], "must be a list of 1 to 16"), ("block_out_channels", [64] * 17, "1 to 16"),
    ("block_out_channels", [True, 128], "integers"), ("block_out_channels", [64, NAN], "integers"),
    ("block_out_channels", [1, 2], "integers in [2, 16384]"), ("block_out_channels", None, "must be a list"),
    ("block_out_channels", {"0": 64}, "must be a list"), ("block_out_channels", [-64, 128], "in [2, 16384]"),
    ("in_channels", 0, "in_channels=0: must be an integer in [1, 64]"), ("in_channels", 10**9,
                                                                         "in_channels="),
    ("out_channels", None, "out_channels=None: must be"),
    ("attention_head_dim", 0, "attention_head_dim=0: must be an integer in [1, 16384] or null"),
    ("attention_head_dim", -8, "attention_head_dim"), ("attention_head_dim", "8", "attention_head_dim"),
    ("attention_head_dim", 7,
     "attention_head_dim=7 cannot be expressed by this UNet (heads of one width that divides"),
    ("norm_num_groups", 0, "norm_num_groups=0"), ("norm_num_groups", True, "norm_num_groups=True"),
    ("norm_num_groups", 1e9, "norm_num_groups"), ("attn_norm_num_groups", 10**9, "attn_norm_num_groups"),
    ("norm_eps", NAN, "norm_eps=nan: must be a finite number in (0, 1)"), ("norm_eps", INF, "norm_eps=inf"),
    ("norm_eps", -1, "norm_eps=-1"), ("norm_eps", "1e-6", "norm_eps='1e-6'"),
    ("dropout", 1.0, "dropout=1.0: must be a finite number in [0, 1)"), ("dropout", NAN, "dropout=nan"),
    ("dropout", -0.1, "dropout=-0.1"), ("dropout", None, "dropout=None"),
    ("down_block_types", "DownBlock2D", "down_block_types='DownBlock2D': must be a list of 1 to 16 strings"),
    ("down_block_types", [1, 2], "down_block_types"), ("down_block_types", [["DownBlock2D"]],
                                                       "down_block_types"),
    ("down_block_types", None, "down_block_types=None"), ("up_block_types", {}, "up_block_types={}"),
    ("_class_name", ["UNet2DModel"], "_class_name=['UNet2DModel']: must be a string"),
    ("mid_block_type", 5, "mid_block_type=5: must be a string"),
    ("flip_sin_to_cos", 0, "flip_sin_to_cos=0: must be true or false"), ("add_attention", "yes",
                                                                         "add_attention"),
    ("freq_shift", True, "freq_shift=True: must be an integer"), ("time_embedding_type", None,
                                                                  "time_embedding_type"),
    ("act_fn", "x" * 10**6, "act_fn='xxxxx"), ("act_fn", "x" * 10**6,
                                               "xx...: must be a string of at most 100 characters"),
    ("num_train_timesteps", 10**9,
     "num_train_timesteps=1000000000: must be an integer in [1, 100000] or null"),
    ("num_class_embeds", True, "num_class_embeds=True"), ("mid_block_scale_factor", INF,
                                                          "mid_block_scale_factor=inf"),
    ("downsample_padding", 10**9, "downsample_padding"), ("time_embedding_dim", -1, "time_embedding_dim"),
]


@pytest.mark.parametrize("field,value,needle", CONFIGS, ids=[f"{f}={str(v)[:20]}" for f, v, _ in CONFIGS])
def test_malformed_config_json_is_one_line(hub, field, value, needle):
    edit(hub / "config.json", **{field: value})
    message = load_error(hub)
    assert message.startswith(f"{hub}: config.json: {field}=") and needle in message, message


SCHEDULERS = [
    ("num_train_timesteps", 10**9, "num_train_timesteps=1000000000: must be an integer in [2, 100000]"),
    ("num_train_timesteps", 1e9, "must be an integer in [2, 100000]"), ("num_train_timesteps", 1,
                                                                        "[2, 100000]"),
    ("num_train_timesteps", True, "num_train_timesteps=True"), ("num_train_timesteps", "1000", "integer"),
    ("num_train_timesteps", None, "num_train_timesteps=None"), ("num_train_timesteps", NAN, "=nan"),
    ("beta_start", 0, "beta_start=0: must be a finite number in (0, 1)"), ("beta_start", 1, "beta_start=1"),
    ("beta_start", NAN, "beta_start=nan"), ("beta_start", -1e-4, "(0, 1)"), ("beta_start", "0.0001",
                                                                             "beta_start"),
    ("beta_start", None, "beta_start=None"), ("beta_end", 1.5, "beta_end=1.5"), ("beta_end", INF,
                                                                                 "beta_end=inf"),
    ("beta_end", [0.02], "beta_end=[0.02]"), ("beta_schedule", None, "beta_schedule=None: must be a string"),
    ("beta_schedule", 5, "beta_schedule=5"), ("prediction_type", ["epsilon"], "prediction_type"),
    ("variance_type", {"a": 1}, "variance_type"), ("rescale_betas_zero_snr", "false",
                                                   "must be true or false"),
    ("rescale_betas_zero_snr", 0, "rescale_betas_zero_snr=0"),
    ("trained_betas", [0.01] * 10000, "trained_betas=[0.01, 0.01"),
    ("trained_betas", [0.01] * 10000, "... cannot be expressed (explicit betas"),
]


@pytest.mark.parametrize("field,value,needle", SCHEDULERS, ids=[f"{f}={str(v)[:20]}" for f, v,
                                                                _ in SCHEDULERS])
def test_malformed_scheduler_config_json_is_one_line(hub, field, value, needle):
    edit(hub / diffusers_io.SCHEDULER, **{field: value})
    message = load_error(hub)
    assert message.startswith(f"{hub}: scheduler_config.json: {field}=") and needle in message, message


def test_the_one_line_reaches_the_command_line(hub, capsys):
    """sample.py --ckpt FOLDER: exit status 2 and one `error:` line, for a size, a type and a pipeline's
    unet/."""
    edit(hub / "config.json", layers_per_block=1000000)
    err = one_line_error(capsys, sample.main, ["--ckpt", str(hub), "--n", "1"])
    assert err == f"error: {hub}: config.json: layers_per_block=1000000: must be an integer in [1, 64]"
    edit(hub / "config.json", layers_per_block=1)
    edit(hub / diffusers_io.SCHEDULER, num_train_timesteps=1e9)
    err = one_line_error(capsys, sample.main, ["--ckpt", str(hub), "--n", "1"])
    assert "scheduler_config.json: num_train_timesteps=1000000000.0: must be an integer in [2, 100000]" in err
    pipe = hub.parent / "pipe"
    (pipe / "scheduler").mkdir(parents=True)
    shutil.move(hub / diffusers_io.SCHEDULER, pipe / "scheduler" / diffusers_io.SCHEDULER)
    shutil.move(hub, pipe / "unet")
    err = one_line_error(capsys, sample.main, ["--ckpt", str(pipe), "--n", "1"])
    assert err.startswith(f"error: {pipe}: scheduler/scheduler_config.json: num_train_timesteps="), err


def test_missing_fields_take_diffusers_defaults(hub, exported):
    """A field left out is diffusers' default (not a traceback): in_channels 3 loads; a default that differs
    from this network (block_out_channels) is refused before the network is built."""
    config = json.loads((hub / "config.json").read_text())
    del config["in_channels"], config["out_channels"], config["dropout"]
    (hub / "config.json").write_text(json.dumps(config))
    model, _, _ = ddpm.load_ema(str(hub), "cpu")
    assert same_weights(model, exported[1])
    del config["block_out_channels"], config["sample_size"]
    (hub / "config.json").write_text(json.dumps(config))
    assert "sample_size=None: must be an integer in [1, 4096]" in load_error(hub)
    config["sample_size"] = 16
    (hub / "config.json").write_text(json.dumps(config))
    assert "down_block_types=['DownBlock2D', 'AttnDownBlock2D'] cannot be expressed" in load_error(hub)


def test_a_config_larger_than_its_weights_is_refused_before_the_network_is_built(hub, monkeypatch):
    """Sizes inside their bounds can still ask for terabytes together: the network is laid out on the meta
    device and each tensor it needs must be in the weights, in its shape, before it is built."""
    built = []
    monkeypatch.setattr(ddpm, "UNet", lambda *a, **k: built.append(1) or UNet(*a, **k))
    edit(hub / "config.json", block_out_channels=[16384, 16384], layers_per_block=64, norm_num_groups=32)
    message = load_error(hub)  # the first tensor the network needs, and the shape it needs
    assert "time_embedding.linear_1.weight has shape (256, 64); this model's is (65536, 16384)" in message
    assert not built


@pytest.mark.parametrize("content,needle", [
    (b"[]", "config.json is not a JSON object"), (b"null", "not a JSON object"), (b"1", "not a JSON object"),
    (b"not json", "cannot read config.json (JSONDecodeError"), (b"\xff\xfe\x00\x01",
                                                                "cannot read config.json"),
    (b"", "cannot read config.json"), (b"[" * 100000, "cannot read config.json (RecursionError"),
    (b'{"layers_per_block": ' + b"1" * 5000 + b"}", "cannot read config.json (ValueError"),
    (b"{" + b" " * (17 * 2**20) + b"}", "config.json is larger than 16 MiB"),
])
def test_config_json_that_is_no_json_object_is_one_line(hub, content, needle):
    (hub / "config.json").write_bytes(content)
    assert needle in load_error(hub)


@pytest.mark.parametrize("make", ["fifo", "folder", "device", "dangling"])
def test_config_json_that_is_not_a_regular_file_is_one_line_and_never_blocks(hub, make):
    os.remove(hub / "config.json")
    if make == "fifo":
        os.mkfifo(hub / "config.json")
    elif make == "folder":
        os.mkdir(hub / "config.json")
    elif make == "device":
        os.symlink("/dev/zero", hub / "config.json")
    else:
        os.symlink(hub / "nowhere.json", hub / "config.json")
    message = load_error(hub)
    assert "config.json" in message, message


def test_a_scheduler_config_json_that_is_a_broken_link_is_an_error_not_a_default(hub):
    os.remove(hub / diffusers_io.SCHEDULER)
    os.symlink(hub / "nowhere.json", hub / diffusers_io.SCHEDULER)
    assert "cannot read scheduler_config.json (No such file or directory)" in load_error(hub)


def shard(hub, names=None):
    """Split the folder's weights into two shards and an index; -> (the index's path, the two shard names)."""
    state = load_file(str(hub / diffusers_io.WEIGHTS))
    os.remove(hub / diffusers_io.WEIGHTS)
    keys = sorted(state)
    names = names or ["diffusion_pytorch_model-00001-of-00002.safetensors",
                      "diffusion_pytorch_model-00002-of-00002.safetensors"]
    for name, part in zip(names, (keys[::2], keys[1::2])):
        save_file({k: state[k] for k in part}, str(hub / name))
    index = hub / INDEX
    index.write_text(json.dumps({"weight_map": {k: n for n, part in zip(names, (keys[::2], keys[1::2]))
                                                for k in part}}))
    return index, names


@pytest.mark.parametrize("weight_map,needle", [
    ([], "weight_map=[]: must map tensor names to shard file names"), (7, "weight_map=7"), ("x",
                                                                                            "weight_map='x'"),
    ({}, "weight_map={}"), (None, "weight_map=None"), ({"conv_in.weight": 1},
                                                       "weight_map={'conv_in.weight': 1}"),
    ({"conv_in.weight": ["a.safetensors"]}, "must map tensor names"),
    ({"conv_in.weight": {"a": "b"}}, "must map tensor names"),
    ({"conv_in.weight": "/etc/passwd"},
     "names the shard '/etc/passwd': a shard must be a .safetensors file in the"),
    ({"conv_in.weight": "sub/x.safetensors"}, "'sub/x.safetensors'"),
    ({"conv_in.weight": "..safetensors"}, "'..safetensors'"), ({"conv_in.weight": ".x.safetensors"},
                                                               "'.x.safetensors'"),
    ({"conv_in.weight": "config.json"}, "'config.json'"), ({"conv_in.weight": "a\\b.safetensors"}, "a\\\\b"),
])
def test_malformed_shard_index_is_one_line(hub, weight_map, needle):
    index, _ = shard(hub)
    index.write_text(json.dumps({"weight_map": weight_map}))
    message = load_error(hub)
    assert message.startswith(f"{hub}: {INDEX}: weight_map"), message
    assert needle in message, message


@pytest.mark.parametrize("content,needle", [(b"[]", "is not a JSON object"), (b"{", "cannot read"),
                                            (b"{}", "weight_map=None")])
def test_shard_index_that_is_no_json_object_is_one_line(hub, content, needle):
    index, _ = shard(hub)
    index.write_bytes(content)
    message = load_error(hub)
    assert INDEX in message and needle in message, message


@pytest.mark.parametrize("where", ["../outside.safetensors", "{tmp}/outside.safetensors",
                                   "{tmp}/../{tmpname}/outside.safetensors"])
def test_a_shard_outside_the_folder_is_never_opened(hub, tmp_path, monkeypatch, where):
    """A weight_map that names a real weights file outside the folder (relative or absolute) is refused: not
    loaded."""
    index, names = shard(hub)
    os.rename(hub / names[1], tmp_path / "outside.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    target = where.format(tmp=tmp_path, tmpname=tmp_path.name)
    index.write_text(json.dumps({"weight_map": {k: target if v == names[1] else v for k,
                                                v in weight_map.items()}}))
    opened = []
    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda path,
                        **kw: opened.append(path) or real(path, **kw))
    assert "weight_map names the shard" in load_error(hub)
    assert opened == []  # refused when the index was read: no shard was opened


@pytest.mark.parametrize("target", ["../outside.safetensors", "{tmp}/outside.safetensors", "/dev/zero"])
def test_a_link_leading_out_of_the_folder_is_refused(hub, tmp_path, target):
    """The main weights file, or a shard, that is a link to a real weights file outside the folder:
    refused."""
    shutil.copy(hub / diffusers_io.WEIGHTS, tmp_path / "outside.safetensors")
    os.remove(hub / diffusers_io.WEIGHTS)
    os.symlink(target.format(tmp=tmp_path), hub / diffusers_io.WEIGHTS)
    assert "is a link that leads out of the model folder" in load_error(hub)
    os.remove(hub / diffusers_io.WEIGHTS)
    shutil.copy(tmp_path / "outside.safetensors", hub / diffusers_io.WEIGHTS)
    _, names = shard(hub)
    os.remove(hub / names[0])
    os.symlink(target.format(tmp=tmp_path), hub / names[0])
    message = load_error(hub)
    assert f"{names[0]} is a link that leads out of the model folder" in message, message


def test_links_inside_the_folder_and_into_the_hugging_face_cache_load(tmp_path, exported):
    """Hugging Face's cache keeps a snapshot's files as links to ../../blobs/<hash>: those load, as does a
    link to a file inside the folder itself."""
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in os.listdir(exported[0]):
        shutil.copy(exported[0] / name, repo / "blobs" / f"hash-{len(name)}")
        os.symlink(f"../../blobs/hash-{len(name)}", snapshot / name)
    model, _, _ = ddpm.load_ema(str(snapshot), "cpu")
    assert same_weights(model, exported[1])
    inside = tmp_path / "inside"
    inside.mkdir()
    for name in os.listdir(exported[0]):
        shutil.copy(exported[0] / name, inside / name)
    os.rename(inside / diffusers_io.WEIGHTS, inside / "weights.real")
    os.symlink("weights.real", inside / diffusers_io.WEIGHTS)
    model, _, _ = ddpm.load_ema(str(inside), "cpu")
    assert same_weights(model, exported[1])


@pytest.mark.parametrize("make", ["fifo", "folder"])
def test_a_weights_file_that_is_not_a_regular_file_is_one_line_and_never_blocks(hub, make):
    os.remove(hub / diffusers_io.WEIGHTS)
    (os.mkfifo if make == "fifo" else os.mkdir)(hub / diffusers_io.WEIGHTS)
    assert f"{diffusers_io.WEIGHTS} is not a regular file" in load_error(hub)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int64, torch.bool, torch.complex64, torch.uint8,
                                   torch.float8_e4m3fn])
def test_weights_that_are_not_floating_point_are_refused_naming_the_tensor(hub, capsys, dtype):
    state = load_file(str(hub / diffusers_io.WEIGHTS))
    state["conv_in.weight"] = state["conv_in.weight"].to(dtype)
    save_file(state, str(hub / diffusers_io.WEIGHTS))
    message = load_error(hub)
    expected = (f"{diffusers_io.WEIGHTS}: tensor 'conv_in.weight' is {dtype}; "
                "weights must be float16, bfloat16")
    assert expected in message
    err = one_line_error(capsys, sample.main, ["--ckpt", str(hub), "--n", "1"])
    assert "tensor 'conv_in.weight'" in err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_weights_in_every_floating_point_dtype_load(hub, exported, dtype):
    state = load_file(str(hub / diffusers_io.WEIGHTS))
    save_file({k: v.to(dtype) for k, v in state.items()}, str(hub / diffusers_io.WEIGHTS))
    model, _, _ = ddpm.load_ema(str(hub), "cpu")
    assert all(torch.equal(a, b.to(dtype).float()) for a, b in zip(model.state_dict().values(),
                                                                   exported[1].state_dict().values()))


@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
@pytest.mark.parametrize("content,needle", [
    (lambda s: {**s, "conv_in.weight": s["conv_in.weight"].int()}, "tensor 'conv_in.weight' is torch.int32"),
    (lambda s: {**s, "conv_in.weight": 3}, "'conv_in.weight' is not a named dense tensor"),
    (lambda s: {**s, 5: s["conv_in.weight"]}, "5 is not a named dense tensor"),
    (lambda s: list(s.values()), "holds a list, not named tensors"),
    (lambda s: {**s, "conv_in.weight": s["conv_in.weight"].to_sparse()}, "is not a named dense tensor"),
    (lambda s: {**s, "conv_in.weight": s["conv_in.weight"].to("meta")},
     "'conv_in.weight' is not a named dense"),
])
def test_an_older_bin_export_holds_named_floating_point_tensors_only(hub, exported, content, needle):
    state = load_file(str(hub / diffusers_io.WEIGHTS))
    os.remove(hub / diffusers_io.WEIGHTS)
    torch.save(state, hub / diffusers_io.OLD_WEIGHTS)
    model, _, _ = ddpm.load_ema(str(hub), "cpu")
    assert same_weights(model, exported[1])
    torch.save(content(state), hub / diffusers_io.OLD_WEIGHTS)
    message = load_error(hub)
    assert diffusers_io.OLD_WEIGHTS in message and needle in message, message


def test_misshapen_or_doubled_tensors_are_one_line(hub):
    state = load_file(str(hub / diffusers_io.WEIGHTS))
    key = "mid_block.attentions.0.to_k.weight"
    # 1-D: torch.cat would traceback
    save_file({**state, key: state[key][0]}, str(hub / diffusers_io.WEIGHTS))
    assert f"{key} has shape (128,); this model's is (128, 128)" in load_error(hub)
    save_file(state, str(hub / diffusers_io.WEIGHTS))
    index, names = shard(hub)
    save_file({"conv_in.bias": state["conv_in.bias"]}, str(hub / "diffusion_pytorch_model-extra.safetensors"))
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": {**weight_map,
                                                "x": "diffusion_pytorch_model-extra.safetensors"}}))
    assert "tensor 'conv_in.bias' is in" in load_error(hub)


def save_ema(model, path):
    torch.save({"ema": model.state_dict(), "model_config": dataclasses.asdict(mc()), "step": 0}, path)


def plant_links_at_write(monkeypatch, folder, victim):
    """Plant links to `victim` at every file diffusers_io.write makes, after it has found the folder empty (as
    someone racing it could)."""
    real = unet.diffusers_state_dict

    def planting(model):
        for name in ("config.json", diffusers_io.WEIGHTS, diffusers_io.SCHEDULER):
            os.symlink(victim, folder / name)
        return real(model)

    monkeypatch.setattr(unet, "diffusers_state_dict", planting)


def test_links_planted_at_the_export_are_replaced_never_followed(tmp_path, monkeypatch, capsys):
    model = UNet(mc())
    save_ema(model, tmp_path / "ema.pt")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "hub").mkdir()
    plant_links_at_write(monkeypatch, tmp_path / "hub", victim)
    sample.main(["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers", str(tmp_path / "hub")])
    assert victim.read_text() == "precious"
    for name in ("config.json", diffusers_io.WEIGHTS, diffusers_io.SCHEDULER):
        assert files.is_regular(tmp_path / "hub" / name), name
    assert sorted(os.listdir(tmp_path / "hub")) == sorted(["config.json", diffusers_io.WEIGHTS,
                                                           diffusers_io.SCHEDULER])
    monkeypatch.undo()
    loaded, _, _ = ddpm.load_ema(str(tmp_path / "hub"), "cpu")
    assert same_weights(loaded, model)
    # the export target itself a link to a file: refused, the file untouched
    os.symlink(victim, tmp_path / "link")
    err = one_line_error(capsys, sample.main, ["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers",
                                               str(tmp_path / "link")])
    assert "exists and is not an empty folder" in err and victim.read_text() == "precious"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
@pytest.mark.parametrize("mode,code,needle", [
    (0o500, 1,
     "could not write {d}/diffusion_pytorch_model.safetensors (Permission denied); the export is incomplete"),
    (0o000, 2, "--export_diffusers: cannot write {d} (Permission denied)"),
])
def test_an_export_to_a_read_only_folder_is_one_line(tmp_path, capsys, mode, code, needle):
    save_ema(UNet(mc()), tmp_path / "ema.pt")
    (tmp_path / "hub").mkdir()
    os.chmod(tmp_path / "hub", mode)
    try:
        err = one_line_error(capsys, sample.main, ["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers",
                                                   str(tmp_path / "hub")], code=code)
    finally:
        os.chmod(tmp_path / "hub", 0o700)
    assert needle.format(d=tmp_path / "hub") in err, err
    assert os.listdir(tmp_path / "hub") == []  # no temporary file left behind


def test_an_export_to_a_full_disk_is_one_line_and_leaves_no_half_file(tmp_path, capsys):
    """A write past RLIMIT_FSIZE fails as on a full disk (EFBIG instead of ENOSPC), on this process's files
    only."""
    save_ema(UNet(mc()), tmp_path / "ema.pt")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, hard))
    try:
        err = one_line_error(capsys, sample.main, ["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers",
                                                   str(tmp_path / "hub")], code=1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert f"could not write {tmp_path}/hub/{diffusers_io.WEIGHTS} (File too large)" in err, err
    assert os.listdir(tmp_path / "hub") == []


def test_a_safetensors_error_in_an_export_is_one_line(tmp_path, capsys, monkeypatch):
    from safetensors import SafetensorError

    save_ema(UNet(mc()), tmp_path / "ema.pt")

    def failing(*args, **kw):
        raise SafetensorError("cannot serialize\nsecond line")

    monkeypatch.setattr(safetensors.torch, "save", failing)
    err = one_line_error(capsys, sample.main, ["--ckpt", str(tmp_path / "ema.pt"), "--export_diffusers",
                                               str(tmp_path / "hub")])
    weights = f"{tmp_path}/hub/{diffusers_io.WEIGHTS}"
    assert err == f"error: --export_diffusers: cannot write {weights} (cannot serialize)"
