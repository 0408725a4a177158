"""python -m cs336_systems.report {table,figure} NAME INPUT.csv... — render one table or figure."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from cs336_systems.results import read_rows
from cs336_systems.report.render import provenance_line, save_table
from cs336_systems.report.sections import FIGURES, TABLES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="kind", required=True)
    table = sub.add_parser("table", help="Markdown and LaTeX table")
    table.add_argument("name", choices=sorted(TABLES))
    table.add_argument("inputs", nargs="+")
    table.add_argument("--md", required=True)
    table.add_argument("--tex", required=True)
    figure = sub.add_parser("figure", help="PNG figure")
    figure.add_argument("name", choices=sorted(FIGURES))
    figure.add_argument("inputs", nargs="+")
    figure.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.kind == "table":
        frame = read_rows(*args.inputs)
        table = TABLES[args.name]
        save_table(table.build(frame), args.md, args.tex, f"{table.caption}. {provenance_line(frame)}")
    else:  # a figure may draw several files' rows (Figure.also): each row says which file it came from
        frame = pd.concat([read_rows(path).assign(results_file=Path(path).stem) for path in args.inputs],
                          ignore_index=True)
        FIGURES[args.name].draw(frame, args.out)


if __name__ == "__main__":
    main()
