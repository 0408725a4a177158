"""What a writeup section is made of: the results it reads (Context), the tables and figures it owns
(Table, Figure), its registry entry (Deliverable) and what its renderer returns (Section).

A Section's prose is meant to quote the table it embeds. `Quotes` is how a renderer picks its numbers:
a cell of the table printed by the cell's own format (`Quotes.cell`), or a value derived from the table's
cells by a formula that is recorded with the text it produced (`Quotes.derive`), so tests/test_report.py
can recompute every derived number from the table alone and find every other number of the prose among
the table's cells.

A section's table is a `NumericTable` (report/frame.py) read back from results/tables/NAME.json (`Context.numeric`),
the frame the `table` rule built and rendered to the Markdown the section embeds; its formulas see the
numbers (`formula_frame`), never the printed text.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cs336_systems.report.frame import NumericTable
from cs336_systems.results import read_table


@dataclass(eq=False)  # hashed by identity, so frame() can be cached per context
class Context:
    results: Path
    figures: Path
    out_dir: Path

    @functools.cache
    def frame(self, name: str) -> pd.DataFrame | None:
        path = self.results / f"{name}.csv"
        return read_table(path) if path.exists() else None

    def log(self, name: str) -> str:
        path = self.results / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def table(self, name: str) -> str:
        path = self.results / "tables" / f"{name}.md"
        return path.read_text() if path.exists() else f"_table {name} not built_\n"

    @functools.cache
    def numeric(self, name: str) -> NumericTable:
        """The numeric frame the `table` rule built (results/tables/NAME.json), which its Markdown prints."""
        path = self.results / "tables" / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"table {name!r} is not built: no {path} (rule `table`, or "
                                    f"`python -m cs336_systems.report table {name} ...`)")
        return NumericTable.load(path)

    def figure(self, name: str, caption: str) -> str:
        path = self.figures / f"{name}.png"
        if not path.exists():
            return f"_figure {name} not built_\n"
        rel = Path(*([".."] * len(self.out_dir.resolve().relative_to(Path.cwd().resolve()).parts)), path)
        return f"![{caption}]({rel.as_posix()})\n"


@dataclass(frozen=True)
class Table:
    """results/tables/<name>.{md,tex,json}, built by `build` from results/<data>.csv (the `table` rule)."""
    name: str
    data: str
    build: Callable[[pd.DataFrame], NumericTable]
    caption: str
    # the rows the table is built from, where fewer than the data's: its caption's provenance names only theirs
    rows: Callable[[pd.DataFrame], pd.DataFrame] | None = None


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
    """A number of the prose that is not a cell: `text` is `formula(frame)` formatted with `fmt`, where
    `frame` is the table's numbers (`formula_frame`)."""
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
    table: NumericTable
    checked: list[str]
    derived: list[Derived] = field(default_factory=list)
    wording: tuple[str, ...] = ()

    def markdown(self) -> str:
        return "\n\n".join(self.parts)


def formula_frame(table: NumericTable) -> pd.DataFrame:
    """What a Derived formula reads: the table's numbers, with cells that have a status as NaN and the
    statuses in a column '<header>: status' ('' where the cell ran)."""
    data = table.data.copy()
    for header, rows in table.status.items():
        if rows:
            column = data[header]
            column = column.astype(float) if pd.api.types.is_numeric_dtype(column) else column.astype(object)
            column.iloc[sorted(rows)] = float("nan")
            data[header] = column
            data[f"{header}: status"] = [rows.get(i, "") for i in range(len(data))]
    return data


class Quotes:
    """Numbers for prose, taken from one table; derived ones are recorded with their formula."""

    def __init__(self, table: NumericTable):
        self.table = table
        self.frame = formula_frame(table)
        self.derived: list[Derived] = []

    def derive(self, formula: Callable[[pd.DataFrame], float], fmt: str, what: str) -> str:
        """`formula(frame)` formatted for the prose, remembered so the test can recompute it."""
        text = format(formula(self.frame), fmt)
        self.derived.append(Derived(text, formula, fmt, what))
        return text

    def cell(self, header: str, row: int | None = None, **keys) -> str:
        """A cell's number as its column prints it: the row by position or by the values of its key columns,
        e.g. q.cell("step (ms)", precision="bf16", config="flat")."""
        return self.table.quote(header, row, **keys)


def column_values(table: NumericTable | pd.DataFrame, column: str,
                  rows: Callable[[pd.DataFrame], pd.Series] | None = None) -> pd.Series:
    """A column's numbers as floats (NaN where a cell has a status or no value), of the rows `rows` selects;
    `table` is a NumericTable or its formula_frame (what a Derived formula receives)."""
    frame = formula_frame(table) if isinstance(table, NumericTable) else table
    selected = frame if rows is None else frame[rows(frame)]
    return pd.to_numeric(selected[column], errors="raise").astype(float)


def shared_cell(table: NumericTable, header: str) -> str | None:
    """A column's cell for the prose where every row prints the same one (None where the rows differ), so that
    a run's setting is stated once."""
    texts = {table.cell_text(row, header) for row in range(len(table))}
    return table.quote(header, 0) if len(texts) == 1 else None


def faster_or_slower(ratio: float, digits: int = 3) -> str:
    """The word for a time ratio (ours over another's) judged as the prose prints it, to `digits` decimals: a
    printed 1.000 is neither faster nor slower."""
    shown = round(ratio, digits)
    return "slower" if shown > 1 else "faster" if shown < 1 else "the same time"
