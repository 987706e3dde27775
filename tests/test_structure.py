"""Each module points one way: importing any one of them loads only the modules below it, never a cycle."""
import subprocess
import sys

from conftest import ROOT

OURS = ["unet", "data", "evaluate", "diffusers_io", "ddpm", "sample", "benchmark"]
ALLOWED = {  # what importing each module may load of ours, itself included
    "unet": {"unet"},
    "data": {"data"},
    "evaluate": {"evaluate"},  # handed the model and the Diffusion; never imports ddpm or sample
    "diffusers_io": {"diffusers_io", "unet", "data"},
    "ddpm": {"ddpm", "unet", "data", "evaluate", "diffusers_io"},
    "sample": {"sample", "ddpm", "unet", "data", "evaluate", "diffusers_io"},
    "benchmark": {"benchmark", "ddpm", "unet", "data", "evaluate", "diffusers_io"},
}


def test_no_import_cycle():
    probe = f"""
import importlib, json, sys
ours = {OURS!r}
loaded = {{}}
for m in ours:
    for o in ours:
        sys.modules.pop(o, None)
    importlib.import_module(m)
    loaded[m] = sorted(o for o in ours if o in sys.modules)
print(json.dumps(loaded))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    for m, mods in loaded.items():
        assert set(mods) <= ALLOWED[m], (m, sorted(set(mods) - ALLOWED[m]))
    for path in ("ddpm.py", "evaluate.py", "data.py", "unet.py"):  # no lazy import back up the chain either
        src = open(f"{ROOT}/{path}").read()
        assert "import sample" not in src, path
    assert "import ddpm" not in open(f"{ROOT}/evaluate.py").read()
