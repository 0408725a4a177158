"""What a student hands in: the writeup's front page, its anchors (the same on GitHub, in the HTML page and in the
PDF), the PDF typeset by report/typst.py, and code.zip (report/submission.py)."""

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cs336_systems.report import front_page
from cs336_systems.report.render import headings, slugify
from cs336_systems.report.sections import DELIVERABLES
from cs336_systems.report.typst import inline, to_typst

typst = pytest.importorskip("typst")
ROOT = Path(__file__).resolve().parents[1]


def flat(node) -> str:
    """The text of a queried Typst element (its JSON), symbols and spaces included, in order."""
    if isinstance(node, list):
        return "".join(flat(n) for n in node)
    if not isinstance(node, dict):
        return ""
    if node.get("func") == "space":
        return " "
    own = node.get("text", "") if isinstance(node.get("text"), str) else ""
    return own + "".join(flat(node[key]) for key in ("body", "children", "child") if key in node)


def query(source: str, selector: str, field: str | None = None, root: Path = ROOT):
    return json.loads(typst.query(source.encode(), selector, field=field, root=str(root), ignore_system_fonts=True))


# --- anchors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heading,anchor", [
    ("2025 §1.1.4 (a–e) nsys_profile: kernel summaries per range",
     "2025-114-ae-nsys_profile-kernel-summaries-per-range"),
    ("fsdp_accounting (a) — expected saving from FSDP (2026 handout, section 7)",
     "fsdp_accounting-a--expected-saving-from-fsdp-2026-handout-section-7"),
    ("2026 §9 leaderboard parts: the fused LM head + cross-entropy",
     "2026-9-leaderboard-parts-the-fused-lm-head--cross-entropy"),
    ("`code` and **bold** in a heading", "code-and-bold-in-a-heading"),
])
def test_anchors_are_githubs(heading, anchor):
    """GitHub's rule (github-slugger): lower case; letters, digits, '_', '-' kept, spaces to '-', the rest dropped."""
    assert slugify(heading) == anchor


def test_repeated_headings_get_numbered_anchors_and_fences_are_skipped():
    text = "# T\n## A\n```\n## not a heading\n```\n## A\n### A\n"
    assert [anchor for _, _, anchor in headings(text)] == ["t", "a", "a-1", "a-2"]


# --- the front page -------------------------------------------------------------------------------------------------
def test_every_section_heading_names_its_edition():
    from cs336_systems.report.writeup import heading

    for item in DELIVERABLES:
        assert re.match(r"(2025|2026) §\d|.*\(beyond the handouts\)$", heading(item)), heading(item)


def test_every_problem_of_the_map_is_answered_by_a_section():
    unanswered = [p.name for p in front_page.PROBLEMS if not front_page.answering(p, DELIVERABLES)]
    assert not unanswered, f"problems whose sections the map cannot find (fix Problem.match): {unanswered}"


def test_the_size_tables_name_the_2026_xl_our_2_7B():
    text = front_page.size_tables()
    row = next(line for line in text.splitlines() if line.startswith("| xl") and "2560" in line)
    assert row.rstrip(" |").endswith("2.7B")


def test_a_headline_is_the_cell_of_its_table(tmp_path, monkeypatch):
    """Change a cell in the numeric frame a section embeds: the front page quotes the new value."""
    from cs336_systems.report.frame import NumericTable
    from cs336_systems.report.section import Context

    line = next(h for h in front_page.HEADLINES if h.table == "linear_ce" and h.keys.get("provider") == "fused")
    results = tmp_path / "results"
    (results / "tables").mkdir(parents=True)
    shutil.copy(ROOT / "results" / "linear_ce.csv", results)
    table = NumericTable.load(ROOT / "results" / "tables" / "linear_ce.json")
    table.data.loc[table.row(**line.keys), line.header] = 1234.0
    table.save(results / "tables" / "linear_ce.json")
    monkeypatch.chdir(tmp_path)
    ctx = Context(Path("results"), Path("figures"), Path("results"))
    owners = {t.name: item for item in DELIVERABLES for t in item.tables}
    anchors = {item.section: "x" for item in DELIVERABLES}
    table = front_page.headline_table(ctx, anchors, owners)
    assert re.search(r"provider: fused\)\s+\|\s+1,234 \|\s+NVIDIA", table), table
    assert "| pending |" in table  # the headlines whose tables this folder lacks


# --- Markdown to Typst ---------------------------------------------------------------------------------------------
SAMPLE = """# Title <of> #things

## Part 1: a $5 // comment-like /* text */ with @mention, ~tilde, *star* and 2*3*4

1. an ordered item

_an italic caption with do_bench inside_, `raw <code>` and **bold `x`**, a [link](#part-1-a-5--comment-like--text--with-mention-tilde-star-and-234).

- first item with [a web link](https://example.org/a_b)
  continued on the next line
- second item

| name | value |
|:-----|------:|
| a_b/c | 1.5 |
| `k<1>` | — |

```python
x = "# not a heading"
```

![a figure](fig.png)
"""


def sample_source(tmp_path):
    shutil.copy(ROOT / "figures" / next(p.name for p in (ROOT / "figures").glob("*.png")), tmp_path / "fig.png")
    return to_typst(SAMPLE, base=tmp_path, root=tmp_path)


def test_special_characters_are_text(tmp_path):
    source = sample_source(tmp_path)
    titles = [flat(h) for h in query(source, "heading", "body", tmp_path)]
    assert titles == ["Title <of> #things",
                      "Part 1: a $5 // comment-like /* text */ with @mention, ~tilde, star and 2*3*4"]


def test_links_tables_lists_code_and_figures_are_typeset(tmp_path):
    source = sample_source(tmp_path)
    labels = {h["label"].strip("<>") for h in query(source, "heading", root=tmp_path)}
    destinations = [link["dest"] for link in query(source, "link", root=tmp_path)]
    assert "<part-1-a-5--comment-like--text--with-mention-tilde-star-and-234>" in destinations
    assert all(d.strip("<>") in labels for d in destinations if d.startswith("<"))
    assert "https://example.org/a_b" in destinations
    assert len(query(source, "table", root=tmp_path)) == 1
    (children,) = query(source, "table", "children", tmp_path)
    cells = [flat(c).replace("\u200b", "") for c in children[0]["children"] + children[1:]]
    assert cells == ["name", "value", "a_b/c", "1.5", "k<1>", "—"]
    raws = [r["text"] for r in query(source, "raw", root=tmp_path)]
    assert {"raw <code>", "x", 'x = "# not a heading"', "k<1>"} <= set(raws)
    assert len(query(source, "figure", root=tmp_path)) == 1
    (items,) = query(source, "list", "children", tmp_path)
    assert [flat(item) for item in items] == ["first item with a web link continued on the next line", "second item"]
    (ordered,) = query(source, "enum", "children", tmp_path)
    assert [flat(item) for item in ordered] == ["an ordered item"]
    emphasized = [flat(e) for e in query(source, "emph", "body", tmp_path)]
    assert emphasized[:2] == ["star", "an italic caption with do_bench inside"]


def test_inline_calls_end_so_text_after_them_stays_text():
    assert inline("`a`.b and **c**.d") == '#raw("a");.b and #strong[c];.d'


def test_a_missing_figure_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.png"):
        to_typst("![x](nothere.png)\n", base=tmp_path, root=tmp_path)


def test_the_committed_writeup_typesets_with_its_figures(tmp_path):
    """results/writeup.md as `snakemake writeup` typesets it: a PDF, its contents' links all land on a heading."""
    from cs336_systems.report.typst import compile_pdf

    source = to_typst((ROOT / "results" / "writeup.md").read_text(), ROOT / "results", ROOT)
    labels = {h["label"].strip("<>") for h in query(source, "heading")}
    internal = [d["dest"].strip("<>") for d in query(source, "link") if str(d["dest"]).startswith("<")]
    assert len(internal) > len(DELIVERABLES) and set(internal) <= labels
    assert len(query(source, "figure")) == (ROOT / "results" / "writeup.md").read_text().count("\n![")
    compile_pdf(ROOT / "results" / "writeup.md", tmp_path / "writeup.pdf", ROOT)
    assert (tmp_path / "writeup.pdf").read_bytes().startswith(b"%PDF")


def test_the_html_page_has_the_anchors_its_links_name(tmp_path):
    from cs336_systems.report import html

    html.main([str(ROOT / "results" / "writeup.md"), "--out", str(tmp_path / "writeup.html")])
    page = (tmp_path / "writeup.html").read_text()
    ids = set(re.findall(r' id="([^"]+)"', page))
    links = re.findall(r'href="#([^"]+)"', page)
    assert links and set(links) <= ids


# --- code.zip ------------------------------------------------------------------------------------------------------
def test_code_zip_holds_the_code_and_is_deterministic(tmp_path):
    from cs336_systems.report.submission import write_zip

    names = write_zip(ROOT, tmp_path / "a.zip")
    write_zip(ROOT, tmp_path / "b.zip")
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()
    assert names == sorted(names) and zipfile.ZipFile(tmp_path / "a.zip").namelist() == names
    for needed in ("tests/adapters.py", "cs336_systems/__init__.py", "pyproject.toml", "README.md",
                   "workflow/Snakefile", "config.yaml"):
        assert needed in names
    assert not [n for n in names if n.startswith(("results/", "figures/", ".git/", "logs/")) or "__pycache__" in n
                or n.endswith(".pyc")]


def test_code_zip_refuses_a_folder_that_is_not_the_repository(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cs336_systems.report.submission", "--root", str(tmp_path),
                             "--out", str(tmp_path / "code.zip")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "is not the repository root" in result.stderr
