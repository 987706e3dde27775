"""The layout's promises: imports point one way (no cycle), no module reaches into another's _private names,
and the files stay readable (line and function lengths)."""
import ast
import glob
import os
import re
import subprocess
import sys

from conftest import ROOT

PACKAGE = ["errors", "files", "cli", "group", "progress", "kernels", "beton", "fid", "diffusers_io", "mfu",
           "checkpoints", "phema", "runs", "shards"]  # machinery/: what the method stands on
ROOTS = ["unet", "data", "evaluate", "ddpm", "sampling", "ladder", "sample", "benchmark"]  # the root
OURS = [f"machinery.{m}" for m in PACKAGE] + ROOTS
BASE = {"machinery.errors", "machinery.files"}  # the one user error, and safe file reads and writes
ALLOWED = {  # what importing each module may load of ours, itself included (the machinery never the root's)
    "machinery.errors": set(),
    "machinery.files": BASE,
    "machinery.cli": BASE,
    "machinery.group": BASE,
    "machinery.progress": {"machinery.group"} | BASE,  # how far long work is: a bar, or lines in a log
    "machinery.kernels": set(),
    "machinery.beton": BASE,
    "machinery.fid": {"machinery.group", "machinery.progress"} | BASE,
    "machinery.diffusers_io": BASE,  # handed the network's side of the format (unet) by its caller
    "machinery.mfu": BASE,  # handed the network class whose FLOPs and memory it counts
    "machinery.checkpoints": BASE,
    "machinery.phema": {"machinery.checkpoints", "machinery.group", "machinery.progress"} | BASE,
    "machinery.runs": {"machinery.checkpoints", "machinery.group", "machinery.mfu"} | BASE,
    "machinery.shards": {"machinery.runs", "machinery.checkpoints", "machinery.group",
                         "machinery.mfu"} | BASE,
    "unet": {"machinery.kernels"},
    "data": {"machinery.beton", "machinery.group", "machinery.progress"} | BASE,
    "evaluate": {"data", "machinery.beton", "machinery.fid", "machinery.group",
                 "machinery.progress"} | BASE,  # never imports ddpm
}
METHOD = {"ddpm", "unet", "data", "evaluate"} | set(OURS[: len(PACKAGE)])  # what ddpm.py stands on
ALLOWED.update({"ddpm": METHOD, "sampling": METHOD, "ladder": METHOD, "sample": METHOD | {"sampling"},
                "benchmark": METHOD | {"sampling", "ladder"}})
COMMANDS = ("sample", "benchmark")  # nothing imports these
SOURCES = sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "machinery", "*.py"))
                 + glob.glob(os.path.join(ROOT, "scripts", "*.py")))


def path_of(module):
    return os.path.join(ROOT, *module.split(".")) + ".py"


def imported(module):
    """{(the module each import statement of `module` names, whether it stands at the top of the file)}."""
    tree = ast.parse(open(path_of(module)).read())
    top = {id(n) for n in tree.body}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(a.name, id(node) in top) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {(n if n in OURS else node.module, id(node) in top) for n in names}
    return found


def test_no_import_cycle():
    probe = f"""
import importlib, json, sys
ours = {OURS!r}
loaded = {{}}
for m in ours:
    for o in ours:
        sys.modules.pop(o, None)
    importlib.import_module(m)
    loaded[m] = sorted(o for o in ours if o in sys.modules and o != m)
print(json.dumps(loaded))
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr
    loaded = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    for m, mods in loaded.items():
        assert set(mods) <= ALLOWED[m], (m, sorted(set(mods) - ALLOWED[m]))
    for path in SOURCES:  # scripts/ included
        src = open(path).read()
        for top in COMMANDS:
            if os.path.basename(path) != f"{top}.py":
                assert not re.search(rf"^\s*(import {top}\b|from {top} import)", src, re.M), (path, top)


def test_imports_are_honest():
    """What a module imports of ours stands at its top (no import inside a function to hide an arrow from
    the table above), and is what the table allows; the package never imports a module of the root."""
    for m in OURS:
        ours = {(name, at_top) for name, at_top in imported(m)
                if name.split(".")[0] in set(ROOTS) | {"machinery"}}
        assert all(at_top for _, at_top in ours), (m, sorted(n for n, t in ours if not t))
        assert {n for n, _ in ours} - {m} <= ALLOWED[m], (m, sorted({n for n, _ in ours} - ALLOWED[m] - {m}))
        if m.startswith("machinery."):
            assert not [n for n, _ in ours if n in ROOTS], m


def test_no_module_uses_another_modules_private_names():
    ours = set(PACKAGE + ROOTS) | {"cpu_timing", "cpu_vs_ddpm_pytorch", "cpu_vs_diffusers",
                                   "gpu_vs_diffusers"}
    for path in SOURCES:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours:
                assert not node.attr.startswith("_"), f"{path}:{node.lineno}: {node.value.id}.{node.attr}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ours:
                names = [a.name for a in node.names if a.name.startswith("_")]
                assert not names, f"{path}:{node.lineno}: from {node.module} import {names}"


def test_lines_and_functions_stay_short():
    """Lines within 110 characters (comments included), tests/ too; functions within 62 lines in ddpm.py
    (train 110; the Diffusion class is a whole) and within 80 in sample.py and benchmark.py."""
    tests = sorted(glob.glob(os.path.join(ROOT, "tests", "*.py")))
    long_lines = [f"{os.path.relpath(p, ROOT)}:{i}" for p in SOURCES + tests
                  for i, line in enumerate(open(p), 1) if len(line.rstrip("\n")) > 110]
    assert not long_lines, long_lines
    limits = {"ddpm.py": 62, "sample.py": 80, "benchmark.py": 80}
    for name, limit in limits.items():
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                cap = 110 if (name, node.name) == ("ddpm.py", "train") else limit
                assert n <= cap, f"{name}: {node.name} is {n} lines (at most {cap})"


def test_one_job_per_module():
    """Each module's size, every cap at least 5% above the module's length (room to grow without squeezing):
    ddpm.py within 1,400 lines and its Diffusion class (the forward process and the loss) within 250;
    sample.py within 480; the shard store within 320; every other module within 700. Each module opens with
    a docstring whose first sentence says what it is for."""
    lines = {m.split(".")[-1]: sum(1 for _ in open(path_of(m))) for m in OURS}
    caps = {"ddpm": 1400, "sample": 480, "shards": 320}
    over = {m: n for m, n in lines.items() if n > caps.get(m, 700)}
    assert not over, over
    tree = ast.parse(open(os.path.join(ROOT, "ddpm.py")).read())
    diffusion = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Diffusion")
    assert diffusion.end_lineno - diffusion.lineno + 1 <= 250
    assert not [n.name for n in diffusion.body if isinstance(n, ast.FunctionDef) and n.name == "sample"]
    for m in OURS:
        doc = ast.get_docstring(ast.parse(open(path_of(m)).read()))
        assert doc and "." in doc.split("\n\n")[0], f"{m}.py: no sentence of purpose"


def test_one_process_group_and_samplers_named_only_in_ddpm():
    """group.py is the one place a process joins torchrun's group; a sampler's name appears in ddpm.py alone
    (everything else reads the SAMPLERS table: its defaults, its choices)."""
    joins = [os.path.relpath(p, ROOT) for p in SOURCES if "init_process_group(" in open(p).read()]
    assert joins == [os.path.join("machinery", "group.py")], joins
    names = [f'"{name}"' for name in ("ddpm", "ddim", "dpm++", "heun")]
    for m in OURS:
        if m != "ddpm":
            src = open(path_of(m)).read()
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
