"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict` and fetches
nothing while it does, every page is in the navigation, the generated parts (the config reference,
the exit-code table) are what the code gives now, the README is short and links every page (no
page points back into it), and every command's help points to its page."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from edge.cli import app
from edge.config import parse_config
from kit.docs import anchor, section
import gen_docs  # scripts/gen_docs.py (scripts/ is on pytest's pythonpath): the generator the pages are checked against

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _nav() -> list[str]:
    """The pages mkdocs.yml's nav names, read without YAML (mkdocs may not be installed)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n")[1]
    return re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", nav, re.M)


def test_every_page_is_in_the_nav_and_the_nav_names_only_pages() -> None:
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert len(pages) >= 12 and "index.md" in pages
    assert sorted(_nav()) == pages


def test_the_site_fetches_nothing_at_build_time() -> None:
    """Material's web fonts are off and no plugin but the built-in search is enabled (social cards
    and the privacy plugin download at build time)."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^  font: false$", text, re.M)
    block = re.search(r"^plugins:\n((?:  - .+\n)+)", text, re.M)
    assert block is not None and re.findall(r"^  - (\S+)$", block.group(1), re.M) == ["search"]


def test_the_site_builds_strict_with_the_network_refused(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        print("skipped: mkdocs or mkdocs-material is not installed (the docs extra: pip install -e '.[docs]')")
        pytest.skip("mkdocs or mkdocs-material is not installed (the docs extra: pip install -e '.[docs]')")
    with socket.socket() as closed:  # bound, never listening: a proxy that refuses every connection
        closed.bind(("127.0.0.1", 0))
        proxy = "http://127.0.0.1:%d" % closed.getsockname()[1]
        env = {**os.environ, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy, "https_proxy": proxy,
               "NO_PROXY": "", "no_proxy": "", "NO_MKDOCS_2_WARNING": "1"}
        site, in_repo = tmp_path / "site", (ROOT / "build" / "site").exists()
        run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                              "-d", str(site)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # opened from disk every page is a file and every link names one (use_directory_urls: false)
    built = {p.stem for p in site.glob("*.html")} - {"404"}
    assert built == {Path(p).stem for p in _nav()} and not list(site.glob("*/index.html"))
    hrefs = re.findall(r'href="([^"#:]+)"', (site / "index.html").read_text())
    assert hrefs and all(h.endswith((".html", ".css", ".png", ".svg", ".xml")) for h in hrefs), hrefs
    assert not re.search(r"<script[^>]+src=\"https?://", "".join(p.read_text() for p in site.glob("*.html")))
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()
    _served_as_the_home_page_says(site)
    # a backslash before a pipe inside a code span is shown as written (`ls\\|verify`): the
    # generated tables write none, and no page may
    shown = {p.relative_to(site).as_posix() for p in site.rglob("*.html") if "\\|" in p.read_text()}
    assert shown == set()
    assert (ROOT / "build" / "site").exists() == in_repo  # built into the temp dir, not the checkout


def _served_as_the_home_page_says(site: Path) -> None:
    """docs/index.md's one line that serves the built site (for its search), run as written but
    on a free port and this build: the search index and the pages are there to fetch."""
    import json
    import urllib.request

    from kit import dies_with_us

    (line,) = re.findall(r"^python3 -m http\.server .*$", section("Building this site"), re.M)
    argv = [sys.executable if w == "python3" else str(site) if w == "build/site" else "0" if w == "8000" else w
            for w in line.split()]
    server = subprocess.Popen(dies_with_us(argv), stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert server.stdout is not None
        port = int(re.search(r"port (\d+)", server.stdout.readline()).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/search/search_index.json", timeout=30) as r:
            assert len(json.loads(r.read())["docs"]) > 100
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/commands.html", timeout=30) as r:
            assert b"edge ota verify" in r.read()
    finally:
        server.kill()
        server.wait(timeout=30)


def test_the_generated_parts_are_what_the_code_gives() -> None:
    assert gen_docs.stale() == [], "run: .venv/bin/python scripts/gen_docs.py --write"


def test_every_config_key_has_its_meaning_beside_it_in_the_code() -> None:
    assert gen_docs.undocumented_keys() == []


def test_every_command_and_option_has_its_help_in_the_code() -> None:
    """docs/commands.md is the CLI's own help: a command or option without one would be a row
    that says nothing (the generated reference shows every one of them)."""
    from docgen import commands

    assert commands.undocumented() == []
    reference = (DOCS / "commands.md").read_text()
    for words, cmd, ctx in commands.tree():
        assert f"### {' '.join(('edge', *words))}\n" in reference or not words
        for p in cmd.get_params(ctx):
            if p.param_type_name == "option" and "--help" not in p.opts:
                assert f"`{p.get_help_record(ctx)[0]}`" in reference, (words, p.opts)


def _reference_rows() -> dict[str, list[tuple[str, str]]]:
    """(key, default cell) of each table of docs/config.md."""
    tables: dict[str, list[tuple[str, str]]] = {}
    for header, body in re.findall(r"^### `\[+([\w.]+)\]+`\n(.*?)(?=^### |\Z)", (DOCS / "config.md").read_text(), re.M | re.S):
        tables[header] = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", body, re.M)
    return tables


def test_a_config_of_every_documented_default_is_the_default_config() -> None:
    """Each key of the reference, set to its documented default in a real TOML file, parses, and
    gives the same config as leaving it out: the reference names real keys with their defaults."""
    tables = _reference_rows()
    assert {"server", "paths", "models", "models.prefixes", "warmup", "engines", "ota"} <= set(tables)
    lines, bare = [], ['[[models]]\nname = "m"\npath = "builtin:gemma3-270m"\n']
    for table in ("server", "warmup", "ota", "models"):
        lines.append("[[models]]\nname = \"m\"\npath = \"builtin:gemma3-270m\"" if table == "models" else f"[{table}]")
        for key, default in tables[table]:
            value = default.strip()
            if value.startswith("`") and key not in ("name", "path"):
                lines.append(f"{key} = {value.strip('`')}")
    documented, plain = parse_config("\n".join(lines) + "\n"), parse_config(bare[0])
    assert documented.server == plain.server and documented.warmup == plain.warmup and documented.ota == plain.ota
    assert documented.models == plain.models
    assert sum(len(tables[t]) for t in ("server", "warmup", "ota", "models")) > 50


def test_the_readme_is_short_and_links_every_page() -> None:
    """README.md is the short entry (at most 250 lines) with a link to every page of docs/, each
    anchor it links to a heading of that page."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(docs/([\w-]+\.md)(?:#([\w-]+))?\)", readme)
    assert {page for page, _ in links} == {p.name for p in DOCS.glob("*.md")}
    for page, frag in links:
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M)
        assert not frag or frag in {anchor(h) for h in headings}, f"README links {page}#{frag}: no such heading"


def test_no_page_or_message_points_into_the_readme() -> None:
    """The move is done: no docs page is a stub that sends the reader to a README section, and no
    message, help text or comment of edge/ names one (they name the docs page)."""
    # the stubs' own words, spelled apart so that a grep for them finds only a page that has them
    words = [" ".join(w) for w in (("Until", "the", "move"), ("filled", "when"))]
    stale = re.compile("|".join(["README" + r"(?:\.md#| section|: | \")", *words]))
    files = [*DOCS.glob("*.md"), *(ROOT / "edge").rglob("*.py"), *(ROOT / "systemd").glob("*")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in stale.finditer(p.read_text())]
    assert found == []


def _commands(cmd: object, words: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    sub = getattr(cmd, "commands", None)
    out = [(words, cmd)]
    for name, c in (sub or {}).items():
        out += _commands(c, (*words, name))
    return out


def test_every_command_help_points_to_its_page() -> None:
    """`edge --help` and every command's and group's help end with a "Docs: docs/<page>.md" line
    naming a page there is, and a heading of it where the line names one (`#anchor`); the line fits
    80 columns, so that a terminal's help does not break the link."""
    root = typer.main.get_command(app)
    missing, pages = [], {p.name for p in DOCS.glob("*.md")}
    for words, cmd in _commands(root):
        found = re.findall(r"Docs: docs/([\w-]+\.md)(?:#([\w-]+))?$", getattr(cmd, "help", None) or "", re.M)
        page, frag = found[0] if len(found) == 1 else ("", "")
        headings = re.findall(r"^#+ (.+)$", (DOCS / page).read_text(), re.M) if page in pages else []
        if page not in pages or (frag and frag not in {anchor(h) for h in headings}) \
                or len(f"  Docs: docs/{page}#{frag}") > 80:
            missing.append(" ".join(("edge", *words)))
    assert len(_commands(root)) > 25
    assert missing == []


def test_the_prompt_cache_bound_the_readme_states_is_the_measured_one() -> None:
    """docs/api.md's "Reproducibility" states how far an answer continued from a cached prefix strays from
    a fresh prefill: the sentence `scripts/bench cache_bound` makes from its recorded result
    (tests/fixtures/cache_bound.json: >= 200 prompts of several lengths on the real Gemma 3 270M),
    and that result's summary is the one its rows give."""
    import json

    from benchmarks import cache_bound

    result = json.loads((ROOT / "tests" / "fixtures" / "cache_bound.json").read_text())
    rows = result["rows"]
    assert len(rows) >= 200 and len({r["prefix_tokens"] for r in rows}) >= 3
    assert all(r["reused"] >= r["prefix_tokens"] - 1 for r in rows)  # each cached answer did reuse its prefix
    assert cache_bound.summary(rows) == result["summary"]
    stated = " ".join(section("Reproducibility").split())
    assert cache_bound.statement(result) in stated
    shortest = [r for r in rows if r["prefix_tokens"] == min(result["prefix_tokens"])]
    assert f"with the {shortest[0]['prefix_tokens']}-token prefixes no logprob differed at all" in stated
    assert all(r["max"] == 0 and r["parted_at"] is None for r in shortest)


def test_a_section_is_found_by_its_title_wherever_it_is() -> None:
    """kit.docs.section: what tests holding a sentence read, README or docs page alike."""
    keywords = section("json_schema keywords")
    assert "| enforced |" in keywords and "## Grammar bounds" not in keywords
    with pytest.raises(LookupError, match="found 0"):
        section("A heading no page has")
    with pytest.raises(LookupError, match="found 0"):
        section("unix_socket = \"/run/edge/edge.sock\"")  # a TOML comment in a code block is no heading
