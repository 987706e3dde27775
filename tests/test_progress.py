"""Long work says how far it is where the output is a file (a batch job's log): machinery.progress's lines,
driven by a fake clock (no timing), and a real step (Inception features of a tiny extractor) that prints
them."""
import io

import torch

from machinery import fid, group
from machinery.progress import Progress


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(total, steps, clock=None, **kw):
    """Progress of `total`, updated by each of `steps` (n, seconds passing before it) -> the lines written."""
    out, clock = io.StringIO(), clock or Clock()
    with Progress("FID reference statistics", total, file=out, clock=clock, **kw) as bar:
        for n, seconds in steps:
            clock.now += seconds
            bar.update(n)
    return out.getvalue().splitlines()


def test_a_line_every_few_percent_and_a_final_line():
    lines = run(10_000, [(100, 3.0)] * 100)  # 1% every 3 s: 5% in less than a minute
    assert len(lines) == 100 // Progress.EVERY_PERCENT  # 5%, 10%, ..., 95%, then the final line
    assert [int(line.split("(")[1].split("%")[0]) for line in lines[:-1]] == list(range(5, 100, 5))
    assert lines[4] == "FID reference statistics: 2,500/10,000 images (25%), 1.2 min, ~3.8 min left"
    assert lines[-1] == "FID reference statistics: 10,000 images in 5.0 min"


def test_a_line_every_minute_when_percent_comes_slowly():
    lines = run(10_000, [(10, 30.0)] * 20)  # 0.1% each half minute: no 5% step, a line a minute
    assert len(lines) == 10 + 1
    assert lines[0] == "FID reference statistics: 20/10,000 images (0%), 1.0 min, ~499 min left"
    assert lines[-1] == "FID reference statistics: 200 images in 10 min"
    assert run(10_000, [(2500, 366.0), (7500, 1098.0)]) == [
        "FID reference statistics: 2,500/10,000 images (25%), 6.1 min, ~18 min left",
        "FID reference statistics: 10,000 images in 24 min"]


def test_an_unknown_total_and_other_units():
    lines = run(None, [(4, 20.0)] * 6, unit="snapshots")
    assert lines == ["FID reference statistics: 12 snapshots, 1.0 min",
                     "FID reference statistics: 24 snapshots, 2.0 min",
                     "FID reference statistics: 24 snapshots in 2.0 min"]


def test_nothing_on_a_terminal_for_unnamed_work_or_on_other_ranks(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for what, out in (("x", Terminal()), (None, io.StringIO())):  # tqdm's bar is a terminal's (on stderr)
        with Progress(what, 10, file=out, clock=Clock()) as bar:  # None: off (fid.features without desc)
            bar.update(10)
        assert out.getvalue() == ""
    monkeypatch.setattr(group, "rank_world", lambda: (1, 2))  # under torchrun, rank 1 of 2
    assert run(10, [(1, 1.0)] * 10) == []


def test_a_failed_step_has_no_final_line():
    out, clock = io.StringIO(), Clock()
    try:
        with Progress("decoding", 10, file=out, clock=clock) as bar:
            bar.update(5)
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert out.getvalue().splitlines() == ["decoding: 5/10 images (50%), 0 s, ~0 s left"]


def test_inception_features_report_progress_in_a_log(capsys):
    """A real step with stdout a file (capsys): fid.features over a tiny extractor prints its lines."""
    def extractor(x):  # uint8 (B, 3, H, W) -> (features, logits)
        f = x.float().mean((2, 3))
        return f, f

    images = torch.randint(0, 256, (40, 3, 8, 8), dtype=torch.uint8)
    feats, _ = fid.features(extractor, images.split(10), "cpu", desc="FID reference statistics", total=40)
    assert feats.shape == (40, 3)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FID reference statistics: 10/40 images (25%), ")
    assert out[-1].startswith("FID reference statistics: 40 images in ")
