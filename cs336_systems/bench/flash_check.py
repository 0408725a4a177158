"""Run the FlashAttention-2 tests (tests/test_flash.py) here and record each outcome as a row with
provenance, so the writeup can say on which device and versions the kernels were checked.

    python -m cs336_systems.bench.flash_check --device cuda --workers 8 --out results/flash_correctness.csv

On a fresh GPU machine the tests spend their time compiling Triton kernels (one compile per
specialization: dtype, causal, head dim, length divisibility), which is single-threaded CPU work, so
each test runs in a pytest process of its own, several at a time on the same GPU.
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


def collect(tests: Path) -> list[str]:
    """The test ids pytest finds in `tests`."""
    listing = subprocess.run([sys.executable, "-m", "pytest", str(tests), "--collect-only", "-q", "-p",
                              "no:cacheprovider"], capture_output=True, text=True, cwd=tests.parents[1])
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected from {tests}:\n{listing.stdout}{listing.stderr}")
    return ids


def run_tests(ids: list[str], workers: int, tmp: Path, cwd: Path) -> list[ET.Element]:
    """Each test in a pytest process of its own, `workers` at a time, the next test going to the first
    free worker (a few tests take most of the time, so fixed shards would leave workers idle); their
    junit test cases. Triton's on-disk cache is shared, so a kernel compiled for one test serves the rest."""
    def one(index: int, test_id: str) -> list[ET.Element]:
        xml = tmp / f"test{index}.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", test_id],
                       cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return list(ET.parse(xml).getroot().iter("testcase")) if xml.exists() else []

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [case for cases in pool.map(one, range(len(ids)), ids) for case in cases]


def flash_check_rows(device: str, workers: int = 1, tests: Path = TESTS) -> list[dict]:
    """One row per test of `tests` (outcome, seconds, provenance naming `device`); a SystemExit when a
    test failed or reported no outcome, so a failed check never becomes a results file."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    ids = collect(tests)
    with tempfile.TemporaryDirectory() as tmp:
        cases = run_tests(ids, workers, Path(tmp), tests.parents[1])
    prov = provenance(device)
    rows = []
    for case in cases:
        outcome = next((OUTCOME[tag] for tag in OUTCOME if case.find(tag) is not None), "passed")
        rows.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)), **prov})
    missing = len(ids) - len(rows)
    failed = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if failed or missing:
        raise SystemExit(f"flash tests failed: {failed}; {missing} of {len(ids)} tests reported no outcome")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="device named in the provenance columns")
    parser.add_argument("--workers", type=positive_int, default=1, help="concurrent pytest processes")
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    write_rows(flash_check_rows(args.device, args.workers), args.out)


if __name__ == "__main__":
    main()
