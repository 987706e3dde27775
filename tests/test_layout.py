"""The layout check: pycodestyle's continuation-line (E12x, E13x) and blank-line (E3xx) codes over every
source file, tests included, so that a move or a rename leaves no misaligned continuation or stray blank
line."""
import glob
import os

import pycodestyle
from conftest import ROOT

CODES = ["E12", "E13", "E3"]


def test_continuation_lines_and_blank_lines_follow_pycodestyle():
    """Each error is printed as file:line:column code (pytest shows it when the test fails)."""
    paths = sorted(p for folder in ("", "machinery", "scripts", "tests")
                   for p in glob.glob(os.path.join(ROOT, folder, "*.py")))
    report = pycodestyle.StyleGuide(select=CODES, max_line_length=110).check_files(paths)
    assert report.total_errors == 0


def test_the_check_sees_a_misaligned_continuation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = max(1,\n            2)\n\n\n\ny = 3\n")
    report = pycodestyle.StyleGuide(select=CODES, quiet=True).check_files([str(bad)])
    assert set(report.counters) >= {"E127", "E303"}
