"""The front door stays a guide and its numbers have one home: README.md is at most 250 lines, and every figure in
its results table stands in docs/results.md's headline table, in the row of the same preset and machine, with the
same value (a number is written once and copied, so the two cannot drift apart unnoticed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?x?")


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table after `heading`, as lists of stripped cells."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[2:]  # after the header and its rule


def test_the_readme_is_a_guide_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; measured tables belong in docs/results.md"


def test_every_figure_of_the_readme_results_table_stands_in_docs_results_with_the_same_value():
    readme = table_rows((ROOT / "README.md").read_text(), "## Results")
    results = {(r[0], r[1]): r for r in table_rows((ROOT / "docs/results.md").read_text(), "## Headline")}
    assert readme, "README.md has no results table"
    wrong = []
    for row in readme:
        preset, machine = row[0], row[1]
        match = results.get((preset, machine))
        if match is None:
            wrong.append(f"no row for {preset!r} on {machine!r} in docs/results.md")
            continue
        for figure in (n for cell in row[2:] for n in NUMBER.findall(cell)):
            if not any(figure in NUMBER.findall(cell) for cell in match[2:]):
                wrong.append(f"{preset} on {machine}: {figure} is not in docs/results.md's row {match[2:]}")
    assert not wrong, wrong
