"""Exit codes of `edge serve` and the CLI (one table: edge.errors.EXIT_CODES, which both tables
of docs/faults.md must match), and clean stops: what an operator sees in the journal."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import sys

from edge import toml
from edge.errors import EX_CONFIG, EX_DATAERR, EX_SOFTWARE, EX_UNAVAILABLE, EXIT_CODES
from edge.host.units import UnitOptions, render_service
from kit import EDGE, post, write_config
from kit.docs import section

ROOT = Path(__file__).resolve().parent.parent


def test_sigterm_during_warmup_exits_0_with_one_info_line(tmp_path: Path, tiny_gguf: Path, service) -> None:
    # A warm-up long enough to be inside it when the signal comes: 300 workload prompts.
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf,
                       extra='prompts = ["Hello there"]\n'.replace('"Hello there"', ", ".join(['"Hello"'] * 300)))
    text = cfg.read_text().replace("decode_tokens = 4", "decode_tokens = 64")
    cfg.write_text(text)
    pid1 = service(cfg, ready=False)
    pid1.wait_for("STATUS", "warming up tiny")
    code = pid1.stop(signal.SIGTERM)
    log = pid1.log_tail(100_000)
    assert code == 0, log
    assert not any("READY" in n.fields for n in pid1.notifications), "warm-up ended before the signal"
    assert "stopped by SIGTERM before ready" in log
    assert "Traceback" not in log and " ERROR " not in log, log


def _serve(cfg: Path, *argv: str, pre: str = "") -> subprocess.CompletedProcess:
    """`edge serve` in a subprocess; `pre`: Python run first in it (a test double at a boundary)."""
    code = f"{pre}\nimport sys\nsys.argv = ['edge', 'serve', '--config', {str(cfg)!r}]\n" \
           "from edge.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


def test_bad_log_level_exits_78_naming_file_and_field(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra="")
    cfg.write_text(cfg.read_text().replace("[server]\n", '[server]\nlog_level = "verbose"\n'))
    r = _serve(cfg)
    assert r.returncode == EX_CONFIG, r.stderr
    assert f"{cfg}: server.log_level: expected one of ['debug', 'info', 'warning', 'error', 'critical'], " \
           "found 'verbose'" in r.stderr
    assert "Traceback" not in r.stderr
    doctor = subprocess.run([*EDGE, "doctor", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert doctor.returncode == 1 and "[FAIL] config" in doctor.stdout and "server.log_level" in doctor.stdout


def test_unwritable_state_dir_exits_78_before_the_load(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    (tmp_path / "state").write_text("a file where the state dir should be")
    r = _serve(cfg)
    assert r.returncode == EX_CONFIG, r.stderr
    assert f"paths.state_dir: {tmp_path / 'state'} is not writable (not a folder)" in r.stderr
    assert "loading" not in r.stderr and "Traceback" not in r.stderr  # refused before the load
    doctor = subprocess.run([*EDGE, "doctor", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert "[FAIL] state dir" in doctor.stdout and "[  OK] cache dir" in doctor.stdout, doctor.stdout


def test_internal_error_exits_70_with_its_traceback_once(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    # A bug stand-in: the start itself raises something no one expects.
    r = _serve(cfg, pre="import edge.lifecycle.start\n"
                        "def broken(self): raise KeyError('a bug')\n"
                        "edge.lifecycle.start.ColdStart.run = broken")
    assert r.returncode == EX_SOFTWARE, r.stderr
    assert r.stderr.count("Traceback") == 1 and "KeyError: 'a bug'" in r.stderr
    assert f"exiting {EX_SOFTWARE}" in r.stderr


def test_missing_onnxruntime_exits_69_naming_a_real_extra(tmp_path: Path) -> None:
    recipe = ROOT / "engines" / "mlp-demo.toml"
    cfg = tmp_path / "edge.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n'
                   f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{recipe}"\n')
    r = _serve(cfg, pre="import sys\nsys.modules['onnxruntime'] = None  # not installed")
    assert r.returncode == EX_UNAVAILABLE, r.stderr
    assert "pip install '/opt/edge[ort]'" in r.stderr and "Traceback" not in r.stderr
    assert "ort" in _extras()


def _extras() -> set[str]:
    return set(toml.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_every_missing_package_message_names_a_real_extra() -> None:
    named = set()
    for path in (ROOT / "edge").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r'MissingDependency\("[\w.-]+", "([\w-]+)"', text))
        named |= set(re.findall(r'require\("[\w.]+", "([\w-]+)"', text))
    from edge.lifecycle.backends import _BACKENDS  # a load's backend table: (extra, package, purpose)

    named |= {extra for extra, _, _ in _BACKENDS.values() if extra}
    assert named and named <= _extras(), named - _extras()


def test_unknown_architecture_is_diagnosed(tmp_path: Path, tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    key = b"general.architecture" + (8).to_bytes(4, "little") + (5).to_bytes(8, "little") + b"llama"
    assert data.count(key) == 1
    model = tmp_path / "foreign.gguf"
    model.write_bytes(data.replace(key, key[:-5] + b"zzzzz"))
    cfg = write_config(tmp_path / "edge.toml", model)
    r = _serve(cfg)
    assert r.returncode == EX_DATAERR, r.stderr
    assert "its architecture 'zzzzz' (general.architecture) is not one this llama.cpp knows" in r.stderr
    assert "Traceback" not in r.stderr


def test_n_ctx_beyond_the_trained_context_warns(tmp_path: Path, tiny_gguf: Path, service) -> None:
    pid1 = service(write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=1024))  # trained: 512
    assert "tiny: n_ctx = 1024 is more than the 512 tokens" in pid1.log_tail(100_000)
    status, body = post(pid1.address, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, body


def test_the_exit_code_tables_are_the_errors_table() -> None:
    """docs/faults.md has two: the generated one ("Exit codes of `edge serve`") and the causes in
    detail ("Each exit code's causes"); each names every class under its code, and says "no" to a
    restart exactly where the unit's RestartPreventExitStatus= has the code."""
    prevented = {int(c) for c in re.search(r"RestartPreventExitStatus=([\d ]+)",
                                           render_service(UnitOptions())).group(1).split()}
    for title in ("Exit codes of `edge serve`", "Each exit code's causes"):
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in section(title).splitlines()
                if re.match(r"\| \d+ \|", line)]
        documented = {int(code): (meaning, restarted) for code, meaning, restarted in rows}
        for cls, code in EXIT_CODES.items():
            assert code in documented, f"{cls.__name__} exits {code}: not in the table {title!r}"
            assert f"`{cls.__name__}`" in documented[code][0], (title, cls.__name__, documented[code])
        assert set(documented) == set(EXIT_CODES.values()), title
        for code, (_, restarted) in documented.items():
            if code:
                assert restarted.startswith("no") == (code in prevented), (title, code, restarted)


def test_every_error_class_is_drawn_in_the_tree_with_its_exit_code() -> None:
    """edge.errors' docstring draws the tree: every EdgeError class of edge (edge.device.cuda's
    included; the OTA's have their own, edge/ota/errors.py) is a class of edge.errors, drawn with
    the exit code it ends a command with."""
    import inspect

    import edge.device.cuda  # noqa: F401  (its errors must be edge.errors' own)
    import edge.errors as errors

    drawn = {m.group(1): int(m.group(2)) for m in re.finditer(r"── (\w+)\s+(\d+)\s", errors.__doc__ or "")}

    def walk(cls: type) -> list[type]:
        return [cls, *(c for sub in cls.__subclasses__() for c in walk(sub))]

    classes = {c for c in walk(errors.EdgeError) if not c.__module__.startswith(("edge.ota", "tests", "kit"))
               and c.__module__.startswith("edge")}
    assert {c.__module__ for c in classes} == {"edge.errors"}, {c: c.__module__ for c in classes}
    for cls in classes - {errors.EdgeError, errors.RequestError}:
        assert cls.__name__ in drawn, cls
        code = next(code for base, code in EXIT_CODES.items() if issubclass(cls, base))
        assert drawn[cls.__name__] == code, cls
    assert inspect.getmodule(edge.device.cuda.ContextLost) is errors
