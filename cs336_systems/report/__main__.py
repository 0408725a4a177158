"""python -m cs336_systems.report {table,figure} NAME INPUT.csv... — render one table or figure.

A table is built once: its Markdown, its LaTeX and its numeric frame (--json, report/frame.py), which the
writeup reads back to quote the same numbers the Markdown prints."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from cs336_systems.results import read_rows
from cs336_systems.report.render import provenance_line, save_table
from cs336_systems.report.sections import FIGURES, TABLES


def make_table(name: str, inputs: list[str | Path], md: str | Path, tex: str | Path, json: str | Path | None) -> None:
    """Build table `name` once from its results files and write its Markdown, LaTeX and numeric frame."""
    frame = read_rows(*inputs)
    table = TABLES[name]
    measured = table.rows(frame) if table.rows else frame
    measured = measured if len(measured) else frame  # an empty table (nothing to summarise yet) names its data's
    save_table(table.build(frame), md, tex, f"{table.caption}. {provenance_line(measured)}", json)


def make_tables(results: str | Path, names: list[str] | None = None) -> list[str]:
    """What the `table` rule does for every table (or `names`) whose data is in `results`, written to
    results/tables/ (for tests and for rebuilding a results folder without Snakemake); the names built."""
    results, built = Path(results), []
    for name, table in TABLES.items():
        data = results / f"{table.data}.csv"
        if (names is None or name in names) and data.exists():
            out = results / "tables" / name
            make_table(name, [data], out.with_suffix(".md"), out.with_suffix(".tex"), out.with_suffix(".json"))
            built.append(name)
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="kind", required=True)
    table = sub.add_parser("table", help="Markdown and LaTeX table")
    table.add_argument("name", choices=sorted(TABLES))
    table.add_argument("inputs", nargs="+")
    table.add_argument("--md", required=True)
    table.add_argument("--tex", required=True)
    table.add_argument("--json", help="the numeric frame the Markdown prints, which the writeup quotes")
    figure = sub.add_parser("figure", help="PNG figure")
    figure.add_argument("name", choices=sorted(FIGURES))
    figure.add_argument("inputs", nargs="+")
    figure.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.kind == "table":
        make_table(args.name, args.inputs, args.md, args.tex, args.json)
    else:  # a figure may draw several files' rows (Figure.also): each row says which file it came from
        frame = pd.concat([read_rows(path).assign(results_file=Path(path).stem) for path in args.inputs],
                          ignore_index=True)
        FIGURES[args.name].draw(frame, args.out)


if __name__ == "__main__":
    main()
