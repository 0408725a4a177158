"""The writeup as one HTML page (tables, figures and all), for reading in a browser.

    python -m cs336_systems.report.html results/writeup.md --out results/writeup.html

Figure links stay relative, so the page is read from where the Markdown file lives. Each heading's id is the anchor
GitHub gives it (report/render.py), so the contents' links work on the page as they do on GitHub.
"""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path

import markdown

from cs336_systems.report.render import headings

STYLE = """
body { font: 15px/1.5 system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; }
img { max-width: 100%; }
code { background: #f5f5f5; padding: 0 3px; }
"""


def with_anchors(body: str, text: str) -> str:
    """The HTML body with the id of each Markdown heading of `text` (in order) on its <hN> tag."""
    anchors = [anchor for _, _, anchor in headings(text)]
    tags = list(re.finditer(r"<h([1-6])>", body))
    if len(tags) != len(anchors):
        raise ValueError(f"the page has {len(tags)} headings and the Markdown {len(anchors)}: cannot give them ids")
    parts, pos = [], 0
    for tag, anchor in zip(tags, anchors):
        parts += [body[pos:tag.start()], f'<h{tag[1]} id="{html.escape(anchor)}">']
        pos = tag.end()
    return "".join(parts) + body[pos:]


def render(text: str, title: str) -> str:
    body = with_anchors(markdown.markdown(text, extensions=["tables", "fenced_code"], output_format="html"), text)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("markdown_file")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    text = Path(args.markdown_file).read_text()
    title = next((line.lstrip("# ") for line in text.splitlines() if line.startswith("# ")), "writeup")
    Path(args.out).write_text(render(text, title))


if __name__ == "__main__":
    main()
