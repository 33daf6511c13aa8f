"""Every measured figure in the docs' prose has a source. ``python benchmarks/figures.py
[--check] [FILE ...]`` reads Markdown files (default: README.md and docs/*.md), finds their
prose figures and says how each one is backed; ``--check`` prints only the unbacked ones.
Either way it exits 1 when a figure has no source or a cited results file does not exist,
naming each as ``file:line`` with the figure and its line. :func:`check_files` and
:func:`check_text` do the same from Python (tests/test_figures.py).

**A figure** is a number with the unit of a measured quantity, written on the number or one
space after it; a range counts once ("20-23 ms", "4-16x", "16 to 512 MiB"):

- time: ns, µs (us), ms, s (after a space: "1990s" is a decade), sec, seconds, min,
  minutes, hours;
- a rate: any unit per second, ``WORD/s`` (queries/s, tokens/s, GB/s, GFLOP/s, TFLOP/s);
- a ratio: ``1.16x``, ``4-16x`` (``x`` or ``×`` on the number: "4 x 6" is a shape);
- a percentage: ``5%``;
- memory: KB, MB, GB, TB, KiB, MiB, GiB, TiB.

Only prose counts: not fenced code blocks, inline code spans, link targets, HTML tags and
comments, nor the generated sections between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` (written by ``benchmarks/render.py`` from a results file) or
``<!-- plan:NAME -->`` and ``<!-- /plan:NAME -->`` (``benchmarks/measure_rates.py``), whose
scripts' ``--check`` compares them with their results files.

**Backed** means one of three things:

1. *Cited*: the figure's block names a committed results file, a path
   ``benchmarks/results/<file>`` that exists (in prose, a code span or a link). A block is a
   paragraph, a list item, a heading or a table row; a table row is also backed by its
   table's header row and its caption, the paragraph right before or right after the table,
   and a list item by the paragraph right before its list (the one that introduces it).
   The checker does not compare values: whoever writes a figure checks it against the file.
2. *An estimate*: the block contains ``(estimate: HOW)``, or ``; estimate: HOW)`` ending a
   parenthesis, HOW saying how its figures were obtained (a one-off run and where, a commit,
   arithmetic from the shapes, ...): figures that no results file holds, said to be such.
3. *A setting*, not a measurement (a default, a limit, a time-out, a size chosen): the figure
   directly follows one of :data:`SETTING_WORDS` (default, limit, time-out, budget, cap,
   threshold, confidence, window), with at most two of the words of, to, at, is, are, was,
   be, by, the, a, an and the marks ``: = ( ,`` between: "default 8 MiB", "a time-out of 30 s",
   "capped at 16 MiB", "the threshold of 1 GiB", "a confidence of 95%", "a window of 0.1 s".
   In a table, a figure in a column whose header holds a setting word (a "limit" column) is
   one too.

Cited and estimate hold for the whole block, setting for one figure. A cited
``benchmarks/results/...`` file that does not exist is an error of its own.
"""
from __future__ import annotations

import argparse
import glob
import pathlib
import re
import sys
from dataclasses import dataclass, field

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_FILES = ("README.md", "docs/*.md")

_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
_RANGE = rf"{_NUM}(?:[ ]?(?:-|–|to)[ ]?{_NUM})?"
UNITS = {  # kind of figure -> its units (regular expressions)
    "rate": r"[A-Za-z]+/s",
    "memory": r"[kKMGT]i?B",
    "time": r"ns|µs|μs|us|ms|s|secs?|seconds?|minutes?|mins?|hours?",
    "percentage": r"%",
    "ratio": r"[x×]",
}
FIGURE = re.compile(
    rf"(?<![\w.,/-])-?(?:{_RANGE})(?P<space>[ \u00a0]?)(?:"
    + "|".join(f"(?P<{kind}>{unit})" for kind, unit in UNITS.items())
    + r")(?:/[A-Za-z]+)?(?![\w/])")  # "0.76 s/GB", "12 ms/step": a figure per something
# generated sections: render.py's and measure_rates.py's
GENERATED = re.compile(r"<!-- ((?:bench|plan):\S+) -->")
CITATION = re.compile(r"benchmarks/results/[\w./-]*\w\.\w+")
# "(estimate: HOW)", or "(...; estimate: HOW)"
ESTIMATE = re.compile(r"[(;]\s*estimate:\s*[^\s)]", re.IGNORECASE)
SETTING_WORDS = ("default", "defaults", "limit", "limits", "time-out", "time-outs", "timeout",
                 "timeouts", "budget", "budgeted", "cap", "capped", "threshold", "thresholds",
                 "confidence", "window", "windows")
_LINKS = ("of", "to", "at", "is", "are", "was", "be", "by", "the", "a", "an")
_SETTING_WORD = r"\b(" + "|".join(re.escape(w) for w in SETTING_WORDS) + r")\b"
_SETTING_BEFORE = re.compile(  # a setting word that the text before a figure ends with
    _SETTING_WORD + r"[\s:=(,]*(?:(?:" + "|".join(_LINKS) + r")[\s:=(,]+){0,2}$",
    re.IGNORECASE)
_SETTING_ANYWHERE = re.compile(_SETTING_WORD, re.IGNORECASE)


@dataclass
class Block:
    """A paragraph, list item, heading or table row, as (line number, text) lines."""

    kind: str  # "para", "item", "heading", "row"
    lines: list[tuple[int, str]] = field(default_factory=list)
    table: int = 0  # the rows of one table share it; 0: not a row

    @property
    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)


@dataclass
class Figure:
    path: str
    line: int
    text: str  # the figure as written, e.g. "36 minutes"
    context: str  # its line
    backing: str  # how it is backed ("cites benchmarks/results/...", "estimate",
    #               "setting (default)"); "" when it is not


def blocks(text: str) -> list[Block]:
    """The prose blocks of a Markdown text, in order: paragraphs, list items, headings and
    table rows; fenced code, HTML comments and generated sections left out."""
    out: list[Block] = []
    cur: Block | None = None
    fence = generated = None
    comment = False
    tables = 0

    def close():
        nonlocal cur
        if cur is not None:
            out.append(cur)
        cur = None

    for no, raw in enumerate(text.splitlines(), 1):
        s = raw.strip()
        if fence:
            if s.startswith(fence):
                fence = None
            continue
        if generated:
            if s == f"<!-- /{generated} -->":
                generated = None
            continue
        if comment:
            comment = "-->" not in s
            continue
        if s.startswith(("```", "~~~")):
            close()
            fence = s[:3]
            continue
        m = GENERATED.fullmatch(s)
        if m:
            close()
            generated = m.group(1)
            continue
        if s.startswith("<!--"):
            close()
            comment = "-->" not in s
            continue
        if not s:
            close()
            continue
        if s.startswith("|"):
            if cur is None or cur.kind != "row":
                tables += 1
            close()
            cur = Block("row", [(no, raw)], tables)
        elif s.startswith("#"):
            close()
            out.append(Block("heading", [(no, raw)]))
        elif re.match(r"(?:[-*+]|\d+[.)])\s", s):
            close()
            cur = Block("item", [(no, raw)])
        elif cur is None or cur.kind in ("row", "heading"):
            close()
            cur = Block("para", [(no, raw)])
        else:
            cur.lines.append((no, raw))
    close()
    return out


def _blank(m: re.Match) -> str:
    return re.sub(r"[^\n]", " ", m.group(0))


def prose(text: str) -> str:
    """``text`` with code spans, link targets and HTML tags blanked out (same length, same
    lines)."""
    text = re.sub(r"(`+)(.+?)\1", _blank, text)
    text = re.sub(r"\]\([^)]*\)", lambda m: "]" + _blank(m)[1:], text)
    return re.sub(r"<[^>\n]*>", _blank, text)


def figures_in(text: str) -> list[re.Match]:
    """The figures of a block's text (matches in :func:`prose` of it)."""
    return [m for m in FIGURE.finditer(prose(text))
            if not (m.group("space") and (m.group("ratio") or m.group("percentage")))
            and not (m.group("time") == "s" and not m.group("space"))]


def _backing(text: str, root: pathlib.Path) -> tuple[str, list[str]]:
    """How a text backs the figures of its block ("" if it does not), and the results files
    it cites that do not exist."""
    cited = list(dict.fromkeys(CITATION.findall(text)))
    missing = [c for c in cited if not (root / c).is_file()]
    present = [c for c in cited if c not in missing]
    how = [f"cites {', '.join(present)}"] if present else []
    if ESTIMATE.search(text):
        how.append("estimate")
    return "; ".join(how), missing


def _setting(before: str, row: str | None, header: str | None) -> str:
    """"setting (WORD)" when the figure after ``before`` (its block's prose up to it) is a
    setting: right after a setting word, or in a table column whose header has one."""
    m = _SETTING_BEFORE.search(before)
    if m:
        return f"setting ({m.group(1)})"
    if row is not None and header is not None:
        column = row.count("|")
        head = prose(header).split("|")
        if column < len(head):
            m = _SETTING_ANYWHERE.search(head[column])
            if m:
                return f"setting ({m.group(1)}, the column's header)"
    return ""


def check_text(text: str, path: str = "<text>", root: pathlib.Path = ROOT,
               ) -> tuple[list[Figure], list[str]]:
    """Every prose figure of a Markdown text with its backing, and an error line for each
    citation of a results file that does not exist (``root``: the repository root that
    ``benchmarks/results/...`` paths are relative to)."""
    bl = blocks(text)
    headers: dict[int, str] = {}  # a table's header row
    captions: dict[int, list[Block]] = {}  # the paragraphs right before and after a table
    for i, b in enumerate(bl):
        if b.kind != "row":
            continue
        if b.table not in headers:
            headers[b.table] = b.text
            captions[b.table] = [bl[i - 1]] if i and bl[i - 1].kind in ("para", "item") else []
        if i + 1 < len(bl) and bl[i + 1].kind in ("para", "item"):
            captions[b.table].append(bl[i + 1])
    intro: dict[int, Block] = {}  # a list item's list's introducing paragraph
    for i, b in enumerate(bl):
        if b.kind == "item" and i:
            before = bl[i - 1]
            if before.kind == "item":
                if i - 1 in intro:
                    intro[i] = intro[i - 1]
            elif before.kind == "para":
                intro[i] = before
    figures: list[Figure] = []
    problems: list[str] = []
    for i, b in enumerate(bl):
        backing, missing = _backing(b.text, root)
        problems += [f"{path}:{b.lines[0][0]}: cites {c}, which does not exist" for c in missing]
        if b.kind == "row" and not backing:
            backing, _ = _backing(
                "\n".join([headers[b.table]] + [c.text for c in captions[b.table]]), root)
        if b.kind == "item" and not backing and i in intro:
            backing, _ = _backing(intro[i].text, root)
        text_ = b.text
        clean = prose(text_)
        for m in figures_in(text_):
            k = text_.count("\n", 0, m.start())
            how = _setting(clean[: m.start()],
                           clean[: m.start()].split("\n")[-1] if b.kind == "row" else None,
                           headers.get(b.table)) or backing
            figures.append(Figure(path, b.lines[k][0], m.group(0).strip(),
                                  b.lines[k][1].strip(), how))
    return figures, problems


def check_files(paths, root: pathlib.Path = ROOT) -> tuple[list[Figure], list[str]]:
    """:func:`check_text` of each file, paths shown relative to ``root`` where they can be."""
    figures: list[Figure] = []
    problems: list[str] = []
    for p in paths:
        path = pathlib.Path(p)
        try:
            shown = path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            shown = str(p)
        f, pr = check_text(path.read_text(encoding="utf-8"), shown, root)
        figures += f
        problems += pr
    return figures, problems


def unbacked(figures: list[Figure]) -> list[Figure]:
    return [f for f in figures if not f.backing]


def default_files(root: pathlib.Path = ROOT) -> list[str]:
    return sorted({f for pattern in DEFAULT_FILES for f in glob.glob(str(root / pattern))})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="Markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--check", action="store_true",
                        help="print only the figures without a source (and missing files)")
    args = parser.parse_args(argv)
    figures, problems = check_files(args.files or default_files())
    for f in figures:
        if f.backing and not args.check:
            print(f"{f.path}:{f.line}: {f.text}: {f.backing}")
        elif not f.backing:
            print(f"{f.path}:{f.line}: {f.text}: no source: {f.context}")
    for p in problems:
        print(p)
    bad = unbacked(figures)
    if bad or problems:
        print(f"figures.py: {len(bad)} figure(s) without a source, {len(problems)} cited "
              "results file(s) missing. Cite benchmarks/results/<file> in the figure's "
              "paragraph, mark it \"(estimate: how it was obtained)\", or state it as a "
              "setting (the rule: benchmarks/figures.py's docstring)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
