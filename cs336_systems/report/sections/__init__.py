"""The deliverable registry: every section of the writeup, with the tables and figures it owns.

One module per topic, as workflow/rules/ is split: a topic's sections of both handouts sit in its module, and a
rule with much to say has a module of its own named for it (memory, flash_shapes, sharding, training,
linear_ce). A new section is a Deliverable in one of them (or a new module listed in PARTS). The writeup is
built from DELIVERABLES, and the workflow's `table` and `figure` rules take their names and inputs from
`table_inputs` and `figure_inputs`.
"""

from __future__ import annotations

import math
import re

from cs336_systems.report.section import Deliverable, Figure, Table
from cs336_systems.report.sections import (attention, benchmarking, checkpointing, distributed, flash_shapes,
                                           leaderboard, linear_ce, memory, profiling, sharding, training)

# Grouped by rule file: benchmarking.smk, attention.smk, checkpointing.smk, distributed.smk, leaderboard.smk (whose
# 2026 §9 sections read the loss's, linear_ce, before the whole step's)
PARTS = (benchmarking, profiling, memory, attention, flash_shapes, checkpointing, distributed, sharding, training,
         linear_ce, leaderboard)
EDITIONS = {"": 2025, "2026 §": 2026}  # a section's label starts with its handout's numbering, the 2026 one prefixed


def handout_order(item: Deliverable) -> tuple[float, tuple[int, ...], str]:
    """The section's handout edition, numbering and part letter ('1.3.1 (b) …' -> (2025, (1, 3, 1), 'b'),
    '2026 §3.2 …' -> (2026, (3, 2), '')): the 2025 handout's sections first, then the 2026 handout's; sections
    without a number go last."""
    found = re.match(r"(2026 §)?([\d.]+)\s*(?:\((\w))?", item.section)
    if not found:
        return math.inf, (), ""
    return EDITIONS[found[1] or ""], tuple(int(n) for n in found[2].strip(".").split(".")), found[3] or ""


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
