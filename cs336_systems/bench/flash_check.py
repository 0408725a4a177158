"""Check the FlashAttention-2 kernels on this device and record the outcome as rows with provenance, so
the writeup can say on which device and versions they were checked:

1. the tests of tests/test_flash.py, `--repeats` times with fresh random inputs each time (the file
   offsets its seeds by $CS336_FLASH_SEED), one row per test and repeat (results/flash_correctness.csv);
2. with `--accuracy-out`, the bfloat16 accuracy check: the relative error of our O, dQ, dK and dV
   against float64, beside that of PyTorch's SDPA (flash backend on a GPU, math backend on the CPU)
   on the same inputs, one row per (implementation, case, seed, tensor) (results/flash_accuracy.csv).

    python -m cs336_systems.bench.flash_check --device cuda --workers 8 --repeats 5 \\
        --out results/flash_correctness.csv --accuracy-out results/flash_accuracy.csv

On a fresh GPU machine the tests spend their time compiling Triton kernels (one compile per
specialization: dtype, causal, head dim, length divisibility), which is single-threaded CPU work, so
each test runs in a pytest process of its own, several at a time on the same GPU. A failed test or an
error worse than SDPA's by more than the allowed factor is a SystemExit, so a failed check never
becomes a results file (the log keeps the numbers).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cs336_systems.bench.cli import positive_int
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows

TESTS = Path(__file__).resolve().parents[2] / "tests" / "test_flash.py"
OUTCOME = {"failure": "failed", "error": "error", "skipped": "skipped"}


def collect(tests: Path, select: str | None = None) -> list[str]:
    """The test ids pytest finds in `tests`, only those matching the `-k` expression `select` if given."""
    chosen = ["-k", select] if select else []
    listing = subprocess.run([sys.executable, "-m", "pytest", str(tests), "--collect-only", "-q", "-p",
                              "no:cacheprovider", *chosen], capture_output=True, text=True, cwd=tests.parents[1])
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected from {tests} (select={select!r}):\n{listing.stdout}{listing.stderr}")
    return ids


def outcome_of(case: ET.Element) -> str:
    """A junit test case's outcome: passed, failed, error or skipped."""
    return next((OUTCOME[tag] for tag in OUTCOME if case.find(tag) is not None), "passed")


def run_tests(runs: list[tuple[tuple[str, ...], int]], workers: int, tmp: Path,
              cwd: Path) -> list[tuple[int, ET.Element]]:
    """Each (test ids, repeat) in a pytest process of its own with CS336_FLASH_SEED=repeat, `workers` at a
    time, the next run going to the first free worker (a few tests take most of the time, so fixed shards
    would leave workers idle); their (repeat, junit test case). Triton's on-disk cache is shared, so a
    kernel compiled for one run serves the rest."""
    # Each process gets its share of the CPU's threads: 16 processes of 16 intra-op threads each (torch's
    # default) left the float64 CPU references of a 16-core machine oversubscribed, and the call took more
    # than twice its serial estimate.
    threads = str(max(1, (os.cpu_count() or 1) // workers))

    def one(index: int, run: tuple[tuple[str, ...], int]) -> list[tuple[int, ET.Element]]:
        test_ids, repeat = run
        xml = tmp / f"test{index}.xml"
        # -n 0: pyproject's addopts would give every one-test process its own pool of xdist workers
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", *test_ids], cwd=cwd,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "CS336_FLASH_SEED": str(repeat),
                            "OMP_NUM_THREADS": threads})
        cases = [(repeat, case) for case in ET.parse(xml).getroot().iter("testcase")] if xml.exists() else []
        for _, case in cases:  # the log names each outcome as it comes (a cut run still says what failed)
            print(f"repeat {repeat}: {case.get('name')}: {outcome_of(case)} ({case.get('time')} s)", flush=True)
        return cases

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [found for cases in pool.map(one, range(len(runs)), runs) for found in cases]


def flash_check_rows(device: str, workers: int = 1, tests: Path = TESTS, repeats: int = 1,
                     select: str | None = None) -> list[dict]:
    """One row per test of `tests` and repeat (outcome, seconds, repeat, provenance naming `device`); a
    SystemExit when a test failed or reported no outcome."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    ids = collect(tests, select)
    # One process per test where several run at once; one per repeat otherwise (a process start is
    # seconds of imports, which a CPU smoke run of a few tests would mostly spend).
    groups = [(test_id,) for test_id in ids] if workers > 1 else [tuple(ids)]
    runs = [(group, repeat) for repeat in range(repeats) for group in groups]
    with tempfile.TemporaryDirectory() as tmp:
        cases = run_tests(runs, workers, Path(tmp), tests.parents[1])
    prov = provenance(device)
    rows = []
    for repeat, case in cases:
        rows.append({"test": case.get("name"), "repeat": repeat, "outcome": outcome_of(case),
                     "seconds": float(case.get("time", 0)), **prov})
    missing = len(ids) * repeats - len(rows)
    failed = sorted({f"{r['test']} (repeat {r['repeat']})" for r in rows if r["outcome"] in ("failed", "error")})
    if failed or missing:
        raise SystemExit(f"flash tests failed: {failed}; {missing} of {len(ids) * repeats} runs reported no outcome")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="device named in the provenance columns; the "
                        "accuracy check runs there")
    parser.add_argument("--workers", type=positive_int, default=1, help="concurrent pytest processes")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs of every test, each with fresh random inputs (CS336_FLASH_SEED=0, 1, ...)")
    parser.add_argument("--select", default=None,
                        help="pytest -k expression: only these tests (the smoke scale's representative subset)")
    parser.add_argument("--accuracy-seeds", type=positive_int, default=3,
                        help="random inputs per case of the bfloat16 accuracy check")
    parser.add_argument("--accuracy-factor", type=float, default=1.1,
                        help="the check fails where our mean error exceeds SDPA's times this, plus the slack")
    parser.add_argument("--accuracy-slack", type=float, default=2e-4,
                        help="absolute slack on the relative error (5%% of bfloat16's rounding, 3.9e-3)")
    parser.add_argument("--out", required=True, help="CSV file for the test rows")
    parser.add_argument("--accuracy-out", default=None, help="CSV file for the bfloat16 accuracy rows (none: skipped)")
    args = parser.parse_args(argv)
    if args.accuracy_factor < 1 or args.accuracy_slack < 0:
        parser.error(f"--accuracy-factor must be >= 1 and --accuracy-slack >= 0, got {args.accuracy_factor}, "
                     f"{args.accuracy_slack}")
    if args.accuracy_out:  # first: seconds, where the tests take minutes
        from cs336_systems.bench.flash_accuracy import accuracy_rows, failures

        limits = {"allowed_factor": args.accuracy_factor, "allowed_slack": args.accuracy_slack}
        rows = [{**row, **limits, **provenance(args.device)}
                for row in accuracy_rows(args.device, seeds=args.accuracy_seeds)]
        worse = failures(rows, args.accuracy_factor, args.accuracy_slack)
        if worse:
            raise SystemExit("our bfloat16 error exceeds SDPA's by more than "
                             f"{args.accuracy_factor}x + {args.accuracy_slack}:\n" + "\n".join(worse))
        write_rows(rows, args.accuracy_out)
    write_rows(flash_check_rows(args.device, args.workers, repeats=args.repeats, select=args.select), args.out)


if __name__ == "__main__":
    main()
