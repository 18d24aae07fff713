"""A docs page's examples as a reader runs them: its fenced blocks in order, each request (a
`curl` command in a `sh` block, or a Python program using the `openai` client) paired with the
answer shown right after it (a `json` block, or a `text` block of server-sent events or of what
the program prints), run as written against a real service (`http://127.0.0.1:8088`, the address
the pages use, pointed at the service under test) and compared with the answer shown.

Answers are compared by their shape, not by their generated text: the same keys at every level,
the same JSON types, the same kinds of list items, and the same value where a value is part of
the API rather than of the model's output (`object`, `role`, `type`, the model's name, a tool's
name...). A generated token may differ on another CPU (llama.cpp's kernels round differently,
docs/api.md "Reproducibility"); an answer of another form may not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Example", "blocks", "examples", "page_commands", "page_config", "run", "same", "shape", "sse_events",
           "write_answers"]

ROOT = Path(__file__).resolve().parents[2]

ADDRESS = "http://127.0.0.1:8088"
# Values that are the API's, compared as they are; every other string or number only by its type.
STABLE = frozenset({"object", "role", "type", "model", "owned_by", "name", "datatype", "shape",
                    "platform", "status"})
# Objects whose keys are generated tokens (completions' `top_logprobs`).
TOKEN_KEYED = frozenset({"top_logprobs"})
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of every fenced block of the page, in order."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(page.read_text())]


@dataclass(frozen=True)
class Example:
    kind: str  # "curl" or "python"
    request: str
    answer_kind: str  # "json" or "text"
    answer: str


def examples(page: Path) -> list[Example]:
    """Each request block of the page with the answer block right after it (a request shown
    without its answer is an error: the reader could not tell what to expect)."""
    found, bs = [], blocks(page)
    for i, (lang, text) in enumerate(bs):
        kind = "curl" if lang == "sh" and text.lstrip().startswith("curl ") else \
            "python" if lang == "python" and "openai" in text else ""
        if not kind:
            continue
        if i + 1 >= len(bs) or bs[i + 1][0] not in ("json", "text"):
            raise AssertionError(f"{page.name}: the example {text[:60]!r} has no answer block after it")
        found.append(Example(kind, text, bs[i + 1][0], bs[i + 1][1]))
    return found


def run(example: Example, address: tuple[str, int], timeout: float = 300) -> str:
    """The example run as written, its address pointed at `address`; its standard output."""
    text = example.request.replace(ADDRESS, f"http://{address[0]}:{address[1]}")
    argv = ["bash", "-c", text] if example.kind == "curl" else [sys.executable, "-c", text]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "unused")})
    if r.returncode != 0:
        raise AssertionError(f"{example.request[:200]!r} exited {r.returncode}: {r.stderr[-2000:]}")
    return r.stdout


def shape(value: Any, key: str = "") -> Any:
    """What of a JSON value an example's answer promises: its structure and the API's values."""
    if isinstance(value, dict) and key in TOKEN_KEYED:  # {token: logprob}: the keys are the model's
        return {"<token>": sorted({json.dumps(shape(v)) for v in value.values()})}
    if isinstance(value, dict):
        return {k: shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        kinds = {json.dumps(shape(v, key), sort_keys=True) for v in value}
        return ["list", *sorted(kinds)]
    if key == "finish_reason":  # null until a stream's last piece: how a stream is cut is timing
        return "finish_reason"
    if isinstance(value, bool) or value is None:
        return value
    if key in STABLE:
        return value
    return "number" if isinstance(value, (int, float)) else "string"


def sse_events(text: str) -> list[Any]:
    """The `data:` events of a stream: JSON values, and "[DONE]" last."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def page_config(page: Path, d: Path, places: dict[str, str] | None = None) -> Path:
    """The page's TOML block as this checkout and a tmp dir place it: /opt/edge is the checkout,
    each of `places` (a path the page names: the path here) replaced, the state and cache dirs
    the test's (the unit's StateDirectory=/CacheDirectory= on a device)."""
    (toml,) = [text for lang, text in blocks(page) if lang == "toml"]
    for where, here in {"/opt/edge": str(ROOT), **(places or {})}.items():
        toml = toml.replace(where, here)
    cfg = d / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{d / "state"}"\ncache_dir = "{d / "cache"}"\n\n' + toml)
    return cfg


def page_commands(page: Path, cfg: Path, edge: list[str]) -> list[list[str]]:
    """The page's `edge` commands (its plain blocks), as this checkout runs them: sudo and the
    venv's path dropped, /etc/edge/edge.toml the test's config; systemctl is the harness's."""
    out = []
    for lang, text in blocks(page):
        for line in text.splitlines() if lang == "" else []:
            line = re.sub(r"\s#.*$", "", line)
            if "bin/edge " in line:
                words = line.replace("/etc/edge/edge.toml", str(cfg)).replace("/opt/edge", str(ROOT)).split()
                out.append([*edge, *words[words.index(next(w for w in words if w.endswith("bin/edge"))) + 1:]])
    return out


def same(example: Example, got: str) -> None:
    """`got` has the shape of the answer the page shows for `example` (fails showing `got`)."""
    if example.answer_kind == "json":
        assert shape(json.loads(got)) == shape(json.loads(example.answer)), got
    elif example.kind == "curl":  # a stream: the same kinds of events, [DONE] last
        shown, events = sse_events(example.answer), sse_events(got)
        assert events[-1] == shown[-1] == "[DONE]"
        assert {json.dumps(shape(e), sort_keys=True) for e in events[:-1]} == \
               {json.dumps(shape(e), sort_keys=True) for e in shown[:-1]}, got
    else:  # what a program prints: generated text, some of it
        assert got.strip() and example.answer.strip(), got


def write_answers(page: Path, answers: list[tuple[Example, str]]) -> None:
    """Each example's answer block rewritten with what it got (EDGE_WRITE_EXAMPLES=1)."""
    text = page.read_text()
    for example, got in answers:
        body = json.dumps(json.loads(got), indent=2, ensure_ascii=False) + "\n" if example.answer_kind == "json" else got
        head = f"```{example.answer_kind}\n"
        at = text.index(example.request) + len(example.request) + len("```\n\n")
        assert text[at:].startswith(head), text[at:at + 40]
        end = text.index("```", at + len(head))
        text = text[:at + len(head)] + body + text[end:]
    page.write_text(text)
