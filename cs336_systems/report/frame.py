"""Numeric tables: the numbers of a results table stay numbers until the page.

A `NumericTable` holds the cells as numbers (NaN where a value is missing), a status per cell where a
measurement did not run (OOM, …), and one display format per column (`Col`). One formatter (`cell_text`)
turns a cell into text; the Markdown, the LaTeX and the numbers the prose quotes (`quote`) are all made by
it, so a number in a sentence is printed by the same code as its cell. The `table` rule writes the frame
beside its Markdown (results/tables/NAME.json) and the writeup reads it back, so each table is built once.

Display conventions: a missing value prints '—', a cell with a status prints the status upper-cased
('OOM'); a column may join two data columns into one cell ('mean ± std', a 'low–high' range).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

MISSING = "—"


@dataclass(frozen=True)
class Col:
    """One display column: `header` names it and the data column of its value.

    `fmt` is a Python format spec for the value ('.2f', ',.0f', '.1%', 'd', '.3g'); '' prints text as it
    is. `second` names a data column printed after `joiner` in the same cell (the std of 'mean ± std',
    the upper end of a 'low–high' range), with the same format. `suffix` follows the number ('×')."""
    header: str
    fmt: str = ""
    second: str | None = None
    joiner: str = " ± "
    suffix: str = ""

    @property
    def numeric(self) -> bool:
        return self.fmt != ""


def is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def format_value(value, fmt: str) -> str:
    """One number (or text, for fmt '') as the table prints it; '—' where it is missing."""
    if is_missing(value):
        return MISSING
    if fmt == "":
        return str(value)
    if fmt.endswith("d"):  # integers may arrive as floats (a column with NaN in it)
        value = int(round(float(value)))
    return format(value, fmt)


@dataclass
class NumericTable:
    """Cells as numbers plus one format per column; see the module docstring.

    `data` has one column per `Col.header` (and the `second` columns), rows in display order (a RangeIndex);
    `status` maps a header to {row position: status} for cells that hold no measurement ('oom')."""
    data: pd.DataFrame
    columns: tuple[Col, ...]
    status: dict[str, dict[int, str]] = field(default_factory=dict)

    def __post_init__(self):
        self.data = self.data.reset_index(drop=True)
        self.columns = tuple(self.columns)
        wanted = [c.header for c in self.columns] + [c.second for c in self.columns if c.second]
        absent = [name for name in wanted if name not in self.data]
        if absent:
            raise ValueError(f"NumericTable: columns {absent} are not in the data (it has {list(self.data.columns)})")
        unknown = [h for h in self.status if h not in self.headers]
        if unknown:
            raise ValueError(f"NumericTable: status for unknown columns {unknown}")

    # --- looking up --------------------------------------------------------------------------------------------
    @property
    def headers(self) -> list[str]:
        return [c.header for c in self.columns]

    def col(self, header: str) -> Col:
        for column in self.columns:
            if column.header == header:
                return column
        raise KeyError(f"no column {header!r} in this table (columns: {self.headers})")

    def __len__(self) -> int:
        return len(self.data)

    def row(self, **keys) -> int:
        """The position of the one row whose columns equal `keys` (e.g. precision='bf16', config='flat')."""
        mask = pd.Series(True, index=self.data.index)
        for name, value in keys.items():
            mask &= self.data[name] == value
        found = list(self.data.index[mask])
        if len(found) != 1:
            raise KeyError(f"{len(found)} rows match {keys} (one expected)")
        return int(found[0])

    def value(self, header: str, row: int | None = None, **keys) -> float:
        """A cell's number (NaN where it has a status or no value)."""
        row = self.row(**keys) if row is None else row
        if self.status.get(header, {}).get(row):
            return float("nan")
        value = self.data.at[row, header]
        return float("nan") if is_missing(value) else value

    def has(self, **keys) -> bool:
        try:
            self.row(**keys)
        except KeyError:
            return False
        return True

    # --- formatting: the one formatter ------------------------------------------------------------------------
    def cell_text(self, row: int, header: str) -> str:
        """The cell as the table prints it."""
        status = self.status.get(header, {}).get(row)
        if status:
            return str(status).upper()
        column = self.col(header)
        value = self.data.at[row, header]
        if is_missing(value):
            return MISSING
        text = format_value(value, column.fmt)
        if column.second is not None and not is_missing(self.data.at[row, column.second]):
            text += column.joiner + format_value(self.data.at[row, column.second], column.fmt)
        return text + column.suffix

    def quote(self, header: str, row: int | None = None, **keys) -> str:
        """A cell's (first) number for prose, printed by the cell's own format ('130.6' of '130.6 ± 1.2')."""
        row = self.row(**keys) if row is None else row
        status = self.status.get(header, {}).get(row)
        if status:
            return str(status).upper()
        column = self.col(header)
        return format_value(self.data.at[row, header], column.fmt) + (
            column.suffix if not is_missing(self.data.at[row, header]) else "")

    def quote_second(self, header: str, row: int | None = None, **keys) -> str:
        """The second number of a joined cell (the std of 'mean ± std') for prose."""
        row = self.row(**keys) if row is None else row
        column = self.col(header)
        if column.second is None:
            raise ValueError(f"column {header!r} joins no second value")
        return format_value(self.data.at[row, column.second], column.fmt)

    def display(self) -> pd.DataFrame:
        """Every cell as text, in display order."""
        return pd.DataFrame({h: [self.cell_text(i, h) for i in range(len(self.data))] for h in self.headers},
                            columns=self.headers)

    def cell_texts(self) -> list[str]:
        return [self.cell_text(i, h) for i in range(len(self.data)) for h in self.headers]

    def to_markdown(self, index: bool = False) -> str:
        """Markdown of the displayed cells; numbers right-aligned. tabulate must not re-parse the texts as
        numbers (it would reprint '0.10' as '0.1'), so what it prints is what cell_text made."""
        del index  # never printed; accepted so a NumericTable reads like a DataFrame here
        align = ["right" if c.numeric else "left" for c in self.columns]
        return self.display().to_markdown(index=False, disable_numparse=True, colalign=align)

    def to_latex(self, caption: str) -> str:
        align = "".join("r" if c.numeric else "l" for c in self.columns)
        return self.display().to_latex(index=False, caption=caption.replace("_", r"\_"), escape=True,
                                       column_format=align)

    # --- storage: results/tables/NAME.json ------------------------------------------------------------------
    def to_json(self) -> str:
        def plain(value):
            if is_missing(value):
                return None
            return value.item() if hasattr(value, "item") else value

        def line(value) -> str:
            return json.dumps(value, ensure_ascii=False)

        defaults = asdict(Col(""))
        columns = [{k: v for k, v in asdict(c).items() if k == "header" or v != defaults[k]} for c in self.columns]
        data = {name: [plain(v) for v in self.data[name].astype(object)] for name in self.data.columns}
        status = {h: {str(r): s for r, s in rows.items()} for h, rows in self.status.items() if rows}
        # one line per column spec and per data column, so that a rebuilt table diffs by column
        return ("{\n \"columns\": [\n  " + ",\n  ".join(line(c) for c in columns) + "\n ],\n \"data\": {\n  "
                + ",\n  ".join(f"{line(name)}: {line(values)}" for name, values in data.items())
                + "\n },\n \"status\": " + line(status) + "\n}")

    @classmethod
    def from_json(cls, text: str) -> NumericTable:
        spec = json.loads(text)
        data = pd.DataFrame({name: pd.Series(values, dtype=_dtype(values)) for name, values in spec["data"].items()})
        status = {h: {int(r): s for r, s in rows.items()} for h, rows in spec["status"].items()}
        return cls(data, tuple(Col(**c) for c in spec["columns"]), status)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> NumericTable:
        return cls.from_json(Path(path).read_text())


def _dtype(values: Sequence) -> str | None:
    """float64 for columns of numbers (None as NaN), int64 for whole numbers, object for flags; text is left to
    pandas, so that a loaded column has the dtype the same list gets in a new frame (object before pandas 3,
    its string dtype from 3 on)."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "object"
    if present and all(isinstance(v, int) and not isinstance(v, bool) for v in present) and len(present) == len(values):
        return "int64"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return "float64"
    return None
