"""What a writeup section is made of: the results it reads (Context), the tables and figures it owns
(Table, Figure), its registry entry (Deliverable) and what its renderer returns (Section).

A Section's prose is meant to quote the display table it embeds. `Quotes` is how a renderer picks its
numbers: a cell of the table as it is printed, or a value derived from the table's cells by a formula
that is recorded with the text it produced, so tests/test_report.py can recompute every derived number
from the table alone and find every other number of the prose among the table's cells.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd


@dataclass(eq=False)  # hashed by identity, so frame() can be cached per context
class Context:
    results: Path
    figures: Path
    out_dir: Path
    anchors: dict

    @functools.cache
    def frame(self, name: str) -> pd.DataFrame | None:
        path = self.results / f"{name}.csv"
        return pd.read_csv(path) if path.exists() else None

    def log(self, name: str) -> str:
        path = self.results / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def table(self, name: str) -> str:
        path = self.results / "tables" / f"{name}.md"
        return path.read_text() if path.exists() else f"_table {name} not built_\n"

    def figure(self, name: str, caption: str) -> str:
        path = self.figures / f"{name}.png"
        if not path.exists():
            return f"_figure {name} not built_\n"
        rel = Path(*([".."] * len(self.out_dir.resolve().relative_to(Path.cwd().resolve()).parts)), path)
        return f"![{caption}]({rel.as_posix()})\n"


@dataclass(frozen=True)
class Table:
    """results/tables/<name>.{md,tex}, built by `build` from results/<data>.csv (the `table` rule)."""
    name: str
    data: str
    build: Callable[[pd.DataFrame], pd.DataFrame]
    caption: str


@dataclass(frozen=True)
class Figure:
    """figures/<name>.png, drawn by `draw` from results/<data>.csv (the `figure` rule) and, where present,
    results/<also>.csv: the rows of all of them in one frame, with a `results_file` column naming each
    row's file (e.g. the DDP baselines of other runs beside the bucketed sweep)."""
    name: str
    data: str
    draw: Callable[[pd.DataFrame, str | Path], None]
    also: tuple[str, ...] = ()


@dataclass(frozen=True)
class Deliverable:
    section: str  # handout numbering and problem name; the writeup is ordered by the numbering
    rule: str  # the Snakemake rule that produces its data
    render: Callable[[Context], str | Section]
    data: tuple[str, ...] = ()  # results/<name>.csv files the section is computed from
    tables: tuple[Table, ...] = ()  # the tables and figures it owns (built by the report rules)
    figures: tuple[Figure, ...] = ()
    cuda_only: str | None = None  # why the data cannot be measured without a GPU, if it cannot


@dataclass(frozen=True)
class Derived:
    """A number of the prose that is not a cell: `text` is `formula(table)` formatted with `fmt`."""
    text: str
    formula: Callable[[pd.DataFrame], float]
    fmt: str
    what: str  # in words, for the reader of a failing test


@dataclass
class Section:
    """A rendered section: its Markdown blocks in order, and which of them quote `table`.

    `checked` paragraphs have every number either among the table's cells, in `derived`, or in
    `wording` (numbers that belong to the sentence: handout numbering, constants of an argument).
    Paragraphs of `parts` that are neither checked nor embeds read other data; the test lists them."""
    parts: list[str]
    table: pd.DataFrame
    checked: list[str]
    derived: list[Derived] = field(default_factory=list)
    wording: tuple[str, ...] = ()

    def markdown(self) -> str:
        return "\n\n".join(self.parts)


NUMBER = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?(?![\w])")


def cell_number(cell) -> float:
    """The first number a table cell prints (the mean of 'mean ± std'); NaN for OOM, '—' and blanks."""
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        return float(cell)
    found = NUMBER.search(str(cell))
    return float(found[0].replace(",", "").replace("−", "-")) if found else float("nan")


class Quotes:
    """Numbers for prose, taken from one display table; derived ones are recorded with their formula."""

    def __init__(self, table: pd.DataFrame):
        self.table = table
        self.derived: list[Derived] = []

    def derive(self, formula: Callable[[pd.DataFrame], float], fmt: str, what: str) -> str:
        """`formula(table)` formatted for the prose, remembered so the test can recompute it."""
        text = format(formula(self.table), fmt)
        self.derived.append(Derived(text, formula, fmt, what))
        return text


def column_values(table: pd.DataFrame, column: str,
                  rows: Callable[[pd.DataFrame], pd.Series] | None = None) -> pd.Series:
    selected = table if rows is None else table[rows(table)]
    return selected[column].map(cell_number)
