"""The deliverable registry: every section of the writeup, with the tables and figures it owns.

One module per handout part, as workflow/rules/ is split; a new section is a Deliverable in one of them
(or a new module listed in PARTS). The writeup is built from DELIVERABLES, and the workflow's `table`
and `figure` rules take their names and inputs from `table_inputs` and `figure_inputs`.
"""

from __future__ import annotations

import math
import re

from cs336_systems.report.section import Deliverable, Figure, Table
from cs336_systems.report.sections import (attention, benchmarking, distributed, edition2026, flash_shapes, leaderboard,
                                           memory, profiling, sharding, training)

# The 2026 handout's sections come last (their "2026 §..." labels sort after every 2025 number).
PARTS = (benchmarking, profiling, memory, attention, flash_shapes, distributed, sharding, training, edition2026, leaderboard)


def handout_order(item: Deliverable) -> tuple[tuple[float, ...], str]:
    """The section's handout numbering and part letter ('1.3.1 (b) …' -> ((1, 3, 1), 'b')); sections
    without a number go last."""
    found = re.match(r"([\d.]+)\s*(?:\((\w))?", item.section)
    if not found:
        return (math.inf,), ""
    return tuple(int(n) for n in found[1].strip(".").split(".")), found[2] or ""


# sorted() is stable: deliverables with the same numbering keep the order their module lists them in
DELIVERABLES: list[Deliverable] = sorted((item for part in PARTS for item in part.DELIVERABLES), key=handout_order)
TABLES: dict[str, Table] = {table.name: table for item in DELIVERABLES for table in item.tables}
FIGURES: dict[str, Figure] = {figure.name: figure for item in DELIVERABLES for figure in item.figures}


def table_inputs(results: str) -> dict[str, str]:
    """Table name -> the results CSV it is built from, for the workflow's `table` rule."""
    return {name: f"{results}/{table.data}.csv" for name, table in TABLES.items()}


def figure_inputs(results: str) -> dict[str, str]:
    """Figure name -> the results CSV it is drawn from, for the workflow's `figure` rule."""
    return {name: f"{results}/{figure.data}.csv" for name, figure in FIGURES.items()}


def figure_extra_inputs(results: str) -> dict[str, list[str]]:
    """Figure name -> the further results CSVs it draws where they exist (Figure.also)."""
    return {name: [f"{results}/{data}.csv" for data in figure.also] for name, figure in FIGURES.items()}
