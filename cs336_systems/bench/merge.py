"""python -m cs336_systems.bench.merge A.csv B.csv ... --out ALL.csv — concatenate sweep pieces, or a benchmark's
run files (results/runs/<bench>/<run_id>.csv, one per run, never rewritten) into its table.

--sort-by COLUMN puts the rows in that column's order, stably (a file's rows keep their order): the runs of a
benchmark by their `timestamp`. --quote adds a boolean column `quoted` marking the rows of the run the writeup
quotes (runs told apart by `run_id`), in each group of rows sharing the --quote-per columns (e.g. per batch):
`latest` is the last run, in the table's order, with rows in the group; a list of run ids (or their prefixes) is the
last of those runs with rows in the group. --default COLUMN=VALUE fills COLUMN where a file's rows lack it (runs
older than the column), before the sorting and quoting.
"""

from __future__ import annotations

import argparse

import pandas as pd

from cs336_systems.results import read_rows, write_rows

LATEST = "latest"


def _quoted_run(runs: list[str], rule: tuple[str, ...]) -> str | None:
    """The run a group quotes, of its runs in table order (None where the rule names none of them)."""
    if rule == (LATEST,):
        return runs[-1]
    listed = [run for run in runs if any(run.startswith(prefix) for prefix in rule)]
    return listed[-1] if listed else None


def quoted(frame: pd.DataFrame, rule: tuple[str, ...], per: tuple[str, ...] = ()) -> pd.Series:
    """True on the rows of each group's quoted run (see the module docstring); a ValueError names a listed run id
    that no row has."""
    runs = frame["run_id"].astype(str)
    unknown = [prefix for prefix in rule if prefix != LATEST and not runs.str.startswith(prefix).any()]
    if unknown or (LATEST in rule and len(rule) > 1):
        raise ValueError(f"--quote {' '.join(rule)}: give '{LATEST}' or run ids of the table's runs "
                         f"(no run {', '.join(map(repr, unknown))})" if unknown else
                         f"--quote {' '.join(rule)}: '{LATEST}' or a list of run ids, not both")
    mark = pd.Series(False, index=frame.index)
    groups = frame.groupby(list(per), sort=False).groups.values() if per else [frame.index]
    for rows in groups:
        chosen = _quoted_run(list(dict.fromkeys(runs[rows])), rule)
        mark[rows] = runs[rows] == chosen
    return mark


def merge(inputs: list[str], sort_by: str | None = None, quote: tuple[str, ...] = (), per: tuple[str, ...] = (),
          defaults: dict[str, str] | None = None) -> pd.DataFrame:
    """The inputs' rows in one frame: `defaults` filled in where a row lacks the column, sorted by `sort_by`
    (stably), with the `quoted` column where `quote` is given."""
    frame = read_rows(*inputs)
    for column, value in (defaults or {}).items():
        frame[column] = frame[column].fillna(value) if column in frame else value
    if sort_by is not None:
        frame = frame.sort_values(sort_by, kind="stable").reset_index(drop=True)
    if quote:
        frame["quoted"] = quoted(frame, tuple(quote), tuple(per))
    return frame


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="CSV files to concatenate, in order")
    parser.add_argument("--out", required=True, help="CSV file for all their rows")
    parser.add_argument("--sort-by", help="a column to order the rows by, stably (e.g. timestamp)")
    parser.add_argument("--quote", nargs="+", default=(),
                        help=f"mark the rows of the quoted run in a column `quoted`: {LATEST}, or run ids (prefixes)")
    parser.add_argument("--quote-per", nargs="+", default=(), help="columns whose groups each quote a run (e.g. batch)")
    parser.add_argument("--default", nargs="+", default=(), metavar="COLUMN=VALUE",
                        help="a value for rows that lack the column (runs older than it)")
    args = parser.parse_args(argv)
    malformed = [text for text in args.default if "=" not in text or text.startswith("=")]
    if malformed:
        parser.error(f"--default takes COLUMN=VALUE; got {', '.join(map(repr, malformed))}")
    defaults = dict(text.split("=", 1) for text in args.default)
    if args.quote_per and not args.quote:
        parser.error("--quote-per needs --quote")
    try:
        frame = merge(args.inputs, args.sort_by, tuple(args.quote), tuple(args.quote_per), defaults)
    except (KeyError, ValueError) as error:
        parser.error(str(error))
    write_rows(frame.to_dict("records"), args.out)


if __name__ == "__main__":
    main()
