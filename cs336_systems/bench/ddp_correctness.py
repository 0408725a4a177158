"""Correctness of the data-parallel wrappers and the sharded optimizer, counted over repeated runs
with fresh seeds (for the writeup's table; the tests themselves are in tests/).

    python -m cs336_systems.bench.ddp_correctness tests/test_ddp.py tests/test_sharded_optimizer.py \
        -k "matches_single_process and not nccl or sharded" --repeats 5 --out ddp_correctness.csv

Each repeat runs pytest on the given test files in a fresh interpreter, with the environment
variable CS336_TEST_SEED set to the repeat's number (1, 2, ...): the distributed tests add it to
their seeds (tests/distributed_helpers.seed), so every repeat draws other initial weights and
batches than the others and than a plain pytest run (seed shift 0). The tests compare, on CPU with
gloo and 2 ranks, every wrapper's parameters after several steps with a single process trained on the
full batch (the naive-DDP weights-match check is `test_wrapper_matches_single_process[naive]`), and
the sharded optimizer's parameters with an unsharded AdamW's. One row per test: how many runs
passed, failed or were skipped, and the seed shifts used.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

SEED_ENV = "CS336_TEST_SEED"


def outcomes(junit_xml: str | Path) -> dict[str, str]:
    """{test id: passed | failed | skipped} from a pytest JUnit XML report (an error counts as failed)."""
    found = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test = f"{module}::{case.get('name')}"
        children = {child.tag for child in case}
        found[test] = ("failed" if children & {"failure", "error"} else
                       "skipped" if "skipped" in children else "passed")
    return found


def run_once(tests: list[str], select: str | None, seed_shift: int, timeout_s: float) -> dict[str, str]:
    """One pytest run of `tests` (filtered by -k `select`) with the given seed shift."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests]
        if select:
            command += ["-k", select]
        done = subprocess.run(command, env={**os.environ, SEED_ENV: str(seed_shift)}, capture_output=True,
                              text=True, timeout=timeout_s)
        print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:], file=sys.stderr,
              flush=True)
        if not report.exists():  # pytest could not even collect (a usage error, a missing file)
            raise RuntimeError(f"pytest wrote no report (exit {done.returncode}):\n{done.stdout[-2000:]}"
                               f"{done.stderr[-2000:]}")
        found = outcomes(report)
        if not found:
            raise ValueError(f"no test of {tests} matches -k {select!r}")
        return found


def count(runs: list[tuple[int, dict[str, str]]]) -> list[dict]:
    """One row per test: runs, passed, failed, skipped and the seed shifts of the runs."""
    tally: dict[str, dict[str, int]] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
    seeds: dict[str, list[int]] = defaultdict(list)
    for shift, found in runs:
        for test, outcome in found.items():
            tally[test][outcome] += 1
            seeds[test].append(shift)
    return [{"test": test, "runs": sum(counts.values()), **counts, "seed_shifts": " ".join(map(str, seeds[test]))}
            for test, counts in sorted(tally.items())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", nargs="+", help="test files (or node ids) to run")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression choosing the tests")
    parser.add_argument("--repeats", type=int, default=5, help="runs, each with its own seed shift 1..repeats")
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit for one pytest run")
    parser.add_argument("--out", required=True, help="CSV of counts, one row per test")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    runs = []
    for shift in range(1, args.repeats + 1):
        print(f"[{shift}/{args.repeats}] {SEED_ENV}={shift}", file=sys.stderr, flush=True)
        runs.append((shift, run_once(args.tests, args.select, shift, args.timeout_s)))
        # the counts so far, rewritten after every repeat: a run stopped early keeps what it measured
        rows = [{**row, "select": args.select or "", **provenance("cpu")} for row in count(runs)]
        write_rows(rows, args.out)


if __name__ == "__main__":
    main()
