"""python -m cs336_systems.bench.merge A.csv B.csv ... --out ALL.csv — concatenate sweep pieces."""

import argparse

from cs336_systems.results import read_rows, write_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("inputs", nargs="+", help="CSV files to concatenate, in order")
    parser.add_argument("--out", required=True, help="CSV file for all their rows")
    args = parser.parse_args(argv)
    write_rows(read_rows(*args.inputs).to_dict("records"), args.out)


if __name__ == "__main__":
    main()
