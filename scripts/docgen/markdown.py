"""Text from the code made into Markdown that renders as written: code spans that hold any
character (a backtick in one gets a longer fence), table cells on one line whose pipes split
nothing, and `<`, `>` and `*` outside code shown, not taken for HTML or emphasis. Inside a code
span nothing is escaped: Python-Markdown renders a backslash there literally (`ls\\|verify`
would show its backslash), and its tables extension splits no cell at a pipe inside one."""

from __future__ import annotations

import re

_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def code(text: str) -> str:
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _outside_code(text: str, fix: "callable[[str], str]") -> str:  # type: ignore[valid-type]
    out, last = [], 0
    for m in _SPAN.finditer(text):
        out += [fix(text[last:m.start()]), m.group(0)]
        last = m.end()
    return "".join(out + [fix(text[last:])])


def _plain(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def prose(text: str) -> str:
    """Paragraphs of a help text: its lines as click wraps them joined, blank lines kept."""
    paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    return "\n\n".join(_outside_code(p, _plain) for p in paras)


def cell(text: str) -> str:
    """One table cell: on one line, a pipe outside code escaped, HTML's characters shown."""
    return _outside_code(" ".join(text.split()), lambda t: _plain(t).replace("|", "\\|"))
