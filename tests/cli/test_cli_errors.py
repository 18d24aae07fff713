"""Bad inputs to the CLI: each one a one-line error naming the file, field or option and what
was expected, with the exit code the docs give, and never a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from edge.timing import StartTimer, write_report
from kit import EDGE, write_config


def edge(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run([*EDGE, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.fixture()
def cfg(tmp_path: Path, tiny_gguf: Path) -> Path:
    return write_config(tmp_path / "edge.toml", tiny_gguf)


# -- edge status: damaged reports, a state_dir that is a file, --svg checked first -----------------
@pytest.mark.parametrize("text", ['{"broken', "[1,2]", "{}", '{"pid": 1, "phases": [{"name": "a"}]}'])
@pytest.mark.parametrize("flags", [[], ["--json"], ["--svg", "t.svg"]])
def test_status_names_a_damaged_start_report(cfg: Path, text: str, flags: list[str]) -> None:
    (cfg.parent / "state").mkdir()
    (cfg.parent / "state" / "last-start.json").write_text(text)
    r = edge("status", "--config", str(cfg), *flags, cwd=cfg.parent)
    assert r.returncode == 1
    assert f"report {cfg.parent / 'state' / 'last-start.json'} is unreadable: " in r.stderr


def test_status_shows_the_good_start_beside_a_damaged_failed_start(cfg: Path) -> None:
    write_report(StartTimer().report(sockets=["127.0.0.1:1"]), cfg.parent / "state")
    (cfg.parent / "state" / "last-failed-start.json").write_text('{"x')
    r = edge("status", "--config", str(cfg))
    assert r.returncode == 1 and r.stdout.startswith("last start: ")
    assert r.stderr.strip().splitlines() == [
        f"edge: report {cfg.parent / 'state' / 'last-failed-start.json'} is unreadable: "
        "not valid JSON (Unterminated string starting at: line 1 column 2 (char 1))"]


def test_status_shows_a_reload_that_failed_before_the_memory_guard(cfg: Path) -> None:
    from edge.timing import ReloadTimer

    write_report(StartTimer().report(sockets=["127.0.0.1:1"]), cfg.parent / "state")
    write_report(ReloadTimer().report(kind="reload", error="models[0].path: no such file", memory=None,
                                      mode=None, kept=[], loaded=[]), cfg.parent / "state", kind="reload")
    r = edge("status", "--config", str(cfg), "--svg", "t.svg", cwd=cfg.parent)
    assert r.returncode == 0, r.stderr
    assert "FAILED after" in r.stdout and "mode: not decided" in r.stdout
    assert "mode None" not in (cfg.parent / "t.svg").read_text()


def test_status_of_a_state_dir_that_is_a_file_is_a_config_error(cfg: Path) -> None:
    (cfg.parent / "state").write_text("")
    r = edge("status", "--config", str(cfg))
    assert r.returncode == 78
    assert r.stderr.strip() == f"edge: error: {cfg}: paths.state_dir: {cfg.parent / 'state'} is not a directory"


@pytest.mark.parametrize("where", ["dir", "/proc/t.svg", "/proc/edge-x/t.svg", "missing/t.svg"])
def test_status_checks_the_svg_path_before_printing(cfg: Path, where: str) -> None:
    write_report(StartTimer().report(sockets=[]), cfg.parent / "state")
    (cfg.parent / "dir").mkdir()
    r = edge("status", "--config", str(cfg), "--svg", where, cwd=cfg.parent)
    assert r.returncode == 2 and "--svg" in r.stderr and r.stdout == ""


# -- edge build-engine: a recipe that is a folder, or not UTF-8 -------------------------------------
@pytest.mark.parametrize("kind, words", [("dir", "is a directory; expected a recipe file"),
                                         ("latin1", "expected a UTF-8 TOML recipe, found a byte 0xff")])
def test_build_engine_names_a_recipe_it_cannot_read(tmp_path: Path, kind: str, words: str) -> None:
    recipe = tmp_path / "r.toml"
    if kind == "dir":
        recipe.mkdir()
    else:
        recipe.write_bytes(b'name = "\xff\xfe"\n')
    r = edge("build-engine", str(recipe))
    assert r.returncode == 78 and r.stderr.startswith(f"edge: error: {recipe}: {words}")
    assert len(r.stderr.strip().splitlines()) == 1


def test_warmup_checks_the_svg_path_before_the_rehearsal(cfg: Path) -> None:
    r = edge("warmup", "--config", str(cfg), "--svg", str(cfg.parent))
    assert r.returncode == 2 and f"{cfg.parent} is a directory; expected a file name" in r.stderr
    assert not (cfg.parent / "state").exists()  # nothing ran


# -- edge ota keygen: -o where no file can be made ---------------------------------------------------
@pytest.mark.parametrize("out, words", [("/proc/edge-x/key", "its folder /proc/edge-x does not exist"),
                                        ("/proc/key", "cannot write in /proc"),
                                        (".", "is a directory; expected a file name")])
def test_ota_keygen_checks_its_output_path(tmp_path: Path, out: str, words: str) -> None:
    r = edge("ota", "keygen", "-o", out, cwd=tmp_path)
    assert r.returncode == 2 and "'-o' / '--out'" in r.stderr and words in r.stderr
    assert list(tmp_path.iterdir()) == []


# -- edge ota verify: read only, and explicit when nothing is installed ------------------------------
@pytest.mark.parametrize("state", ["state", "/proc/edge-state"])
def test_ota_verify_with_nothing_installed_says_so_and_makes_nothing(cfg: Path, state: str) -> None:
    text = cfg.read_text().replace(str(cfg.parent / "state"), state if state.startswith("/") else str(cfg.parent / state))
    cfg.write_text(text)
    r = edge("ota", "verify", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"versions": {}, "problems": [], "hashed_files": 0, "result": "nothing installed"}
    assert sorted(p.name for p in cfg.parent.iterdir()) == ["edge.toml"]


# -- [warmup] prompts that cannot fit the context: the config is wrong --------------------------------
def test_warmup_prompt_longer_than_the_context_is_a_config_error(cfg: Path) -> None:
    cfg.write_text(cfg.read_text().replace("decode_tokens = 4", f'decode_tokens = 4\nprompts = ["{"word " * 400}"]'))
    r = edge("warmup", "--config", str(cfg))
    assert r.returncode == 78, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f"edge: error: {cfg}: warmup.prompts[0]: is ")


# -- [server]: a socket edge cannot bind is a config error naming the field --------------------------
def _server(cfg: Path, line: str) -> Path:
    cfg.write_text(cfg.read_text().replace('host = "127.0.0.1"', line, 1))
    return cfg


@pytest.mark.parametrize("case, field, words", [
    ("missing", "server.unix_socket", "its folder {d}/missing does not exist"),
    ("long", "server.unix_socket", "expected a path of at most 107 bytes (the AF_UNIX limit)"),
    ("dir", "server.unix_socket", "cannot listen on {d}: a directory is in the way"),
    ("file", "server.unix_socket", "a file that is not a socket is in the way"),
    ("bad host", "server.host", "expected an IP address or a host name, found 'not a host!!'"),
    ("not local", "server.host", "cannot listen on 192.0.2.1:0: Cannot assign requested address"),
])
def test_serve_names_the_server_field_it_cannot_listen_on(cfg: Path, case: str, field: str, words: str) -> None:
    d = cfg.parent
    (d / "file.sock").write_text("")
    line = {"missing": f'unix_socket = "{d}/missing/e.sock"', "long": f'unix_socket = "{d}/{"x" * 120}.sock"',
            "dir": f'unix_socket = "{d}"', "file": f'unix_socket = "{d}/file.sock"',
            "bad host": 'host = "not a host!!"', "not local": 'host = "192.0.2.1"'}[case]
    r = edge("serve", "--config", str(_server(cfg, line)))
    assert r.returncode == 78, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"edge: error: {cfg}: {field}: ") and words.format(d=d) in last, last


def test_serve_on_a_port_in_use_is_not_a_config_error(cfg: Path) -> None:
    with socket.socket() as taken:  # a port the kernel picked, held for the test
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg.write_text(cfg.read_text().replace("port = 0", f"port = {port}"))
        r = edge("serve", "--config", str(cfg))
    assert r.returncode == 70 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr


# -- edge reload: a config that is not there; no service to ask ----------------------------------------
def test_reload_of_a_missing_config_says_so(tmp_path: Path) -> None:
    r = edge("reload", "--config", str(tmp_path / "none.toml"))
    assert r.returncode == 78 and r.stderr.strip() == f"edge: error: {tmp_path / 'none.toml'}: config file does not exist"


def test_reload_with_no_service_is_unavailable(cfg: Path) -> None:
    r = edge("reload", "--config", str(cfg))
    assert r.returncode == 69 and r.stderr.strip().startswith(
        f"edge: error: no edge service answers on {cfg.parent / 'state' / 'control.sock'}: ")


# -- bad arguments are usage errors (exit 2) naming the option, checked before any work ---------------
@pytest.mark.parametrize("args, option", [
    (["bench", "--url", "notaurl"], "'--url'"),
    (["bench", "--url", "ftp://x"], "'--url'"),
    (["ota", "status", "--field", "bogus"], "'--field'"),
    (["units", "install", "--prefix", "/proc/edge-x"], "'--prefix'"),
    (["units", "install", "--prefix", "/etc/hostname"], "'--prefix'"),
    (["units", "print", "--listen", "bogus"], "'--listen'"),
    (["units", "print", "--listen", "127.0.0.1:99999"], "'--listen'"),
    (["units", "print", "--edge", "bin/edge"], "'--edge'"),
    (["units", "print", "--unix-socket", "rel.sock"], "'--unix-socket'"),
    (["fleet", "agent", "--remote-write", "notaurl"], "'--remote-write'"),
    (["fleet", "agent", "--remote-write", "http://fleet/api/v1/write", "--interval", "bogus"], "'--interval'"),
    (["engines", "ls", "--store", "/nonexistent-store"], "--store"),  # a typo is no empty store
    (["engines", "verify", "--store", "/nonexistent-store"], "--store"),
    (["engines", "gc", "--store", "/etc/hostname"], "--store"),
])
def test_bad_arguments_are_usage_errors(tmp_path: Path, args: list[str], option: str) -> None:
    r = edge(*args, cwd=tmp_path)
    assert r.returncode == 2 and f"Invalid value for {option}" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
