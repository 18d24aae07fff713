"""The documentation as tests read it: README.md and the pages of docs/, and one section of them
found by its heading wherever it is. A test that holds a sentence to the code asks for the section
by its title (`section("json_schema keywords")`), so it follows the text when the text moves from
the README into a docs page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
__all__ = ["anchor", "pages", "section"]


def pages() -> dict[str, str]:
    """Every documentation file's text by its path from the repository root: README.md first."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc make it from plain words (`HTTP API` -> `http-api`)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def section(title: str) -> str:
    """The text under the one heading (of any level) whose words are `title`, up to the next
    heading of the same or a higher level; fails naming the files when there is none or several."""
    fenced = re.compile(r"^```.*?^```", re.M | re.S)  # a `# comment` in a code block is no heading
    found = []
    for path, text in pages().items():
        plain = fenced.sub(lambda m: re.sub(r"^#", " ", m.group(0), flags=re.M), text)
        for m in re.finditer(rf"^(#+) {re.escape(title)}[ \t]*$", plain, re.M):
            level = len(m.group(1))
            end = re.compile(rf"^#{{1,{level}}} ", re.M).search(plain, m.end())
            found.append((path, text[m.end():end.start() if end else len(text)]))
    if len(found) != 1:
        raise LookupError(f"expected one section titled {title!r} in README.md and docs/, found "
                          f"{len(found)}: {[p for p, _ in found]}")
    return found[0][1]
