"""`edge ota build` and its neighbours refuse bad inputs before any work, each with a one-line
error naming the option or file and what was expected, with the exit code the docs give:
2 for an argument, 78 for the config, never a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from edge.ota.bundle import build_bundle, keygen
from harness.ggufgen import write_tiny_llama
from kit import EDGE
from kit.ota import cfg_text


def edge(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([*EDGE, "ota", *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def error_line(r: subprocess.CompletedProcess) -> str:
    """The one line that says what is wrong (a usage error also prints Usage and Try lines)."""
    lines = [line for line in r.stderr.splitlines() if line.startswith(("Error:", "edge: error:"))]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture()
def host(tmp_path: Path) -> Path:
    """A signing key, a model a.gguf, and a config that serves models/a.gguf, in one folder."""
    keygen(tmp_path / "k.key")
    write_tiny_llama(tmp_path / "a.gguf", seed=1)
    (tmp_path / "c.toml").write_text(cfg_text("a.gguf"))
    return tmp_path


def build(host: Path, *args: str, **flags: str) -> subprocess.CompletedProcess:
    opts = {"--version": "1.0.0", "--key": "k.key", "--config": "c.toml", "--model": "a.gguf", "-o": "x.edgeb",
            **flags}
    argv = [a for k, v in opts.items() if v is not None for a in (k, v)]
    return edge("build", *argv, *args, cwd=host)


def leftovers(host: Path) -> list[str]:
    return sorted(p.name for p in host.rglob(".*.tmp"))


# 1. -o: a missing folder or a directory is a usage error, found before the work
@pytest.mark.parametrize("out, words", [("nodir/x.edgeb", "nodir/x.edgeb: its folder nodir does not exist"),
                                        ("d", "d is a directory; expected a file name")])
def test_build_checks_out_first(host: Path, out: str, words: str) -> None:
    (host / "d").mkdir()
    r = build(host, **{"-o": out})
    assert r.returncode == 2 and r.stdout == ""
    assert "'-o' / '--out'" in error_line(r) and words in error_line(r)
    assert leftovers(host) == []


def test_build_bundle_removes_its_temp_file_when_the_write_fails(host: Path) -> None:
    (host / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        build_bundle(host / "d", version="1.0.0", files=[(host / "a.gguf", "models/a.gguf", "model", None)],
                     config=cfg_text("a.gguf"), key=host / "k.key")
    assert leftovers(host) == [] and list((host / "d").iterdir()) == []


# 2. --config that is not there: the config error every command gives
def test_build_names_a_missing_config(host: Path) -> None:
    r = build(host, **{"--config": "nonexist.toml"})
    assert r.returncode == 78
    assert error_line(r) == "edge: error: nonexist.toml: config file does not exist"
    assert not (host / "x.edgeb").exists()


# 3. --engines that is not a folder is not an empty store
@pytest.mark.parametrize("what, found", [("missing", "does not exist"), ("file", "is not a folder")])
def test_build_names_engines_that_is_no_folder(host: Path, what: str, found: str) -> None:
    (host / "file").write_text("")
    r = build(host, **{"--engines": what})
    assert r.returncode == 2 and not (host / "x.edgeb").exists()
    assert error_line(r) == (f"Error: Invalid value for '--engines': {what} {found}; "
                             "expected an engine store (a folder that exists)")


# 4. --model: a directory or a missing file
@pytest.mark.parametrize("model, found", [("d", "is a directory"), ("nonexist.gguf", "does not exist")])
def test_build_names_a_model_that_is_no_file(host: Path, model: str, found: str) -> None:
    (host / "d").mkdir()
    r = build(host, **{"--model": model})
    assert r.returncode == 2 and not (host / "x.edgeb").exists()
    assert error_line(r) == f"Error: Invalid value for '--model': {model} {found}; expected a GGUF model file"


# 5. --version: the installer's grammar, as a usage error
@pytest.mark.parametrize("version", ["v1.2.3", "1.2", "", "../../x"])
def test_build_names_a_version_outside_the_grammar(host: Path, version: str) -> None:
    r = build(host, **{"--version": version})
    assert r.returncode == 2 and not (host / "x.edgeb").exists()
    line = error_line(r)
    assert line.startswith(f"Error: Invalid value for '--version': version {version!r} ")
    assert "expected MAJOR.MINOR.PATCH[-PRERELEASE] (e.g. 1.4.0 or 1.5.0-rc.1)" in line


# 6. a config that names a model the bundle does not carry: refused at build, as devices would
def test_build_refuses_a_config_naming_a_file_the_bundle_lacks(host: Path) -> None:
    write_tiny_llama(host / "b.gguf", seed=2)
    r = build(host, **{"--model": "b.gguf"})
    assert r.returncode == 78 and not (host / "x.edgeb").exists() and leftovers(host) == []
    assert error_line(r) == ("edge: error: c.toml: its config references files the bundle does not carry "
                             "(nor lists): models[0].path = models/a.gguf; the bundle lists models/b.gguf")
    assert build(host).returncode == 0  # the same config with the model it names


# 7. --pubkey that is not there: install and inspect say the same
@pytest.mark.parametrize("command", ["install", "inspect", "verify"])
def test_a_missing_pubkey_is_one_usage_error(host: Path, command: str) -> None:
    assert build(host).returncode == 0
    (host / "dev.toml").write_text(f'[paths]\nstate_dir = "{host / "state"}"\n' + cfg_text("a.gguf"))
    args = {"install": ["x.edgeb", "--config", "dev.toml", "--no-activate"], "inspect": ["x.edgeb"],
            "verify": ["--config", "dev.toml"]}[command]
    r = edge(command, *args, "--pubkey", "nonexist.pub", cwd=host)
    assert r.returncode == 2 and not (host / "state" / "ota").exists()
    assert error_line(r) == ("Error: Invalid value for '--pubkey': nonexist.pub does not exist; expected an "
                             "Ed25519 public key file (PEM, as `edge ota keygen` writes OUT.pub)")


# 8. keygen -o: a key that is there is never overwritten
def test_keygen_refuses_to_overwrite_a_key(host: Path) -> None:
    before = (host / "k.key").read_bytes(), (host / "k.key.pub").read_bytes()
    r = edge("keygen", "-o", "k.key", cwd=host)
    assert r.returncode == 2
    assert error_line(r) == "Error: Invalid value for '-o' / '--out': k.key exists; refusing to overwrite a key"
    assert ((host / "k.key").read_bytes(), (host / "k.key.pub").read_bytes()) == before


def test_build_names_a_missing_signing_key(host: Path) -> None:
    r = build(host, **{"--key": "nonexist.key"})
    assert r.returncode == 2 and not (host / "x.edgeb").exists()
    assert error_line(r) == ("Error: Invalid value for '--key': nonexist.key does not exist; "
                             "expected an Ed25519 signing key (edge ota keygen)")
