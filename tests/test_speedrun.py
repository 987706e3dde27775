"""The speedrun's GPU call (scripts/gpu_speedrun.sh) end to end on the CPU in its dry run, and the scoring
script's reading of what it brings back (scripts/speedrun_fid.py; FID itself is tested in test_fid.py)."""
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import speedrun_fid  # noqa: E402


def test_gpu_speedrun_dry_run_brings_back_at_most_8_files_with_every_result(tmp_path):
    """--dry-run: the speedrun against its clock (tiny, on the shapes), the samples of its final EMA and of
    each minute's, eager against graphed, the ladder; what comes back fits the device tool's limits (8 files
    of 16 MiB) and the scoring script finds every sample set in it."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", "scripts/gpu_speedrun.sh", "--dry-run", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
                          timeout=3600)  # a hang guard
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    names = sorted(os.listdir(out))
    assert names == ["final_a.npz", "final_b.npz", "graphs.npz", "minutes.npz", "results.tar.gz"], names
    assert all(os.path.getsize(out / n) <= 16 * 2**20 for n in names)
    with tarfile.open(out / "results.tar.gz") as tar:
        status = tar.extractfile("./status.txt").read().decode().split("\n")
        rows = [json.loads(line) for line in tar.extractfile("./speedrun/metrics.jsonl")]
        assert "./ladder.json" in tar.getnames() and "./env.txt" in tar.getnames()
    assert all(line.endswith(" 0") for line in status if line), status
    assert [r["minute"] for r in rows if "minute" in r] == [1] and any("budget_s" in r for r in rows)
    with np.load(out / "graphs.npz") as g:  # the same noise: on the CPU both are eager, so equal
        assert g["eager"].shape == (8, 16, 16, 3) and np.array_equal(g["eager"], g["graphed"])
    rows, sets = speedrun_fid.unpack(str(out), str(tmp_path / "unpacked"))
    assert sorted(sets) == ["eager", "final", "graphed", "min001"]
    assert np.load(sets["final"])["arr_0"].shape == (40, 16, 16, 3)
    fake = {name: {"fid": 10.0 + i, "n": 8, "samples": name} for i, name in enumerate(sets)}
    text = speedrun_fid.table(rows, fake, None)
    assert "| min001 |" in text and "| final |" in text and "img/s" in text and "graphed: FID" in text
