"""README's results table quotes only what docs/results shows: every figure in a row (a ratio
such as 2.81x, a change such as +1.4%) appears in the table the row links to, so the front page
cannot drift from the measurements (docs say only what a table shows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_ROW = re.compile(r"^\|(?P<what>[^|]+)\|(?P<result>[^|]+)\|\s*\[[^\]]*\]\((?P<link>docs/results/[^)]+)\)\s*\|$",
                  re.MULTILINE)
# Ratios (2.81x) and signed changes (+1.4%, -1.13): the figures a reader compares.
_FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+x|[+-]\d+(?:\.\d+)?%?)(?![\w.])")


def rows() -> list[re.Match[str]]:
    return list(_ROW.finditer(README.read_text(encoding="utf-8")))


def test_readme_has_a_results_table() -> None:
    assert len(rows()) >= 4, "README's results table (| what | result | [table](docs/results/...) |) was not found"


@pytest.mark.parametrize("row", rows(), ids=lambda m: m["what"].strip()[:40])
def test_every_figure_in_a_results_row_is_in_its_table(row: re.Match[str]) -> None:
    table = (ROOT / row["link"]).read_text(encoding="utf-8")
    figures = _FIGURE.findall(row["result"])
    assert figures, f"a results row without a figure: {row['result'].strip()}"
    missing = [f for f in figures if f not in table]
    assert not missing, f"{row['link']} does not show {missing} (quoted by README: {row['result'].strip()})"


def test_the_check_sees_a_figure_that_is_not_there(tmp_path: Path) -> None:
    table = tmp_path / "t.md"
    table.write_text("| a | 2.81x |\n")
    row = "| x | 2.81x and 9.99x | [t](docs/results/t.md) |"
    match = _ROW.search(row)
    assert match is not None
    assert [f for f in _FIGURE.findall(match["result"]) if f not in table.read_text()] == ["9.99x"]


def test_readme_is_a_front_page() -> None:
    """README stays short: what it is, the two commands, install, one example per use, the
    results table; everything else lives in docs/."""
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 120, f"README.md has {lines} lines; move detail to docs/"
