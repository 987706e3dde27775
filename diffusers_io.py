"""Model folders in diffusers' format, read and written without diffusers (diffusers is a test oracle only).

A model folder holds config.json (UNet2DModel's config) and diffusion_pytorch_model.safetensors (or the .bin
of older exports, or safetensors shards with an index); beside it may lie scheduler_config.json. A pipeline
folder (model_index.json) holds them as unet/ and scheduler/.

    fields, state, notes = read(path)   # ModelConfig fields, UNet2DModel-named tensors, what was assumed
    write(path, model, mc)              # config.json, the safetensors weights, scheduler_config.json

The network's side of the format (tensor names, config.json's fields) is in unet.py; this file adds the files
and the noise schedule (scheduler_config.json). Errors are ValueError with one line naming the file or field.
"""
import json
import os

import torch

import unet
from errors import first_line

WEIGHTS = "diffusion_pytorch_model.safetensors"
OLD_WEIGHTS = "diffusion_pytorch_model.bin"
SCHEDULER = "scheduler_config.json"
SCHEDULER_DEFAULTS = dict(  # DDPMScheduler's own defaults (diffusers 0.42), for fields a config leaves out
    num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None,
    variance_type="fixed_small", prediction_type="epsilon", rescale_betas_zero_snr=False,
)
SCHEDULES = {"linear": "linear", "squaredcos_cap_v2": "cosine"}  # diffusers' name -> ours (the same β_t)
PREDICTIONS = {"epsilon": "eps", "sample": "x", "v_prediction": "v"}
VARIANCES = {"fixed_small": "small", "fixed_small_log": "small",
             "fixed_large": "large", "fixed_large_log": "large"}


def is_folder(path):
    return os.path.isdir(path)


def locate(path):
    """-> (the folder with the UNet's config.json, the scheduler_config.json or None)."""
    model_dir = (os.path.join(path, "unet") if os.path.exists(os.path.join(path, "unet", "config.json"))
                 else path)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{path} is neither a run's checkpoint nor a diffusers model folder "
                         "(no config.json)")
    candidates = [os.path.join(model_dir, SCHEDULER), os.path.join(path, "scheduler", SCHEDULER)]
    if os.path.basename(os.path.normpath(model_dir)) == "unet":  # the unet/ folder of a pipeline
        candidates.append(os.path.join(model_dir, os.pardir, "scheduler", SCHEDULER))
    return model_dir, next((c for c in candidates if os.path.exists(c)), None)


def read_json(path):
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({type(e).__name__}: {first_line(e)})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path} is not a JSON object")
    return out


def read_weights(model_dir):
    """UNet2DModel-named tensors from the safetensors file (or its shards), else the older .bin."""
    from safetensors.torch import load_file

    index = os.path.join(model_dir, WEIGHTS + ".index.json")
    if os.path.exists(os.path.join(model_dir, WEIGHTS)):
        files = [WEIGHTS]
    elif os.path.exists(index):
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
    elif os.path.exists(os.path.join(model_dir, OLD_WEIGHTS)):
        files = [OLD_WEIGHTS]
    else:
        raise ValueError(f"{model_dir} has no {WEIGHTS} (nor {OLD_WEIGHTS})")
    state = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            if name.endswith(".bin"):  # a pickle: tensors only, as for our own checkpoints
                state.update(torch.load(path, map_location="cpu", weights_only=True))
            else:
                state.update(load_file(path, device="cpu"))
        except Exception as e:  # truncated, corrupt, or not a weights file
            raise ValueError(f"cannot read {path} ({type(e).__name__}: {first_line(e)})") from None
    return state


def schedule_fields(sched, path):
    """scheduler_config.json -> our ModelConfig's diffusion fields; ValueError naming a field we cannot
    express. Sampling options (timestep spacing, clipping, thresholding) are not part of the model and are
    not read."""
    s = {**SCHEDULER_DEFAULTS, **sched}

    def need(ok, field, why):
        if not ok:
            raise ValueError(f"{path}: {field}={s.get(field)!r} cannot be expressed ({why})")

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


def read(path):
    """-> (ModelConfig fields, UNet2DModel-named tensors, notes on what was assumed)."""
    model_dir, sched_path = locate(path)
    config = read_json(os.path.join(model_dir, "config.json"))
    fields = unet.model_fields_from_diffusers(config)
    notes = []
    if sched_path:
        fields.update(schedule_fields(read_json(sched_path), sched_path))
    else:
        notes.append(f"{path} has no {SCHEDULER}: assuming Ho et al.'s schedule "
                     "(linear β 1e-4..0.02, T = 1000, ε-prediction, σ² = β)")
    return fields, read_weights(model_dir), notes


def check(model, path):
    """ValueError where the model built from read(path)'s fields computes another function than the
    folder's."""
    model_dir, _ = locate(path)
    unet.check_diffusers_config(model, read_json(os.path.join(model_dir, "config.json")))


def write(path, model, mc):
    """config.json, diffusion_pytorch_model.safetensors and scheduler_config.json in a new or empty folder,
    loadable by UNet2DModel.from_pretrained and DDPMScheduler.from_pretrained."""
    from safetensors.torch import save_file

    # refuses a model diffusers cannot express, before anything is written
    config = unet.diffusers_config(model)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ValueError(f"{path} exists and is not an empty folder; choose a new one")
    try:
        os.makedirs(path, exist_ok=True)
        save_file(unet.diffusers_state_dict(model), os.path.join(path, WEIGHTS), metadata={"format": "pt"})
        for name, content in (("config.json", config), (SCHEDULER, scheduler_config(mc))):
            with open(os.path.join(path, name), "w") as f:
                json.dump(content, f, indent=2)
    except OSError as e:
        raise ValueError(f"cannot write {path} ({e.strerror or e})") from None
