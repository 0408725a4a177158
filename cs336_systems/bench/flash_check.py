"""Run the FlashAttention-2 tests (tests/test_flash.py) here and record each outcome as a row with
provenance, so the writeup can say on which device and versions the kernels were checked.

    python -m cs336_systems.bench.flash_check --device cuda --out results/flash_correctness.csv
"""

from __future__ import annotations

import argparse
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cs336_systems.bench.provenance import provenance
from cs336_systems.bench.results import write_rows

TESTS = Path(__file__).resolve().parents[2] / "tests" / "test_flash.py"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="device named in the provenance columns")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        pytest.main([str(TESTS), "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"])
        cases = ET.parse(xml_path).getroot().iter("testcase")
        prov = provenance(args.device)
        rows = []
        for case in cases:
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            rows.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)), **prov})
    write_rows(rows, args.out)
    failed = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if failed or not rows:
        raise SystemExit(f"flash tests failed: {failed or 'none ran'}")


if __name__ == "__main__":
    main()
