"""The docs pages quote only measurements that docs/results holds.

docs/*.md describe behaviour and API; a measured figure lives in docs/results (a table with the
command that made it, or the JSON/CSV a benchmark wrote), so a page cannot drift from what was
measured, and a figure from a run nobody recorded has nowhere to hide. README.md has its own
check (tests/test_readme_results.py); CHANGELOG.md and docs/results/** are not guides.

The rule, for every page docs/*.md (a page added later included; one without figures passes):

* Where: the page's prose (a paragraph whole, so a figure may break across lines), its table
  body rows, and fenced blocks without a language or marked ``text`` (printed output). Not code
  spans, link targets, HTML comments, table header rows (column names and units), or fenced
  blocks in a programming or shell language: there numbers are arguments and constants.
* What is a figure: a number followed by a unit of measurement -- time (s, ms, us, µs, ns,
  min, minutes, seconds, hours), throughput (GB/s, MB/s, Gbit/s, Mbit/s, ...; ns/byte and
  ns per element too), a ratio written onto its number (``2.8x``, ``52x``, ``1.15×``), a
  percentage, accuracy ``points``, decimal megabytes (``929 MB``: the project writes the sizes
  it configures in binary units, ``64 MiB``); a number beside ``±`` (a mean and its spread);
  and every decimal number of a table cell that starts with a number (``| 0.602 |``,
  ``| 97.80 ± 0.56 (+0.13) |``: the unit is in the column's header; a cell of words such as
  ``AdamW (0.9, 0.95)`` is a setting). Each number of a range or list sharing one unit
  (``0.847-0.848 s``, ``0.452 against 0.422 s``, ``0.158 / 0.091 / 0.036 s``, ``12.99, 3.60
  and 4.11 s``) is a figure.
* Numbers are compared written plainly: no sign, no thousands separators, no trailing zeros
  (``+1.40%`` is ``1.4``), and whole (``0.12`` does not match inside ``0.123``); no rounding.
* What passes: the figure, with its unit, is a figure of a markdown file under docs/results
  (``0.123 s`` there for ``0.123 s`` here); or its number is a number of a results file that
  the figure's section (heading to heading) links to or names as ``results/...`` (a folder
  names every file under it; *.md, *.json, *.jsonl, *.csv). Looking a bare number up in every
  results file would not do: their 7,000 distinct numbers hold most short decimals (``0.123``
  among them), so a made-up figure would pass.
* Not figures (``NOT_MEASUREMENTS``, each with why): settings and definitions written with a
  unit -- link rates and delays given to the emulator, the share of entries a sparse format
  sends (``top-k 1%``), loss rates, timeouts, defaults and polling intervals, bounds a test
  checks, a format's compression ratio, and a ratio the sentence computes (``a / b = 2.84x``).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in ("README.md", "CHANGELOG.md"))

_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
# A unit of measurement written after a number (a space allowed before a word unit), and the
# name it is compared by.
_UNITS = {"GB/s": "GB/s", "MB/s": "MB/s", "KB/s": "KB/s", "GiB/s": "GiB/s", "MiB/s": "MiB/s", "Gbit/s": "Gbit/s",
          "Mbit/s": "Mbit/s", "kbit/s": "kbit/s", "Gb/s": "Gbit/s", "ns/byte": "ns/byte", "s": "s", "seconds": "s",
          "ms": "ms", "us": "us", "µs": "us", "ns": "ns", "min": "min", "minutes": "min", "hours": "h", "MB": "MB",
          "GB": "GB", "KB": "KB", "points": "points", "pp": "points", "x": "x", "×": "x", "%": "%"}
_UNIT = (r"(?:\s?(GB/s|MB/s|KB/s|GiB/s|MiB/s|Gbit/s|Mbit/s|kbit/s|Gb/s|ns/byte)"
         r"|\s?(ns)\s+per\s+\w+"
         r"|\s?(s|ms|us|µs|ns|min|minutes|seconds|hours|MB|GB|KB|points|pp)(?!\w)"
         r"|([x×])(?![\w.])|(%))")
# Between the numbers of a range or list that share the unit after the last one.
_SEP = r"(?:\s*(?:-|–|/|,)\s*|\s+(?:and|against|to|or)\s+)"
_WITH_UNIT = re.compile(rf"(?<![\w.$])(?:[+\-−]\s?)?((?:{_NUMBER}{_SEP}[+\-−]?)*{_NUMBER}){_UNIT}")
_PLUS_MINUS = re.compile(rf"({_NUMBER})\s*±\s*({_NUMBER})")
_DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
_CELL = re.compile(r"\|([^|]*)(?=\|)")
_FIGURE_CELL = re.compile(r"[\s*_~]*[+\-−±(]?\d")
_ANY_NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}(?!\d)")

# Settings and definitions written with a unit: not measurements, so not looked up. Each entry
# is a pattern over a line of the page (its match is blanked before figures are found) and why.
NOT_MEASUREMENTS: list[tuple[str, str]] = [
    (r"\b(?:1|10|25|100|400)\s?(?:Gbit/s|Mbit/s|Gb/s)", "a link rate given to the emulator, or a NIC's"),
    (r"\b\d+(?:\.\d+)?\s?ms(?=\s+(?:one way|delay|RTT|per link|each way))", "a delay given to the emulator"),
    (r"(?i:top-k|random-k|TopK|RandomK)\s+\d+(?:\.\d+)?%", "the share of entries a sparse format sends"),
    (r"\b\d+(?:\.\d+)?%\s+(?:loss|path loss|per link|drop)", "a loss rate given to the emulator"),
    (r"\btimeout,?\s+(?:of\s+)?\d+(?:\.\d+)?\s?(?:s|ms|min)\b(?:\s*\(\d+(?:\.\d+)?\s?s for the straggler\))?"
     r"|\b\d+(?:\.\d+)?\s?(?:s|ms|min)\s+(?:group\s+|process-group\s+)?timeout",
     "a timeout a test or a run sets"),
    (r"(?:default,?\s+|stops waiting after\s+|bounded \(|every\s+|reported within\s+)\d+(?:\.\d+)?\s?(?:s|ms|us|min)\b",
     "a default, a polling interval, or a bound the code sets or a test requires"),
    (r"\b\d+(?:\.\d+)?\s?MB(?=\s+(?:float32|all-reduces?|buckets?|DDP buckets?)\b)|(?<=all-reduce of )\d+(?:\.\d+)?\s?MB",
     "the size of the operation a run or a test was given"),
    (r"\b\d+\s?MB(?= in a default\b)", "another program's default"),
    (r"(?<== )\d+(?:\.\d+)?x\b", "a ratio the sentence computes from the figures before it (a / b = Nx)"),
    (r"\bchecks?\s+that\b(?:[^.;]|\.(?=\d))*\d+(?:\.\d+)?\s?(?:points|%)", "a bound a test checks (to the clause's last figure)"),
    (r"\b\d+(?:\.\d+)?x(?:\s*/\s*\d+(?:\.\d+)?x)*(?=\s+(?:fewer|less|smaller)\b)|(?<=iB \()\d+x"
     r"|\b\d+(?:\.\d+)?\s+bytes per\b",
     "a compression ratio or a payload's size: the bytes a format sends, fixed by its definition"),
]
_NOT_MEASUREMENTS = [re.compile(pattern) for pattern, _ in NOT_MEASUREMENTS]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_TABLE_RULE = re.compile(r"^\|?\s*:?-{3,}")
_RESULTS_PATH = re.compile(r"(?<![\w.])(?:docs/)?results/[\w./-]*[\w/]")
_NUMBER_IN_FILE = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def plain(number: str) -> str:
    """``+1,234.50`` -> ``1234.5``: the number as the lookup compares it."""
    text = number.replace(",", "").lstrip("+-−")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    whole, dot, fraction = text.partition(".")
    return (whole.lstrip("0") or "0") + dot + fraction


def scanned_text(text: str) -> list[tuple[int, str, bool, str]]:
    """(first line, text, is a table row, its section) of what a page says: each prose
    paragraph whole (a figure may break across lines), each table body row, each line of an
    output block; without code spans, link targets and HTML comments. A section runs from a
    heading to the next."""
    text = _COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)
    lines, fence, keep = text.splitlines(), None, True
    parts: list[tuple[int, str, str, int]] = []  # (line number, text, "prose" | "row" | "output", section)
    sections: list[list[str]] = [[]]
    new_paragraph = True
    for i, line in enumerate(lines):
        stripped = line.strip()
        if fence is not None:
            sections[-1].append(line)
            if stripped.startswith(fence) and not stripped.strip(fence[0]):
                fence, new_paragraph = None, True
            elif keep:
                parts.append((i + 1, line, "output", len(sections) - 1))
            continue
        if stripped.startswith("#"):
            sections.append([])
        sections[-1].append(line)
        opening = _FENCE.match(line)
        if not stripped or stripped.startswith("#") or opening:
            if opening:
                fence, keep = opening.group(1), opening.group(2).lower() in ("", "text")
            new_paragraph = True
            continue
        if stripped.startswith("|"):
            new_paragraph = True
            if not (_TABLE_RULE.match(stripped) or (i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1].strip()))):
                parts.append((i + 1, line, "row", len(sections) - 1))  # not a header row or a rule
            continue
        if re.match(r"([-*+]|\d+\.)\s", stripped):
            new_paragraph = True  # a list item
        if not new_paragraph and parts and parts[-1][2] == "prose":
            parts[-1] = (parts[-1][0], parts[-1][1] + "\n" + line, "prose", parts[-1][3])
        else:
            parts.append((i + 1, line, "prose", len(sections) - 1))
        new_paragraph = False
    joined = ["\n".join(section) for section in sections]
    return [(number, _LINK_TARGET.sub("]()", _CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), part)),
             kind == "row", joined[k]) for number, part, kind, k in parts]


def figures(text: str) -> list[tuple[int, str, str, str | None, str]]:
    """(line, the figure as written, its plain number, its unit or None, its section) for
    each measured figure of a page's text."""
    found = []
    for first, part, row, section in scanned_text(text):
        for pattern in _NOT_MEASUREMENTS:
            part = pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), part)

        def add(match: re.Match[str], number: str, unit: str | None) -> None:
            line = first + part.count("\n", 0, match.start())
            found.append((line, " ".join(match.group().split()), plain(number), unit, section))

        spans = []
        for match in _WITH_UNIT.finditer(part):
            spans.append(match.span())
            unit = _UNITS[next(u for u in match.groups()[1:] if u)]
            for number in _ANY_NUMBER.findall(match.group(1)):
                add(match, number, unit)
        for match in _PLUS_MINUS.finditer(part):
            spans.append(match.span())
            for number in match.groups():
                add(match, number, None)
        if row:  # a cell that starts with a number is a figure: all its decimals count
            for cell in _CELL.finditer(part):
                if _FIGURE_CELL.match(cell.group(1)):
                    for match in _DECIMAL.finditer(part, cell.start(1), cell.end(1)):
                        if not any(a <= match.start() < b for a, b in spans):
                            add(match, match.group(), None)
    return found


@cache
def numbers_of(path: Path) -> frozenset[str]:
    """The plain numbers of a results file, or of every file under a results folder."""
    files = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
    return frozenset(plain(m.group()) for f in files if f.suffix in (".md", ".json", ".jsonl", ".csv")
                     for m in _NUMBER_IN_FILE.finditer(f.read_text(encoding="utf-8")))


@cache
def figures_in_results() -> frozenset[tuple[str, str]]:
    """(plain number, unit) of every figure with a unit in the markdown files under docs/results."""
    return frozenset((number, unit) for path in sorted(RESULTS.rglob("*.md"))
                     for _, _, number, unit, _ in figures(path.read_text(encoding="utf-8")) if unit)


@cache
def named_numbers(section: str) -> frozenset[str]:
    """The numbers of the files and folders under docs/results a section links to or names."""
    found: set[str] = set()
    for written in _RESULTS_PATH.findall(section):
        path = (ROOT / written) if written.startswith("docs/") else (DOCS / written)
        if path.exists() and path.resolve().is_relative_to(RESULTS):
            found |= numbers_of(path)
    return frozenset(found)


def missing_figures(page_text: str) -> list[str]:
    everywhere = figures_in_results()
    return [f"line {line}: {written!r}" for line, written, number, unit, section in figures(page_text)
            if (number, unit) not in everywhere and number not in named_numbers(section)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_figure_on_a_page_is_in_docs_results(page: Path) -> None:
    missing = missing_figures(page.read_text(encoding="utf-8"))
    assert not missing, (f"docs/{page.name} quotes figures that no file under docs/results holds "
                         f"(move the measurement there with the command that made it, or describe "
                         f"the behaviour and link the table): {missing}")


def test_the_check_sees_a_made_up_figure() -> None:
    # Planted measurements in prose, a table and printed output; the settings beside them pass,
    # and so does the figure of a linked table.
    page = ("The call took 0.123 s on 4 ranks at 1 Gbit/s with 5 ms delay (`--timeout 30.5`), top-k 1%;\n"
            "gloo fp32 took 1.264 s ([table](results/README.md)).\n"
            "| method | time (s) |\n| --- | --- |\n| 1-bit | 0.4567 |\n\n```\nencode 9.8765 GB/s\n```\n\n"
            "```python\nx = 0.314159\n```\n")
    assert missing_figures(page) == ["line 1: '0.123 s'", "line 5: '0.4567'", "line 8: '9.8765 GB/s'"]


def test_figures_are_read_as_written() -> None:
    seen = figures("gloo 0.847-0.848 s, 1.40x and +2.17%; 2.116 ± 0.012; 12.99, 3.60 and 4.11 s; "
                   "8 x 8 hosts; 64 MiB; 3 min 25 s; 0.38 s/step; 0.64 ns per element; 2 seeds")
    assert [(n, u) for _, _, n, u, _ in seen] == [
        ("0.847", "s"), ("0.848", "s"), ("1.4", "x"), ("2.17", "%"), ("12.99", "s"), ("3.6", "s"), ("4.11", "s"),
        ("3", "min"), ("25", "s"), ("0.38", "s"), ("0.64", "ns"), ("2.116", None), ("0.012", None)], seen


def test_pages_are_found() -> None:
    assert {"collectives.md", "diloco.md", "performance.md"} <= {p.name for p in PAGES}


def test_settings_are_not_figures_and_measurements_beside_them_are() -> None:
    page = ("At 1 Gbit/s and 5 ms delay, 1% loss, top-k 1% sends 28x less per step; the\n"
            "group timeout 20 s, checked every 100 ms; 0.602 / 0.212 = 2.84x per step. It took\n"
            "0.4321\ns at 100 Mbit/s, 17.25% of the\nline rate.\n\n| AdamW (0.9, 0.95) | 1.2345 ± 0.0123 |\n")
    assert [(line, n, u) for line, _, n, u, _ in figures(page)] == [
        (3, "0.4321", "s"), (4, "17.25", "%"), (7, "1.2345", None), (7, "0.0123", None)]


def test_a_section_names_the_results_it_quotes() -> None:
    # A bare table figure passes only where its section names a results file holding it.
    readme = (RESULTS / "README.md").read_text(encoding="utf-8")
    assert "0.337" in readme and "0.337 s" in readme
    row = "| method | s/step |\n| --- | --- |\n| 1-bit hook | 0.3371 |\n"
    assert missing_figures("## A\n\n[t](results/README.md)\n\n" + row) == ["line 7: '0.3371'"]
    row = row.replace("0.3371", "0.337")
    assert missing_figures("## A\n\n[t](results/README.md)\n\n" + row) == []
    assert missing_figures("## A\n\n[t](results/README.md)\n\n## B\n\n" + row) == ["line 9: '0.337'"]

