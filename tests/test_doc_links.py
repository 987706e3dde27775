"""Every link between our markdown files (README.md, BENCHMARKS.md, docs/) leads somewhere: the file exists
and, where the link names a heading, that heading is in it, under GitHub's rule for heading anchors. A
renamed heading (BENCHMARKS' headings carry their verdicts, which change as results come in) must take its
links with it."""
import glob
import os
import re

from conftest import ROOT

FENCE = re.compile(r"^(```|~~~)")
# [text](target)
INLINE = re.compile(r"\]\(([^)\s]+)\)")
# [name]: target
DEFINED = re.compile(r"^[ \t]*\[[^\]\[\n]+\]:[ \t]*(\S+)", re.M)
# [text][name]
USED = re.compile(r"\]\[([^\]\[\n]+)\]")
# the names defined
NAMES = re.compile(r"^[ \t]*\[([^\]\[\n]+)\]:", re.M)


def slug(heading):
    """GitHub's anchor of a heading: lower case, every character but letters, digits, '_', '-' and spaces
    dropped, spaces made '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    """The anchors of a markdown text's headings (outside code fences); a repeated one gets -1, -2, ..."""
    seen, out, fenced = {}, set(), False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def prose(text):
    """The text outside its code fences."""
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def broken(path):
    """The links of the markdown file at `path` that lead nowhere."""
    text = prose(open(path, encoding="utf-8").read())
    names = {n.lower() for n in NAMES.findall(text)}
    out = [f"{os.path.relpath(path, ROOT)}: [{n}] (never defined)" for n in USED.findall(text)
           if n.lower() not in names]
    for target in INLINE.findall(text) + DEFINED.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("<"):
            continue  # a URL
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            out.append(f"{os.path.relpath(path, ROOT)}: {target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in anchors(open(dest, encoding="utf-8").read()):
            out.append(f"{os.path.relpath(path, ROOT)}: {target} (no such heading)")
    return out


def test_every_link_between_our_documents_leads_somewhere():
    paths = [os.path.join(ROOT, p) for p in ("README.md", "BENCHMARKS.md")]
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert [b for p in paths for b in broken(p)] == []


def test_the_check_sees_a_renamed_heading(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Results (FID −65, 2 s.d.)\n\n## Same\n## Same\n\n[x]: b.md#gone\n"
        "see [here](#results-fid-65-2-sd), [there](#same-1), [that][x], [this][y]\n```\n[no](#code)\n```\n")
    (tmp_path / "b.md").write_text("# Kept\n")
    assert anchors((tmp_path / "a.md").read_text()) == {"results-fid-65-2-sd", "same", "same-1"}
    name = os.path.relpath(tmp_path / "a.md", ROOT)
    assert broken(str(tmp_path / "a.md")) == [f"{name}: [y] (never defined)",
                                              f"{name}: b.md#gone (no such heading)"]
