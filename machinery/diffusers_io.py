"""Model folders in diffusers' format, read and written without diffusers (diffusers is a test oracle only).

A model folder holds config.json (UNet2DModel's config) and diffusion_pytorch_model.safetensors (or the .bin
of older exports, or safetensors shards with an index); beside it may lie scheduler_config.json. A pipeline
folder (model_index.json) holds them as unet/ and scheduler/.

    fields, state, notes = read(path, unet)  # ModelConfig fields, UNet2DModel-named tensors, notes
    write(path, model, mc, unet)             # config.json, the safetensors weights, scheduler_config.json

A folder comes from strangers, so reading one trusts nothing in it. The JSON files are regular files of at
most 16 MiB holding an object; every field of config.json and scheduler_config.json is type-checked and
bounded (LIMITS) before anything is built; the network config.json describes is then built on the meta
device (no memory), and every tensor it needs must be in the weights, in its shape, before it is built for
real: it never needs more memory than the weights hold. A shard the index names is a plain
file name in the folder; every weights file is a regular file that no link leads out of the folder (but
into the blobs/ of the Hugging Face cache repository the folder is a snapshot of, where the cache's own
links lead); every tensor is float16, bfloat16, float32 or float64. Writing creates each file fresh and
renames it into place (files.created): a link planted in the folder is replaced, never followed.

The network's side of the format (tensor names, config.json's fields) is in unet.py, which the caller hands
in (`network`: this package never imports the method); this file adds the files and the noise schedule
(scheduler_config.json). Errors are ValueError with one line naming the file (relative
to the folder given: the caller names that) and the field.
"""
import json
import math
import os
import stat
import types

import torch

from machinery import files
from machinery.errors import UserError, first_line

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"  # the shards' index: {"weight_map": {tensor name: shard file name}}
OLD_WEIGHTS = "diffusion_pytorch_model.bin"
SCHEDULER = "scheduler_config.json"
MAX_JSON_BYTES = 16 * 2**20  # config.json, scheduler_config.json and the index are read up to this size
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the weights' dtypes read

# Every field of config.json and scheduler_config.json that is read: (kind, interval, null allowed), checked
# before anything is built or allocated. Kinds: integer (not a bool), number (an integer or a finite float),
# boolean, string (at most MAX_TEXT characters); integers and strings are lists of 1..MAX_LEVELS of them (one
# per level of the network); size is an integer or a list [height, width] of them. A field left out takes
# diffusers' default (the network's DIFFUSERS_DEFAULTS, SCHEDULER_DEFAULTS), which must pass the same check.
MAX_LEVELS, MAX_TEXT = 16, 100
WIDTH = "[2, 16384]"  # a level's channels (2: our GroupNorms' least); a 16384-wide 3x3 conv: 2.4G numbers
LIMITS = {
    "config.json": {  # UNet2DModel
        "_class_name": ("string", None, False),
        "sample_size": ("size", "[1, 4096]", False),  # pixels
        "in_channels": ("integer", "[1, 64]", False),
        "out_channels": ("integer", "[1, 64]", False),
        "block_out_channels": ("integers", WIDTH, False),  # one width per level, at most MAX_LEVELS levels
        "layers_per_block": ("integer", "[1, 64]", False),
        "attention_head_dim": ("integer", "[1, 16384]", True),
        "norm_num_groups": ("integer", "[1, 16384]", False),
        "attn_norm_num_groups": ("integer", "[1, 16384]", True),
        "time_embedding_dim": ("integer", "[1, 65536]", True),
        "num_class_embeds": ("integer", "[1, 100000]", True),
        "num_train_timesteps": ("integer", "[1, 100000]", True),
        "freq_shift": ("integer", "[0, 16384]", False),
        "downsample_padding": ("integer", "[0, 16]", False),
        "mid_block_scale_factor": ("number", "[0, 1000]", False),
        "dropout": ("number", "[0, 1)", False),
        "norm_eps": ("number", "(0, 1)", False),
        "center_input_sample": ("boolean", None, False), "flip_sin_to_cos": ("boolean", None, False),
        "add_attention": ("boolean", None, False),
        "down_block_types": ("strings", None, False), "up_block_types": ("strings", None, False),
        "mid_block_type": ("string", None, True), "class_embed_type": ("string", None, True),
        "time_embedding_type": ("string", None, False), "downsample_type": ("string", None, False),
        "upsample_type": ("string", None, False), "act_fn": ("string", None, False),
        "resnet_time_scale_shift": ("string", None, False),
    },
    SCHEDULER: {  # DDPMScheduler: the fields that make the model (sampling options are not read;
        # trained_betas must be null, and is quoted cut short where it is not)
        "num_train_timesteps": ("integer", "[2, 100000]", False),  # T
        "beta_start": ("number", "(0, 1)", False), "beta_end": ("number", "(0, 1)", False),
        "beta_schedule": ("string", None, False), "variance_type": ("string", None, False),
        "prediction_type": ("string", None, False), "rescale_betas_zero_snr": ("boolean", None, False),
    },
}
SCHEDULER_DEFAULTS = dict(  # DDPMScheduler's own defaults (diffusers 0.42), for fields a config leaves out
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    variance_type="fixed_small", prediction_type="epsilon", rescale_betas_zero_snr=False,
)
SCHEDULES = {"linear": "linear", "squaredcos_cap_v2": "cosine"}  # diffusers' name -> ours (the same β_t)
PREDICTIONS = {"epsilon": "eps", "sample": "x", "v_prediction": "v"}
VARIANCES = {"fixed_small": "small", "fixed_small_log": "small",
             "fixed_large": "large", "fixed_large_log": "large"}


def shown(value, limit=60):
    """repr(value), cut to `limit` characters: a value from a file, quoted in a one-line error."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<a deeply nested {type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def fits(value, kind, interval):
    """Whether `value` is a `kind` (LIMITS) inside `interval` (an integer's or a number's)."""
    if kind in ("integers", "strings"):
        return (isinstance(value, list) and 1 <= len(value) <= MAX_LEVELS
                and all(fits(v, kind[:-1], interval) for v in value))
    if kind == "size":
        return fits(value, "integer", interval) or (isinstance(value, list) and 1 <= len(value) <= 2
                                                    and all(fits(v, "integer", interval) for v in value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= MAX_TEXT
    if isinstance(value, bool) or not isinstance(value, int if kind == "integer" else (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False  # (an int may be too large for a float, so only floats are asked)
    low, high = (float(x) for x in interval[1:-1].split(","))
    return ((low < value if interval[0] == "(" else low <= value)
            and (value < high if interval[-1] == ")" else value <= high))


def described(kind, interval, nullable):
    """What a LIMITS entry asks for, in words."""
    what = {"integer": f"an integer in {interval}", "number": f"a finite number in {interval}",
            "boolean": "true or false", "string": f"a string of at most {MAX_TEXT} characters",
            "integers": f"a list of 1 to {MAX_LEVELS} integers in {interval}",
            "strings": f"a list of 1 to {MAX_LEVELS} strings of at most {MAX_TEXT} characters",
            "size": f"an integer in {interval} or a list [height, width] of them"}[kind]
    return what + (" or null" if nullable else "")


def checked(config, file, name, defaults=SCHEDULER_DEFAULTS):
    """`config` (the JSON object of `file`, a key of LIMITS) with diffusers' `defaults` filled in, every field
    LIMITS lists type-checked and bounded: else ValueError `name: field=value: must be ...`."""
    config = {**defaults, **config}
    for field, (kind, interval, nullable) in LIMITS[file].items():
        value = config.get(field)
        if field in config and not (value is None and nullable) and not fits(value, kind, interval):
            raise ValueError(f"{name}: {field}={shown(value)}: must be {described(kind, interval, nullable)}")
    return config


def is_folder(path):
    return os.path.isdir(path)


def locate(path):
    """-> (the folder with the UNet's config.json, the scheduler_config.json or None)."""
    model_dir = (os.path.join(path, "unet") if os.path.lexists(os.path.join(path, "unet", "config.json"))
                 else path)
    if not os.path.lexists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{path} is neither a run's checkpoint nor a diffusers model folder "
                         "(no config.json)")
    candidates = [os.path.join(model_dir, SCHEDULER), os.path.join(path, "scheduler", SCHEDULER)]
    pipeline = path if model_dir != path else None
    if os.path.basename(os.path.normpath(model_dir)) == "unet":  # the unet/ folder of a pipeline
        pipeline = os.path.join(model_dir, os.pardir)
        candidates.append(os.path.join(pipeline, "scheduler", SCHEDULER))
    found = next((c for c in candidates if os.path.lexists(c)), None)  # a broken link: an error
    index = os.path.join(pipeline or path, "model_index.json")
    if found is None and os.path.lexists(index) and "scheduler" in read_json(index, "model_index.json"):
        raise ValueError(f"the pipeline's model_index.json names a scheduler and scheduler/{SCHEDULER} is "
                         "missing: a pipeline is its network and its noise schedule; restore it")
    return model_dir, found


def read_json(path, name=None):
    """The JSON object in the regular file `path` (at most MAX_JSON_BYTES); ValueError naming it `name`."""
    name = name or path
    try:
        with files.open_regular(path) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read {name} ({e.strerror or e})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{name} is larger than {MAX_JSON_BYTES // 2**20} MiB: not a config file")
    try:
        out = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, an integer of 4300+ digits, nested deep
        raise ValueError(f"cannot read {name} ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{name} is not a JSON object")
    return out


def shard_names(index, name):
    """The shard files an index names: each a plain file name in the folder, ending in .safetensors."""
    weight_map = index.get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise ValueError(f"{name}: weight_map={shown(weight_map)}: must map tensor names to shard file names")
    for shard in sorted(set(weight_map.values())):
        if (not shard.endswith(".safetensors") or shard.startswith(".") or len(shard) > 255
                or any(c in shard for c in "/\\\0")):
            raise ValueError(f"{name}: weight_map names the shard {shown(shard)}: a shard must be a "
                             ".safetensors file in the folder itself (a plain name, no path)")
    return sorted(set(weight_map.values()))


def confines(model_dir):
    """The folders a weights file may really lie in: the model folder, and, for a snapshot in Hugging Face's
    cache (.../models--org--name/snapshots/REV/...), that repository's blobs/, where the cache's links
    lead."""
    real = os.path.realpath(model_dir)
    parts = real.split(os.sep)
    roots = [real]
    if "snapshots" in parts[:-1]:
        at = len(parts) - 1 - parts[::-1].index("snapshots")
        roots.append(os.sep.join(parts[:at] + ["blobs"]))
    return roots


def weights_file(model_dir, file, name):
    """The real path of model_dir/file, a regular file that no link leads out of the folder; else
    ValueError."""
    real = os.path.realpath(os.path.join(model_dir, file))
    if not any(os.path.commonpath([real, root]) == root for root in confines(model_dir)):
        raise ValueError(f"{name} is a link that leads out of the model folder; copy the file in instead")
    try:
        regular = stat.S_ISREG(os.lstat(real).st_mode)  # the real path has no links left in it
    except OSError as e:
        raise ValueError(f"cannot read {name} ({e.strerror or e})") from None
    if not regular:
        raise ValueError(f"{name} is not a regular file")
    return real


def read_weights(model_dir, path):
    """UNet2DModel-named tensors from the safetensors file (or its shards), else the older .bin; floating
    point only. `path` is the folder given, which error lines name files against."""
    from safetensors.torch import load_file

    named = lambda file: os.path.relpath(os.path.join(model_dir, file), path)  # noqa: E731
    if os.path.lexists(os.path.join(model_dir, WEIGHTS)):
        names = [WEIGHTS]
    elif os.path.lexists(os.path.join(model_dir, INDEX)):
        names = shard_names(read_json(os.path.join(model_dir, INDEX), named(INDEX)), named(INDEX))
    elif os.path.lexists(os.path.join(model_dir, OLD_WEIGHTS)):
        names = [OLD_WEIGHTS]
    else:
        where = "" if named(".") == "." else f" in {named('.')}"
        raise ValueError(f"no {WEIGHTS}, {INDEX} or {OLD_WEIGHTS}{where}")
    state, origin = {}, {}
    for file in names:
        real = weights_file(model_dir, file, named(file))
        try:
            if file.endswith(".bin"):  # a pickle: tensors only, as for our own checkpoints
                tensors = torch.load(real, map_location="cpu", weights_only=True)
            else:
                tensors = load_file(real, device="cpu")
        except Exception as e:  # truncated, corrupt, or not a weights file
            raise ValueError(f"cannot read {named(file)} ({type(e).__name__}: {first_line(e)})") from None
        if not isinstance(tensors, dict):
            raise ValueError(f"{named(file)} holds a {type(tensors).__name__}, not named tensors")
        for key, t in tensors.items():
            if (not isinstance(key, str) or not isinstance(t, torch.Tensor) or t.layout != torch.strided
                    or t.device.type != "cpu"):  # a pickle may hold sparse tensors, and meta ones (no data)
                raise ValueError(f"{named(file)}: {shown(key)} is not a named dense tensor")
            if t.dtype not in FLOATS:
                raise ValueError(f"{named(file)}: tensor {shown(key)} is {t.dtype}; weights must be "
                                 "float16, bfloat16, float32 or float64")
            if key in state:
                raise ValueError(f"{named(file)}: tensor {shown(key)} is in {origin[key]} too")
            state[key], origin[key] = t, file
    return state


def schedule_fields(sched, name):
    """scheduler_config.json -> our ModelConfig's diffusion fields; ValueError naming a field we cannot
    express. Sampling options (timestep spacing, clipping, thresholding) are not part of the model and are
    not read."""
    s = checked(sched, SCHEDULER, name)

    def need(ok, field, why):
        if not ok:
            raise ValueError(f"{name}: {field}={shown(s.get(field))} cannot be expressed ({why})")

    need(s["trained_betas"] is None, "trained_betas", "explicit betas; the schedules are linear and cosine")
    need(s["beta_schedule"] in SCHEDULES, "beta_schedule", f"one of {', '.join(SCHEDULES)}")
    need(s["prediction_type"] in PREDICTIONS, "prediction_type", f"one of {', '.join(PREDICTIONS)}")
    need(s["variance_type"] in VARIANCES, "variance_type", "a fixed variance: no learned variance")
    need(not s["rescale_betas_zero_snr"], "rescale_betas_zero_snr", "no zero-terminal-SNR rescaling")
    return dict(timesteps=s["num_train_timesteps"], schedule=SCHEDULES[s["beta_schedule"]],
                beta_start=s["beta_start"], beta_end=s["beta_end"],
                prediction=PREDICTIONS[s["prediction_type"]], reverse_variance=VARIANCES[s["variance_type"]])


def scheduler_config(mc):
    """Our schedule as DDPMScheduler's scheduler_config.json (diffusers computes the same β_t in float32)."""
    name = {ours: theirs for theirs, ours in SCHEDULES.items()}[mc.schedule]
    return {"_class_name": "DDPMScheduler", "num_train_timesteps": mc.timesteps, "beta_start": mc.beta_start,
            "beta_end": mc.beta_end, "beta_schedule": name, "trained_betas": None,
            "variance_type": {"large": "fixed_large", "small": "fixed_small"}[mc.reverse_variance],
            "prediction_type": {ours: theirs for theirs, ours in PREDICTIONS.items()}[mc.prediction],
            "clip_sample": True, "clip_sample_range": 1.0}


def skeleton(network, fields):
    """The UNet `fields` describe, on the meta device: its layout and size without its memory."""
    with torch.device("meta"):
        return network.UNet(types.SimpleNamespace(**fields))


def model_config(network, model_dir, path):
    """config.json of the model folder, diffusers' defaults filled in and every field checked."""
    name = os.path.relpath(os.path.join(model_dir, "config.json"), path)
    return checked(read_json(os.path.join(model_dir, "config.json"), name), "config.json", name,
                   network.DIFFUSERS_DEFAULTS)


def read(path, network):
    """-> (ModelConfig fields, UNet2DModel-named tensors, notes on what was assumed). `network` is the
    network's side of the format (the unet module: its UNet, names and config fields)."""
    model_dir, sched_path = locate(path)
    config = model_config(network, model_dir, path)
    fields = network.model_fields_from_diffusers(config)
    shape = skeleton(network, fields)
    network.check_diffusers_config(shape, config)
    notes = []
    if sched_path:
        sched_name = os.path.relpath(sched_path, path)
        fields.update(schedule_fields(read_json(sched_path, sched_name), sched_name))
    else:
        notes.append(f"{path} has no {SCHEDULER}: assuming Ho et al.'s schedule "
                     "(linear β 1e-4..0.02, T = 1000, ε-prediction, σ² = β)")
    state = read_weights(model_dir, path)
    # every tensor the network needs, shaped as it needs it, before the network is built: sizes inside their
    # bounds could still ask for terabytes together, and now ask for no more than the weights hold
    network.diffusers_parts(shape, state)
    return fields, state, notes


def check(model, path, network):
    """ValueError where the model built from read(path)'s fields computes another function than the
    folder's."""
    model_dir, _ = locate(path)
    network.check_diffusers_config(model, model_config(network, model_dir, path))


def write(path, model, mc, network):
    """config.json, diffusion_pytorch_model.safetensors and scheduler_config.json in a new or empty folder,
    loadable by UNet2DModel.from_pretrained and DDPMScheduler.from_pretrained. Each file is created fresh and
    renamed into place (a link planted there is replaced, not followed), config.json last: a folder an error
    cut short has none, and is no model folder. An OS error is one UserError line (files.created)."""
    from safetensors import SafetensorError
    from safetensors.torch import save

    # refuses a model diffusers cannot express, before anything is written
    config = network.diffusers_config(model)
    try:
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise ValueError(f"{path} exists and is not an empty folder; choose a new one")
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror or e})") from None
    try:
        weights = save(network.diffusers_state_dict(model), metadata={"format": "pt"})
    except SafetensorError as e:
        raise ValueError(f"cannot write {os.path.join(path, WEIGHTS)} ({first_line(e)})") from None
    kept = f"the export is incomplete: remove {path} and export again"
    with files.created(os.path.join(path, WEIGHTS), kept=kept) as f:
        f.write(weights)
    for name, content in ((SCHEDULER, scheduler_config(mc)), ("config.json", config)):
        with files.created(os.path.join(path, name), "w", kept=kept) as f:
            json.dump(content, f, indent=2)


def export(path, model, mc, network):
    """sample.py --export_diffusers: write(), its refusals as one UserError line. -> the folder."""
    try:
        write(path, model, mc, network)
    except ValueError as e:
        raise UserError(f"--export_diffusers: {e}") from None
    print(f"wrote {path}: UNet2DModel.from_pretrained and DDPMScheduler.from_pretrained load it")
    return path
