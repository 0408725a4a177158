"""The writeup's appendix (report/appendix.py): marked blocks move after the body with links both ways, and the body
built from the committed results stays under the word budget the report's readers were promised."""

import os
import re
from pathlib import Path

import pandas as pd
import pytest

from cs336_systems.report import appendix
from cs336_systems.report.frame import Col, NumericTable
from cs336_systems.report.render import headings

ROOT = Path(__file__).resolve().parents[1]
BODY_WORDS = 20_000  # issue 59: the body (everything before '## Appendix') is under this many words


def _split(document: str) -> tuple[str, str]:
    at = document.index(f"\n## {appendix.HEADING}\n")
    return document[:at], document[at:]


@pytest.fixture(scope="module")
def built() -> str:
    """The writeup as the code builds it now from the committed results (what `writeup_md` writes)."""
    from cs336_systems.report.section import Context
    from cs336_systems.report.writeup import build

    here = Path.cwd()
    os.chdir(ROOT)  # figure links are relative to the working directory
    try:
        return build(Context(Path("results"), Path("figures"), Path("results")), "full")
    finally:
        os.chdir(here)


def test_body_is_under_the_word_budget(built):
    body, rest = _split(built)
    words = len(body.split())  # as `wc -w` counts: runs of non-whitespace
    assert words < BODY_WORDS, f"the body has {words} words (the appendix {len(rest.split())})"


def test_every_appendix_subsection_is_linked_from_the_body_and_links_back(built):
    body, rest = _split(built)
    subsections = [(text, anchor) for level, text, anchor in headings(built) if level == 3 and re.match(r"A\.\d+ ", text)]
    assert subsections, "the writeup has no appendix sub-sections"
    assert [text.split()[0] for text, _ in subsections] == [f"A.{i}" for i in range(1, len(subsections) + 1)]
    body_anchors = {anchor for level, _, anchor in headings(body) if level == 2}
    for text, anchor in subsections:
        assert f"](#{anchor})" in body, f"{text} is not linked from the body"
        block = rest[rest.index(f"### {text}\n"):]
        back = re.search(r"From \[[^\]]+\]\(#([^)]+)\)", block)
        assert back and back[1] in body_anchors, f"{text} does not link back to a section of the body"
    assert "<!-- appendix" not in built and "<!-- /appendix" not in built  # every marked block was moved


def test_collect_moves_marked_blocks_in_order_and_leaves_links():
    first = "Intro.\n\n" + appendix.appendix("the long table", "| a |\n|--:|\n| 1 |") + "\n\nAfter."
    second = "\n\n".join(["Answer.", *appendix.appendix_parts("the derivation", ["Step one.", "Step two."])])
    kept, entries = appendix.collect([first, "No appendix here.", second])
    assert [e.heading for e in entries] == ["A.1 the long table", "A.2 the derivation"]
    assert [e.section for e in entries] == [0, 2]
    assert kept[0] == "Intro.\n\n_In the appendix: [A.1 the long table](#a1-the-long-table)._\n\nAfter."
    assert kept[1] == "No appendix here."
    assert entries[1].markdown == "Step one.\n\nStep two."
    rendered = appendix.render(entries, lambda i: (f"Section {i}", f"section-{i}"))
    assert rendered.startswith("## Appendix\n")
    assert "### A.2 the derivation\n\nFrom [Section 2](#section-2).\n\nStep one." in rendered


def test_a_title_must_be_one_line():
    for title in ("", "two\nlines", "a --> b"):
        with pytest.raises(ValueError, match="title"):
            appendix.appendix(title, "text")


def test_rows_of_keeps_the_selected_rows_their_statuses_and_formats():
    table = NumericTable(pd.DataFrame({"size": ["s", "m", "l"], "ms": [1.234, float("nan"), 3.5]}),
                         (Col("size"), Col("ms", ".1f")), {"ms": {1: "oom"}})
    both = appendix.rows_of(table, lambda t: t["size"] != "s")
    assert both.display().values.tolist() == [["m", "OOM"], ["l", "3.5"]]
    assert appendix.rows_of(table, lambda t: t["size"] == "l", ("ms",)).headers == ["ms"]
    with pytest.raises(ValueError, match="no row"):
        appendix.rows_of(table, lambda t: t["size"] == "xl")
    with pytest.raises(ValueError, match="no columns"):
        appendix.rows_of(table, lambda t: t["size"] == "l", ("peak",))
    assert appendix.outline(table, ["size"]) == "3 rows; size: s, m, l"
