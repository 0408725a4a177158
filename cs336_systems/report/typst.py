"""The writeup as a PDF: its Markdown turned into Typst and compiled by the `typst` package (no system dependencies).

    python -m cs336_systems.report.typst results/writeup.md --out results/writeup.pdf

The converter knows the Markdown the writeup is made of: ATX headings, paragraphs, `code`, **strong**, _emphasis_,
links (to a heading's anchor, or a web address), lists, fenced code, pipe tables and figure lines
(`![caption](path)`). Every heading gets the anchor GitHub and the HTML page give it (report/render.py), so the
contents' links work in the PDF too. Text is escaped character by character, and every inline call ends with ';',
so nothing the writeup says is read as Typst markup or code. Fonts are the ones the package embeds (system fonts
are ignored) and the document carries no date, so the same Markdown gives the same PDF on any machine.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cs336_systems.report.render import headings

PREAMBLE = """#set document(title: {title}, date: none)
#set page(paper: "a4", margin: (x: 1.5cm, y: 1.7cm), numbering: "1")
#set text(size: 9.5pt)
#set par(justify: false)
#show link: set text(fill: rgb("#1a4f9c"))
#show raw: set text(size: 8pt)
#show table: set text(size: 7pt)
#show heading.where(level: 1): set text(size: 16pt)
#show heading.where(level: 2): set text(size: 12.5pt)
#show heading.where(level: 3): set text(size: 10.5pt)
#set table(stroke: 0.4pt + luma(180), inset: (x: 3pt, y: 2pt))
"""
SPECIAL = set("\\#*_`$<>@[]=-+/~")  # characters Typst markup reads as syntax; each is written escaped
ALIGN = {(True, False): "left", (False, True): "right", (True, True): "center", (False, False): "left"}
INLINE = re.compile(
    r"(?P<code>(`+)(?P<code_text>.+?)\2)"
    r"|!\[(?P<img_alt>[^\]]*)\]\((?P<img_src>[^)\s]+)\)"
    r"|\[(?P<link_text>[^\]]+)\]\((?P<link_href>[^)\s]+)\)"
    r"|\*\*(?P<strong>.+?)\*\*"
    r"|(?<![\w\\])_(?P<emph>\S.*?)_(?!\w)|(?<![\w*\\])\*(?P<star>[^*\s][^*]*?)\*(?!\w)"  # '_' inside a word is text
    r"|\\(?P<escaped>[\\`*_{}\[\]()#+\-.!|])"
)


def string(text: str) -> str:
    """A Typst string literal."""
    return json.dumps(text, ensure_ascii=False)


def escape(text: str) -> str:
    return "".join(f"\\{ch}" if ch in SPECIAL else ch for ch in text)


def inline(text: str) -> str:
    """One line of Markdown inline syntax as Typst markup."""
    out, pos = [], 0
    for match in INLINE.finditer(text):
        out.append(escape(text[pos:match.start()]))
        pos = match.end()
        if match["code"]:
            out.append(f"#raw({string(match['code_text'].strip())});")
        elif match["link_text"] is not None:
            out.append(link(match["link_text"], match["link_href"]))
        elif match["img_src"] is not None:
            out.append(escape(match["img_alt"]))  # an inline image has no place in running text: its alt text
        elif match["strong"] is not None:
            out.append(f"#strong[{inline(match['strong'])}];")
        elif match["emph"] is not None or match["star"] is not None:
            out.append(f"#emph[{inline(match['emph'] or match['star'])}];")
        else:
            out.append(escape(match["escaped"]))
    out.append(escape(text[pos:]))
    return "".join(out)


def link(text: str, href: str) -> str:
    if href.startswith("#"):
        return f"#link(label({string(href[1:])}))[{inline(text)}];"
    if re.match(r"https?://", href):
        return f"#link({string(href)})[{inline(text)}];"
    return inline(text)  # a link to a file of the repository: its words (the PDF travels without the files)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def breakable(markup: str) -> str:
    """A table cell's text may break after '_' and '/' (kernel and run names have no spaces): a zero-width space
    follows each (escaped) one. Code spans stay as written."""
    return re.sub(r"(\\[_/])", "\\1\u200b", markup)


def table(lines: list[str]) -> str:
    """A pipe table (header, alignment row, body rows) as a Typst table whose header repeats on each page."""
    header, rule, *body = [cells(line) for line in lines]
    align = [ALIGN[(spec.startswith(":"), spec.endswith(":"))] for spec in rule]
    row = lambda values: ", ".join(f"[{breakable(inline(value))}]" for value in values)  # noqa: E731
    parts = [f"columns: {len(header)}", f"align: ({', '.join(align)},)", f"table.header({row(header)})"]
    parts += [row(values + [""] * (len(header) - len(values))) for values in body]
    return "#table(\n  " + ",\n  ".join(parts) + ",\n)"


class Converter:
    """Markdown blocks to Typst, with image paths made absolute from the compile root."""

    def __init__(self, markdown: str, base: Path, root: Path):
        self.lines = markdown.splitlines()
        self.base, self.root = base.resolve(), root.resolve()
        self.anchors = iter(anchor for _, _, anchor in headings(markdown))
        self.out: list[str] = []
        self.paragraph: list[str] = []

    def image(self, caption: str, src: str) -> str:
        path = (self.base / src).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"the writeup shows a figure that does not exist: {src} (looked for {path})")
        return f"#figure(image({string('/' + path.relative_to(self.root).as_posix())}, width: 70%), " \
               f"caption: [{inline(caption)}])"

    def flush(self) -> None:
        if self.paragraph:
            self.out.append(inline(" ".join(self.paragraph)) + "\n")
            self.paragraph = []

    def convert(self) -> str:
        i = 0
        while i < len(self.lines):
            i = self.block(i)
        self.flush()
        return "\n".join(self.out)

    def block(self, i: int) -> int:
        """Convert the block starting at line i; the index of the line after it."""
        line = self.lines[i]
        heading = re.match(r"(#{1,6}) +(.*?) *#*$", line)
        image = re.fullmatch(r"!\[([^\]]*)\]\(([^)\s]+)\)\s*", line)
        item = re.match(r"( *)([-*]|\d+\.) +(.*)", line)
        if not line.strip():
            self.flush()
            return i + 1
        if line.startswith("```"):
            self.flush()
            end = next(j for j in range(i + 1, len(self.lines)) if self.lines[j].startswith("```"))
            lang = line[3:].strip()
            self.out.append(f"#raw(block: true, lang: {string(lang or 'text')}, "
                            f"{string(chr(10).join(self.lines[i + 1:end]))})\n")
            return end + 1
        if heading:
            self.flush()
            self.out.append(f"{'=' * len(heading[1])} {inline(heading[2])} <{next(self.anchors)}>\n")
            return i + 1
        if line.startswith("|") and i + 1 < len(self.lines) and re.fullmatch(r"\|?[\s:|-]+\|?", self.lines[i + 1]):
            self.flush()
            end = i + 2
            while end < len(self.lines) and self.lines[end].startswith("|"):
                end += 1
            self.out.append(table(self.lines[i:end]) + "\n")
            return end
        if image:
            self.flush()
            self.out.append(self.image(image[1], image[2]) + "\n")
            return i + 1
        if item and not self.paragraph:
            end = i + 1  # continuation lines: indented, not a new item
            while end < len(self.lines) and re.match(r" {2,}\S", self.lines[end]) and not re.match(
                    r" *([-*]|\d+\.) ", self.lines[end]):
                end += 1
            text = " ".join([item[3], *(line.strip() for line in self.lines[i + 1:end])])
            marker = "+" if item[2][0].isdigit() else "-"
            self.out.append(f"{'  ' * (len(item[1]) // 2)}{marker} {inline(text)}")
            return end
        self.paragraph.append(line.strip())
        return i + 1


def to_typst(markdown: str, base: str | Path = ".", root: str | Path = ".") -> str:
    """The Typst source of a Markdown document; `base` is the folder its relative image paths start from and
    `root` the folder the compiler may read (every image must be inside it)."""
    title = next((text for level, text, _ in headings(markdown) if level == 1), "writeup")
    return PREAMBLE.format(title=string(title)) + "\n" + Converter(markdown, Path(base), Path(root)).convert()


def compile_pdf(markdown_path: str | Path, out: str | Path, root: str | Path = ".") -> None:
    """Typeset the Markdown file as a PDF at `out` (its figures are read from under `root`)."""
    import typst  # the `typst` package from PyPI (this module's own name does not shadow it: absolute import)

    markdown_path = Path(markdown_path)
    source = to_typst(markdown_path.read_text(), markdown_path.parent, root)
    pdf = typst.compile(source.encode(), root=str(Path(root).resolve()), format="pdf", ignore_system_fonts=True)
    partial = Path(out).with_name(Path(out).name + ".tmp")  # renamed into place once whole
    partial.write_bytes(pdf)
    partial.replace(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("markdown_file")
    parser.add_argument("--out", required=True, help="the PDF to write")
    parser.add_argument("--root", default=".", help="the folder the figures are under (default: the working one)")
    parser.add_argument("--typst", help="also write the Typst source here (to read or debug it)")
    args = parser.parse_args(argv)
    if args.typst:
        path = Path(args.markdown_file)
        Path(args.typst).write_text(to_typst(path.read_text(), path.parent, args.root))
    compile_pdf(args.markdown_file, args.out, args.root)


if __name__ == "__main__":
    main()
