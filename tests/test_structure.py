"""The layout's promises: imports point one way (no cycle), no module reaches into another's _private names,
and the files stay readable (line and function lengths)."""
import ast
import glob
import os
import re
import subprocess
import sys

from conftest import ROOT

OURS = ["errors", "files", "cli", "group", "kernels", "unet", "beton", "data", "fid", "evaluate",
        "diffusers_io", "mfu", "checkpoints", "phema", "runs", "ddpm", "sampling", "shards", "ladder",
        "sample", "benchmark"]
BASE = {"errors", "files"}  # the one user error, and safe file writes and reads: any module may use them
METHOD = {"ddpm", "cli", "checkpoints", "unet", "kernels", "beton", "data", "fid", "evaluate", "diffusers_io",
          "mfu", "phema", "runs", "group"} | BASE  # what ddpm.py stands on
ALLOWED = {  # what importing each module may load of ours, itself included
    "errors": {"errors"},
    "files": BASE,
    "cli": {"cli"} | BASE,
    "group": {"group"} | BASE,
    "kernels": {"kernels"},
    "unet": {"unet", "kernels"},
    "beton": {"beton"} | BASE,
    "data": {"data", "beton", "group"} | BASE,
    "fid": {"fid", "group"} | BASE,
    "evaluate": {"evaluate", "fid", "group"} | BASE,  # handed the model and the sampler; never imports ddpm
    "diffusers_io": {"diffusers_io", "unet", "kernels"} | BASE,
    "mfu": {"mfu", "unet", "kernels"} | BASE,
    "checkpoints": {"checkpoints"} | BASE,
    "phema": {"phema"} | BASE,
    "runs": {"runs", "checkpoints", "group", "mfu", "unet", "kernels"} | BASE,
    "ddpm": METHOD,
    "sampling": METHOD | {"sampling"},
    "shards": {"shards", "runs", "checkpoints", "group", "mfu", "unet", "kernels"} | BASE,
    "ladder": METHOD | {"ladder"},
    "sample": METHOD | {"sampling", "shards", "sample"},
    "benchmark": METHOD | {"sampling", "ladder", "benchmark"},
}
COMMANDS = ("sample", "benchmark")  # nothing imports these
SOURCES = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "scripts", "*.py")))


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
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr
    loaded = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    for m, mods in loaded.items():
        assert set(mods) <= ALLOWED[m], (m, sorted(set(mods) - ALLOWED[m]))
    for m in OURS:
        src = open(f"{ROOT}/{m}.py").read()  # no lazy import back up the chain either
        above = [o for o in OURS if o not in ALLOWED[m] and o != m and o not in ("data",)]
        for top in above:
            assert not re.search(rf"^\s*(import {top}\b|from {top} import)", src, re.M), (m, top)
    for path in SOURCES:  # scripts/ included
        src = open(path).read()
        for top in COMMANDS:
            if os.path.basename(path) != f"{top}.py":
                assert not re.search(rf"^\s*(import {top}\b|from {top} import)", src, re.M), (path, top)

def test_no_module_uses_another_modules_private_names():
    ours = set(OURS) | {"cpu_timing", "cpu_vs_ddpm_pytorch", "cpu_vs_diffusers", "gpu_vs_diffusers"}
    for path in SOURCES:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours:
                assert not node.attr.startswith("_"), f"{path}:{node.lineno}: {node.value.id}.{node.attr}"
            if isinstance(node, ast.ImportFrom) and node.module in ours:
                names = [a.name for a in node.names if a.name.startswith("_")]
                assert not names, f"{path}:{node.lineno}: from {node.module} import {names}"


def test_lines_and_functions_stay_short():
    """Lines within 110 characters (comments included), tests/ too; functions within 60 lines in ddpm.py
    (train 110; the Diffusion class is a whole) and within 80 in sample.py and benchmark.py."""
    tests = sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
    long_lines = [f"{os.path.relpath(p, ROOT)}:{i}" for p in SOURCES + tests
                  for i, line in enumerate(open(p), 1) if len(line.rstrip("\n")) > 110]
    assert not long_lines, long_lines
    limits = {"ddpm.py": 60, "sample.py": 80, "benchmark.py": 80}
    for name, limit in limits.items():
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                cap = 110 if (name, node.name) == ("ddpm.py", "train") else limit
                assert n <= cap, f"{name}: {node.name} is {n} lines (at most {cap})"


def test_one_job_per_module():
    """Each module's size, with room to grow: ddpm.py within 1,380 lines and its Diffusion class (the forward
    process and the loss) within 250; sample.py within 450; the shard store within 300; every other module
    within 650. Each module opens with a docstring whose first sentence says what it is for."""
    lines = {m: sum(1 for _ in open(os.path.join(ROOT, f"{m}.py"))) for m in OURS}
    caps = {"ddpm": 1380, "sample": 450, "shards": 300}
    over = {m: n for m, n in lines.items() if n > caps.get(m, 650)}
    assert not over, over
    tree = ast.parse(open(os.path.join(ROOT, "ddpm.py")).read())
    diffusion = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Diffusion")
    assert diffusion.end_lineno - diffusion.lineno + 1 <= 250
    assert not [n.name for n in diffusion.body if isinstance(n, ast.FunctionDef) and n.name == "sample"]
    for m in OURS:
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, f"{m}.py")).read()))
        assert doc and "." in doc.split("\n\n")[0], f"{m}.py: no sentence of purpose"


def test_one_process_group_and_samplers_named_only_in_ddpm():
    """group.py is the one place a process joins torchrun's group; a sampler's name appears in ddpm.py alone
    (everything else reads the SAMPLERS table: its defaults, its choices)."""
    joins = [os.path.relpath(p, ROOT) for p in SOURCES if "init_process_group(" in open(p).read()]
    assert joins == ["group.py"], joins
    names = [f'"{name}"' for name in ("ddpm", "ddim", "dpm++", "heun")]
    for m in OURS:
        if m != "ddpm":
            src = open(os.path.join(ROOT, f"{m}.py")).read()
            src = src.replace('os.environ.get("WANDB_PROJECT", "ddpm")', "")  # a project name, not a sampler
            src = src.replace('"ddpm", "matmul_peaks.json"', "")  # mfu.PEAK_CACHE's folder
            assert not [n for n in names if n in src], m


def test_one_training_step_and_no_side_channel():
    """Diffusion.loss hands its per-sample losses and timesteps back (no attributes written on the side), and
    train() and every speed measurement run the one ddpm.iteration (its LR, train_step, the EMA's warm-up)."""
    ddpm_source = open(os.path.join(ROOT, "ddpm.py")).read()
    assert "self.last_" not in ddpm_source and ".last_losses" not in ddpm_source
    for path in SOURCES:
        source = open(path).read()
        if os.path.basename(path) != "ddpm.py":  # only ddpm.iteration calls these two
            calls = re.findall(r"ddpm\.(train_step|ema_update)\(", source)
            assert not calls, f"{os.path.relpath(path, ROOT)} calls ddpm.{calls[0]}: use ddpm.iteration"
    train = next(n for n in ast.parse(ddpm_source).body
                 if isinstance(n, ast.FunctionDef) and n.name == "train")
    train = ast.get_source_segment(ddpm_source, train)
    assert "iteration(" in train and "train_step(" not in train and "ema_update(" not in train


def test_scripts_report_user_errors_through_the_one_path(capsys):
    """No command prints its own `error:` line: a bad argument to a script is a UserError, reported by
    errors.reported() as one line and exit status 2, as everywhere else."""
    from conftest import one_line_error

    for path in SOURCES:
        assert not re.search(r"SystemExit\(f?.error", open(path).read()), path
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_vs_diffusers_sampling

    err = one_line_error(capsys, gpu_vs_diffusers_sampling.main, ["--device", "cpu", "--base_channels", "48"])
    assert "multiple of 32" in err
    import inception_layout

    assert "--batch must lie in" in one_line_error(capsys, inception_layout.main, ["--batch", "0"])
