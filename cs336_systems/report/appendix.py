"""The writeup's appendix: long tables, run lists and derivations that a section keeps but the body need not show.

A section marks such a block with `appendix(title, markdown)` (its Markdown stays in the section, so tests that
check a section's prose against its table still see the table); `writeup.build` moves every marked block, in
document order, under '## Appendix' at the end as a sub-section 'A.n title' that links back to its section, and
leaves in its place a line that links to it. `rows_of` gives the body a short table taken from the same frame.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from cs336_systems.report.frame import NumericTable
from cs336_systems.report.render import slugify

HEADING = "Appendix"
_MARKED = re.compile(r"<!-- appendix: (?P<title>[^\n]*?) -->\n(?P<body>.*?)\n<!-- /appendix -->", re.S)


def appendix(title: str, markdown: str) -> str:
    """`markdown` marked for the appendix under `title` (one line of words, e.g. 'flash_benchmarking: every point')."""
    return "\n".join(appendix_parts(title, [markdown.strip()]))


def appendix_parts(title: str, parts: list[str]) -> list[str]:
    """Several parts of a section (paragraphs, tables) marked for the appendix together, each kept as it is, so a
    paragraph a test checks stays one of the section's parts."""
    if not title.strip() or "\n" in title or "-->" in title:
        raise ValueError(f"appendix: a title is one non-empty line without '-->', got {title!r}")
    return [f"<!-- appendix: {title.strip()} -->", *parts, "<!-- /appendix -->"]


@dataclass(frozen=True)
class Entry:
    """One appendix sub-section: its number ('A.3'), title, Markdown and the index of the section it came from."""
    number: str
    title: str
    markdown: str
    section: int

    @property
    def heading(self) -> str:
        return f"{self.number} {self.title}"

    @property
    def anchor(self) -> str:
        return slugify(self.heading)


def collect(bodies: list[str]) -> tuple[list[str], list[Entry]]:
    """Each section body with its marked blocks replaced by a link line, and the blocks as numbered entries."""
    entries: list[Entry] = []

    def move(match: re.Match, section: int) -> str:
        entry = Entry(f"A.{len(entries) + 1}", match["title"], match["body"].strip(), section)
        entries.append(entry)
        return f"_In the appendix: [{entry.heading}](#{entry.anchor})._"

    kept = [_MARKED.sub(lambda m, i=i: move(m, i), body) for i, body in enumerate(bodies)]
    return kept, entries


def render(entries: list[Entry], back: Callable[[int], tuple[str, str]]) -> str:
    """'## Appendix' and its sub-sections; `back(section)` gives the (heading text, anchor) each one links back to."""
    lines = [f"## {HEADING}\n"]
    for entry in entries:
        text, anchor = back(entry.section)
        lines += [f"### {entry.heading}\n", f"From [{text}](#{anchor}).\n", entry.markdown + "\n"]
    return "\n".join(lines)


def rows_of(table: NumericTable, rows: Callable[[pd.DataFrame], pd.Series] | None,
            columns: tuple[str, ...] = ()) -> NumericTable:
    """The rows `rows(table.data)` selects (every row where `rows` is None; and only `columns`, where given), as a
    table printed the way the full one is: a body's summary of a table moved to the appendix."""
    mask = [True] * len(table) if rows is None else rows(table.data).to_numpy()
    kept = [i for i in range(len(table)) if mask[i]]
    if not kept:
        raise ValueError("rows_of: the selection keeps no row of the table")
    position = {old: new for new, old in enumerate(kept)}
    status = {header: {position[r]: s for r, s in cells.items() if r in position}
              for header, cells in table.status.items()}
    unknown = [c for c in columns if c not in table.headers]
    if unknown:
        raise ValueError(f"rows_of: no columns {unknown} in the table (it has {table.headers})")
    shown = tuple(c for c in table.columns if not columns or c.header in columns)
    return NumericTable(table.data.iloc[kept], shown,
                        {h: c for h, c in status.items() if c and any(col.header == h for col in shown)})


def outline(table: NumericTable, keys: list[str]) -> str:
    """'N rows; KEY: values as printed (or how many, and the least and largest of a numeric column); ...': what a
    moved table holds, from its own cells."""
    said = []
    for key in keys:
        texts = list(dict.fromkeys(table.cell_text(i, key) for i in range(len(table))))
        if len(texts) <= 6:
            shown = ", ".join(texts)
        elif table.col(key).numeric:
            values = table.data[key]
            shown = (f"{len(texts)} values, {table.cell_text(values.idxmin(), key)} to "
                     f"{table.cell_text(values.idxmax(), key)}")
        else:
            shown = f"{len(texts)} values"
        said.append(f"{key}: {shown}")
    return f"{len(table)} rows; " + "; ".join(said)


def moved(ctx, name: str, title: str, keys: tuple[str, ...] = ()) -> list[str]:
    """Table `name` of the section (ctx: a report Context) moved to the appendix: a sentence of what it holds, read
    from its own frame, and the marked table."""
    table = ctx.numeric(name)
    keys = keys or tuple(table.headers[:1])
    return [f"_The table ({outline(table, list(keys))}) is in the appendix._",
            appendix(title, ctx.table(name))]


def statistic(markdown: str) -> str:
    """What a built table's cells are (its caption without the provenance line), from results/tables/NAME.md: so a
    body's summary of a moved table says its statistic too."""
    lines = [line for line in markdown.strip().splitlines() if line.startswith("_") and line.endswith("_")]
    if not lines:
        return ""
    return lines[-1].strip("_").split(" Measured on ")[0].rstrip(". ")
