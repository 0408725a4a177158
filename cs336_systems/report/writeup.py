"""results/writeup.md: a front page (report/front_page.py), then one section per handout deliverable, in handout
order.

    python -m cs336_systems.report.writeup --results results --figures figures --scale full --out results/writeup.md

The sections and what they embed are registered in `cs336_systems.report.sections`. Every number in
the text is computed there from a results file; a deliverable whose data is missing shows a visible
'pending' line naming the rule that makes it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from cs336_systems.report import appendix, front_page
from cs336_systems.report.render import headings
from cs336_systems.report.section import Context, Deliverable, Section
from cs336_systems.report.sections import DELIVERABLES, handout_order

__all__ = ["DELIVERABLES", "Context", "build", "heading", "render"]


def render(item: Deliverable, ctx: Context, device: str = "cuda") -> str:
    """One section's Markdown body: rendered from its data, or why it cannot be yet."""
    missing = [name for name in item.data if ctx.frame(name) is None]
    if missing and item.cuda_only and device != "cuda":
        return f"not measured at this scale, which runs on the {device}: {item.cuda_only}.\n"
    if missing:
        files = ", ".join(f"{ctx.results / name}.csv" for name in missing)
        return f"pending: rule `{item.rule}` has not produced {files} yet\n"
    body = item.render(ctx)
    return (body.markdown() if isinstance(body, Section) else body) + "\n"


def heading(item: Deliverable) -> str:
    """A section's heading: its label, which says its edition ('2025 §1.1.3 …', '2026 §3.2 …'), or that it answers
    no handout question."""
    edition = handout_order(item)[0]
    if edition == 2025:
        return f"2025 §{item.section}"
    return item.section if edition == 2026 else f"{item.section} (beyond the handouts)"


def intro(scale: str) -> str:
    return (f"This report answers the written questions of CS336 Assignment 2 (systems), both the 2025 handout and "
            f"the 2026 one, from the measurements of this repository's pipeline at {scale} scale; each section's "
            f"heading names its edition and handout section. Every number is computed from the results files "
            f"beside it (each row records its device, versions, commit and date), and a deliverable not yet measured "
            f"says 'pending' and names the rule that makes it. Below: headline results, each a cell of a table further "
            f"down; the contents; the model sizes of both editions; where each problem sits in either edition.")


def section_anchors(skeleton: str, items: list[Deliverable]) -> dict[str, str]:
    """Front-page title or section label -> its heading's anchor in the document `skeleton` (report/render.py)."""
    level2 = [(text, anchor) for level, text, anchor in headings(skeleton) if level == 2]
    anchors = {title: anchor for title, anchor in level2 if title in front_page.TITLES}
    found = iter(level2)
    for item in items:
        anchors[item.section] = next(anchor for text, anchor in found if text == heading(item))
    return anchors


def build(ctx: Context, scale: str, device: str = "cuda") -> str:
    texts, moved = appendix.collect([render(item, ctx, device) for item in DELIVERABLES])
    body = [part for item, text in zip(DELIVERABLES, texts, strict=True) for part in (f"## {heading(item)}\n", text)]
    title = f"# CS336 Assignment 2 (systems): results ({scale} scale)"
    skeleton = "\n".join([title, *(f"## {t}" for t in front_page.TITLES), *body])
    anchors = section_anchors(skeleton, DELIVERABLES)
    owners = {table.name: item for item in DELIVERABLES for table in item.tables}
    front = {
        "Headline results": front_page.headline_table(ctx, anchors, owners, device),
        "Contents": front_page.contents(DELIVERABLES, anchors, heading),
        "Model sizes of the two editions": front_page.size_tables(),
        "Problems in the two editions": front_page.problem_map(DELIVERABLES, anchors),
        "Rebuilding this report": front_page.rebuild_commands(scale),
    }
    if moved:
        front["Contents"] += f"\n- [{appendix.HEADING}](#{appendix.HEADING.lower()})"
    lines = [title, "", intro(scale), ""]
    for name in front_page.TITLES:
        lines += [f"## {name}\n", front[name] + "\n"]
    back = lambda i: (heading(DELIVERABLES[i]), anchors[DELIVERABLES[i].section])  # noqa: E731
    document = "\n".join(lines + body + ([appendix.render(moved, back)] if moved else []))
    _check_links(document)
    return document


def _check_links(document: str) -> None:
    """Every in-document link names a heading of the document (an appendix title that repeats one would not)."""
    found = {anchor for _, _, anchor in headings(document)}
    broken = sorted(set(re.findall(r"\]\(#([^)\s]+)\)", document)) - found)
    if broken:
        raise ValueError(f"writeup: links to no heading: {broken}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the Markdown report from results files.")
    parser.add_argument("--results", required=True, help="results directory of one scale")
    parser.add_argument("--figures", required=True, help="figures directory of the same scale")
    parser.add_argument("--scale", required=True)
    parser.add_argument("--device", default="cuda", help="the device this scale measures on (config: device)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    ctx = Context(Path(args.results), Path(args.figures), out.parent)
    out.write_text(build(ctx, args.scale, args.device))


if __name__ == "__main__":
    main()
