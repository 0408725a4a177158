"""The tree's shape (issue 58's limits): library files a reader takes in whole, a decision record read in ten
minutes, and no library code or test that points into experiments rather than at the record."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "cs336_systems"
MAX_MODULE_LINES = 700
MAX_RECORD_LINES = 600


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_every_library_module_is_under_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in LIBRARY.rglob("*.py") if (n := _lines(p)) >= MAX_MODULE_LINES}
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more (split them by topic): {long}"


def test_the_decision_record_is_under_the_line_limit():
    records = sorted(LIBRARY.rglob("DECISIONS.md"))
    assert records, "no DECISIONS.md under cs336_systems/"
    total = sum(map(_lines, records))
    assert total < MAX_RECORD_LINES, (
        f"the decision records hold {total} lines together (at most {MAX_RECORD_LINES - 1}): condense the entries "
        f"({', '.join(f'{p.relative_to(ROOT)}: {_lines(p)}' for p in records)})")


def test_code_points_at_the_record_not_at_experiments():
    """No .py of the library or the tests names a diagnosis folder or the old work log; the record's own entries
    may name the commits where an experiment's files can be found."""
    word = re.compile(r"diagnosis|NOTES\.md")
    hits = [f"{p.relative_to(ROOT)}:{i}" for base in (LIBRARY, ROOT / "tests") for p in base.rglob("*.py")
            if p.name != Path(__file__).name
            for i, line in enumerate(p.read_text().splitlines(), 1) if word.search(line)]
    assert not hits, f"code naming experiments instead of the decision record: {hits}"
