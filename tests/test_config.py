from pathlib import Path

import pytest

from edge.config import BUILTIN_PREFIX, find_config, load_config, parse_config, state_dir
from edge.errors import EX_CONFIG, ConfigError
from kit.docs import section

MIN = '[[models]]\nname = "m"\npath = "m.gguf"\n'


def err(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(text, source="edge.toml")
    return info.value


def test_minimal_config_fills_defaults_and_resolves_relative_paths(tmp_path: Path) -> None:
    cfg = parse_config(MIN, source="x", base_dir=tmp_path)
    m = cfg.models[0]
    assert m.path == str(tmp_path / "m.gguf")
    assert (m.use_mmap, m.use_mlock, m.require_mlock) == (True, True, False)
    assert cfg.server.host == "127.0.0.1" and cfg.warmup.enabled


@pytest.mark.parametrize("text, field, words", [
    ("[server]\nport = 1\n", "models", "at least one"),
    (MIN + "[server]\nport = 70000\n", "server.port", "[0, 65535]"),
    (MIN + "[server]\nport = \"80\"\n", "server.port", "expected an integer, found a string"),
    ("bogus = 1\n" + MIN, "bogus", "unknown key"),
    (MIN + "typo_key = 1\n", "models[0].typo_key", "expected one of"),
    ('[[models]]\nname = "m"\n', "models[0].path", "required"),
    (MIN + "use_mlock = 1\n", "models[0].use_mlock", "expected a boolean"),
    (MIN + "kind = \"onnx\"\n", "models[0].kind", "expected one of ['gguf']"),
    (MIN + "sha256 = \"abc\"\n", "models[0].sha256", "64 hex digits"),
    (MIN + '[[models]]\nname = "m"\npath = "n"\n', "models[1].name", "duplicate"),
    (MIN + "[warmup]\nprompts = [1]\n", "warmup.prompts[0]", "expected a string"),
    (MIN + "[server]\nunix_socket_mode = \"rw\"\n", "server.unix_socket_mode", "octal"),
])
def test_bad_fields_name_the_field_and_what_was_expected(text: str, field: str, words: str) -> None:
    e = err(text)
    assert e.field == field
    assert words in str(e)
    assert str(e).startswith("edge.toml: ")
    assert e.exit_code == EX_CONFIG


def test_bad_toml_and_missing_file_are_config_errors(tmp_path: Path) -> None:
    assert "not valid TOML" in str(err("[[models]\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_no_config_means_the_embedded_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGE_CONFIG", raising=False)
    cfg = load_config(None)
    assert cfg.models[0].path == BUILTIN_PREFIX + "gemma3-270m"
    monkeypatch.setenv("EDGE_CONFIG", "/x/y.toml")
    assert find_config(None) == Path("/x/y.toml")
    assert find_config("/a.toml") == Path("/a.toml")


def test_state_dir_follows_systemd_then_edge_home(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(MIN)
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/edge-x:/other")
    assert state_dir(cfg) == Path("/var/lib/edge-x")
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("EDGE_HOME", "/tmp/h")
    assert state_dir(cfg) == Path("/tmp/h/state")
    cfg2 = parse_config(MIN + '[paths]\nstate_dir = "/s"\n')
    assert state_dir(cfg2) == Path("/s")


def test_the_documented_example_config_is_valid() -> None:
    """docs/config.md's commented example (found by its section title) is a valid config."""
    example = section("A commented example").split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = parse_config(example, source="docs/config.md")
    assert cfg.models[0].path == BUILTIN_PREFIX + "gemma3-270m"
    assert cfg.warmup.long_prefill_fraction == 0.5


@pytest.mark.parametrize("text, field, words", [
    (MIN + '[server]\nlog_level = "verbose"\n', "server.log_level", "expected one of ['debug', 'info'"),
    (MIN + "[server]\nmax_connections = 0\n", "server.max_connections", "[1, 1048576]"),
    (MIN + "[server]\nheader_timeout_s = 0\n", "server.header_timeout_s", "[0.1, 3600]"),
    (MIN + "[server]\nmax_body_bytes = 10\n", "server.max_body_bytes", "[1024, 2147483648]"),
    (MIN.replace('"m"', '"a/b"'), "models[0].name", "expected a name without"),
    (MIN.replace('"m"', '""'), "models[0].name", "found ''"),
    (MIN + '[server]\nhost = ""\n', "server.host", "empty string"),
    (MIN + '[[models]]\nname = "n"\npath = "builtin:nope"\n', "models[1].path",
     "unknown builtin model 'nope'; expected one of ['builtin:gemma3-270m']"),
    # TOML has nan and inf, and every range check passed nan
    (MIN + "[server]\nstream_interval_ms = nan\n", "server.stream_interval_ms", "a finite number, found nan"),
    (MIN + "[server]\ndrain_timeout_s = -nan\n", "server.drain_timeout_s", "a finite number, found nan"),
    (MIN + "[server]\nheader_timeout_s = inf\n", "server.header_timeout_s", "a finite number, found inf"),
    (MIN + "[warmup]\nbudget_s = nan\n", "warmup.budget_s", "a finite number"),
    (MIN + "flash_attn = 1\n", "models[0].flash_attn", "expected one of ['auto', True, False], found an integer 1"),
])
def test_more_bad_fields(text: str, field: str, words: str) -> None:
    e = err(text)
    assert (e.source, e.field) == ("edge.toml", field) and words in e.message, e.message


ENGINE = '[[engines]]\nname = "e"\nbackend = "onnxruntime"\nonnx_sha256 = "ab"\nprecision = "fp32"\n'


@pytest.mark.parametrize("table, field, words", [
    ('enabled = "yes"', "enabled", "expected one of ['auto', True, False], found 'yes'"),
    ("max_queue_delay_us = -1", "max_queue_delay_us", "expected a value in [0, 1000000], found -1"),
    ("max_queue_delay_us = 0.5", "max_queue_delay_us", "expected an integer, found a float 0.5"),
    ("max_batch_size = 70000", "max_batch_size", "[0, 65536]"),
    ("preferred_batch_size = -2", "preferred_batch_size", "[0, 65536]"),
    ("max_delay_us = 100", "max_delay_us", "unknown key; expected one of ['enabled', 'max_batch_size'"),
])
def test_bad_batching_fields_name_the_engines_field(table: str, field: str, words: str) -> None:
    e = err(ENGINE + "[engines.batching]\n" + table + "\n")
    assert (e.source, e.field) == ("edge.toml", f"engines[0].batching.{field}") and words in e.message, e.message


def test_batching_defaults_batch_where_the_engine_can_without_waiting() -> None:
    b = parse_config(ENGINE, source="x").engines[0].batching
    assert (b.enabled, b.max_queue_delay_us, b.max_batch_size, b.preferred_batch_size) == ("auto", 0, 0, 0)
    b = parse_config(ENGINE + "[engines.batching]\nenabled = false\nmax_queue_delay_us = 500\n",
                     source="x").engines[0].batching
    assert (b.enabled, b.max_queue_delay_us) == (False, 500)


def test_unwritable_state_or_cache_dir_is_a_config_error(tmp_path: Path) -> None:
    from edge.config import check_writable

    (tmp_path / "file").write_text("not a folder")
    ok = parse_config(MIN + f'[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "c"}"\n',
                      source="edge.toml")
    check_writable(ok)
    assert not any(p.name.startswith(".edge-write-probe") for p in (tmp_path / "s").iterdir())
    bad = parse_config(MIN + f'[paths]\nstate_dir = "{tmp_path / "s"}"\ncache_dir = "{tmp_path / "file" / "c"}"\n',
                       source="edge.toml")
    with pytest.raises(ConfigError) as info:
        check_writable(bad)
    assert info.value.field == "paths.cache_dir" and str(tmp_path / "file" / "c") in info.value.message
    assert info.value.exit_code == EX_CONFIG
