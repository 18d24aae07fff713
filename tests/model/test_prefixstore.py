"""Prefix states on disk (edge.model.prefixstore): real llama.cpp states of tiny GGUF models, real files."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from edge.config import MessageConfig, ModelConfig, PrefixConfig
from edge.errors import ConfigError
from edge.model.generate import GenParams, Job
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.promptcache import lcp
from edge.model.prefixstore import (MAGIC, StateRejected, _learned_path, compute_state, prefix_key, prefix_tokens,
                              read_state, restore_prefixes, save_learned, write_state)

SYSTEM = "Hello world. " * 8
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
    "{{ eos_token }}{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def load(path: Path, n_ctx: int = 512, **fields: object) -> GGUFModel:
    cfg = ModelConfig(name="tiny", path=str(path), n_ctx=n_ctx, n_batch=64, n_threads=1, use_mlock=False,
                      **fields)  # type: ignore[arg-type]
    return load_gguf_model(cfg, read_gguf_info(path))


def greedy(m: GGUFModel, tokens: list[int]) -> tuple[Job, list[float]]:
    j = Job(tokens=tokens, params=GenParams(max_tokens=6, temperature=0, logprobs=1))
    lps = [lp.logprob for p in m.generate(j) for lp in p.logprobs]
    return j, lps


@pytest.fixture()
def declared(tiny_gguf: Path) -> dict[str, object]:
    return {"prefixes": [PrefixConfig(name="sys", text=SYSTEM)]}


def restore(m: GGUFModel, folder: Path, recompute: bool = False) -> list[dict[str, object]]:
    return restore_prefixes(m, folder, "edge.toml", "models[0]", recompute)


def test_a_declared_prefix_is_computed_once_then_restored(tiny_gguf: Path, tmp_path: Path,
                                                          declared: dict[str, object]) -> None:
    first = load(tiny_gguf, **declared)
    try:
        (row,) = restore(first, tmp_path)
        assert row["outcome"] == "computed" and row["why"] == "no saved state" and row["tokens"] == 140
        (saved,) = tmp_path.glob("sys.*.kvstate")
        assert saved.stat().st_size > row["bytes"]
        prompt = first.tokenize_prompt(SYSTEM + "the a")
        computed, computed_lps = greedy(first, prompt)
    finally:
        first.close()
    second = load(tiny_gguf, **declared)  # the next start
    try:
        (row,) = restore(second, tmp_path)
        assert row["outcome"] == "restored" and row["why"] == ""
        restored, restored_lps = greedy(second, prompt)
        assert restored.cached_tokens >= 139
        assert restored_lps == computed_lps  # the same state: the same numbers, bit for bit
    finally:
        second.close()


def test_a_changed_key_recomputes_and_says_which_field(tiny_gguf: Path, tmp_path: Path,
                                                       declared: dict[str, object]) -> None:
    m = load(tiny_gguf, **declared)
    restore(m, tmp_path)
    m.close()
    m = load(tiny_gguf, n_ctx=256, **declared)
    try:
        (row,) = restore(m, tmp_path)
        assert row["outcome"] == "computed" and "n_ctx 512 → 256" in row["why"]
        assert len(list(tmp_path.glob("sys.*.kvstate"))) == 2  # both keys' states are kept
    finally:
        m.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "header", "empty"])
def test_a_damaged_state_file_is_ignored_with_a_warning_and_rewritten(
        tiny_gguf: Path, tmp_path: Path, declared: dict[str, object], damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    m = load(tiny_gguf, **declared)
    try:
        restore(m, tmp_path)
        (path,) = tmp_path.glob("sys.*.kvstate")
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-100] ^= 0xFF
        elif damage == "truncate":
            del data[-1000:]
        elif damage == "magic":
            data[:4] = b"GGUF"
        elif damage == "header":
            data[len(MAGIC) + 4:len(MAGIC) + 8] = b"\xff\xfe{["
        else:
            data.clear()
        path.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="edge"):
            (row,) = restore(m, tmp_path)
        assert row["outcome"] == "computed"
        assert {"flip": "checksum", "truncate": "truncated", "magic": "magic", "header": "header",
                "empty": "magic"}[damage] in row["why"]
        assert "computing it again" in caplog.text
        read_state(path, prefix_key(m), m.tokenize_prompt(SYSTEM))  # rewritten whole: passes every check
    finally:
        m.close()


@pytest.mark.parametrize("state_bytes", [-5, 2**45, "too_long"])
@pytest.mark.parametrize("kind", ["declared", "learned"])
def test_a_header_claiming_a_wrong_state_size_is_rejected_before_any_buffer_is_made(
        tiny_gguf: Path, tmp_path: Path, state_bytes: object, kind: str) -> None:
    """A header's state_bytes was given to bytearray() as it was: -5 a ValueError, 2**45 a
    MemoryError, either an exit 70 at every start (the file stays, systemd restarts)."""
    declared = [PrefixConfig(name="sys", text=SYSTEM)] if kind == "declared" else []
    m = load(tiny_gguf, prefixes=declared, learn_prefixes=0 if declared else 1)
    try:
        if declared:
            restore(m, tmp_path)
            (path,) = tmp_path.glob("sys.*.kvstate")
        else:
            compute_state(m.cache, 0, m.tokenize_prompt(SYSTEM))
            path = _learned_path(tmp_path, prefix_key(m), 0)
            state = m.native.state_bytes(0)
            write_state(path, prefix_key(m), m.tokenize_prompt(SYSTEM), state, kind="learned", hits=3, reused=10)
        data = path.read_bytes()
        head_end = len(MAGIC) + 4 + int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        header = json.loads(data[len(MAGIC) + 4:head_end])
        size = header["state_bytes"]
        header["state_bytes"] = size - 1 if state_bytes == "too_long" else state_bytes
        raw = json.dumps(header).encode()
        path.write_bytes(MAGIC + len(raw).to_bytes(4, "little") + raw + data[head_end:])
        (row,) = restore(m, tmp_path)
        assert row["outcome"] == ("computed" if declared else "ignored")
        assert {-5: "unreadable header (state_bytes -5)", 2**45: f"truncated: {size} of {2**45}",
                "too_long": "longer than its header says"}[state_bytes] in row["why"]
    finally:
        m.close()


def test_the_reason_for_a_recompute_is_the_change_that_made_it(tiny_gguf: Path, tmp_path: Path) -> None:
    for n_ctx, text in ((512, SYSTEM), (256, SYSTEM), (512, SYSTEM + "More.")):
        m = load(tiny_gguf, n_ctx=n_ctx, prefixes=[PrefixConfig(name="sys", text=text)])
        try:
            (row,) = restore(m, tmp_path)
        finally:
            m.close()
    # the newest file is of another key (n_ctx 256), but one of this very key (512) exists: what
    # changed is the prefix's text, not n_ctx
    assert row["why"] == "no saved state for this key (the prefix's tokens changed)"


def test_read_state_checks_tokens_and_key(tiny_gguf: Path, tmp_path: Path) -> None:
    path = tmp_path / "x.kvstate"
    write_state(path, {"a": 1, "n_ctx": 2}, [1, 2, 3], b"state", kind="declared")
    header, state = read_state(path, {"a": 1, "n_ctx": 2}, [1, 2, 3])
    assert state == b"state" and header["kind"] == "declared"
    with pytest.raises(StateRejected, match="other prefix tokens"):
        read_state(path, {"a": 1, "n_ctx": 2}, [1, 2, 4])
    with pytest.raises(StateRejected, match="n_ctx 2 → 3"):
        read_state(path, {"a": 1, "n_ctx": 3})
    with pytest.raises(StateRejected, match="no saved state"):
        read_state(tmp_path / "missing.kvstate", {})
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no temp file left


def test_llama_cpp_refusing_a_state_recomputes(tiny_gguf: Path, tmp_path: Path, declared: dict[str, object]) -> None:
    m = load(tiny_gguf, **declared)
    try:
        restore(m, tmp_path)
        (path,) = tmp_path.glob("sys.*.kvstate")
        header, _ = read_state(path, prefix_key(m))
        write_state(path, header["key"], header["tokens"], b"\0" * 64)  # checks pass, content bad
        (row,) = restore(m, tmp_path)
        assert row["outcome"] == "computed" and "llama.cpp refused" in row["why"]
    finally:
        m.close()


def test_a_prefix_longer_than_the_context_is_a_config_error(tiny_gguf: Path, tmp_path: Path) -> None:
    m = load(tiny_gguf, n_ctx=128, prefixes=[PrefixConfig(name="long", text=SYSTEM)])
    try:
        with pytest.raises(ConfigError) as err:
            restore(m, tmp_path)
        assert err.value.field == "models[0].prefixes[0]" and "'long' is 140 tokens" in str(err.value)
        assert err.value.exit_code == 78
    finally:
        m.close()


def test_prefixes_larger_than_the_cache_name_prompt_cache_mb_and_the_whole_need(
        tiny_gguf: Path, tmp_path: Path) -> None:
    prefixes = [PrefixConfig(name="sys", text=SYSTEM), PrefixConfig(name="two", text="Other words. " * 4)]
    m = load(tiny_gguf, prompt_cache_mb=1, prefixes=prefixes)
    m.cache.limit_bytes = 1000  # smaller than one state (a double of a tiny device's budget)
    try:
        with pytest.raises(ConfigError) as err:
            restore(m, tmp_path)
        sizes = [len(read_state(p, prefix_key(m))[1]) for p in sorted(tmp_path.glob("*.kvstate"))]
        assert len(sizes) == 2  # both states made (and kept for the start after the fix)
        assert err.value.field == "models[0].prompt_cache_mb" and "raise prompt_cache_mb" in str(err.value)
        assert f"({sum(sizes)} bytes)" in str(err.value)  # what both need, not what the first did
    finally:
        m.close()


def test_tools_on_a_declared_prefix_are_checked_like_a_requests(tmp_path: Path, tiny_gguf: Path) -> None:
    from edge.config import load_config

    system = '{role = "system", content = "Be brief."}'
    base = f'[[models]]\nname = "m"\npath = "{tiny_gguf}"\n[[models.prefixes]]\nname = "p"\nmessages = [{system}]\n'
    (tmp_path / "bad.toml").write_text(base + 'tools = [{type = "nonsense"}]\n')
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "bad.toml")
    assert err.value.field == "models[0].prefixes[0].tools[0]" and 'type = "function"' in str(err.value)
    # a template that never mentions tools would leave them out of the prefix: refused
    m = load(tiny_gguf, prefixes=[PrefixConfig(name="p", messages=[MessageConfig("system", "Be brief.")],
                                               tools=TOOLS)])
    try:
        with pytest.raises(ConfigError) as err:
            restore(m, tmp_path)
        assert err.value.field == "models[0].prefixes[0].tools" and "no tool support" in str(err.value)
    finally:
        m.close()


def test_a_chat_prefix_with_tools_is_what_every_chat_request_starts_with(tmp_path: Path) -> None:
    from harness.ggufgen import write_tiny_llama

    gguf = write_tiny_llama(tmp_path / "tools.gguf", chat_template=TOOLS_TEMPLATE)
    system = [MessageConfig(role="system", content="You answer briefly.")]
    m = load(gguf, prefixes=[PrefixConfig(name="agent", messages=system, tools=TOOLS)])
    try:
        (row,) = restore(m, tmp_path / "states")
        prefix = prefix_tokens(m, m.cfg.prefixes[0])
        rendered = m.render_chat([{"role": "system", "content": "You answer briefly."}], TOOLS)[0]
        assert "get_weather;" in rendered  # the tools are in the prefix
        for question in ("What is the weather?", "Hi"):
            msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": question}]
            tokens, _ = m.tokenize_chat(msgs, TOOLS)
            assert tokens[:len(prefix)] == prefix
            job, _ = greedy(m, tokens)
            assert job.cached_tokens >= len(prefix) - 1
        assert row["tokens"] == len(prefix)
    finally:
        m.close()


def test_learned_prefixes_survive_a_restart(tiny_gguf: Path, tmp_path: Path) -> None:
    common = "the world the " * 10
    m = load(tiny_gguf, learn_prefixes=2)
    try:
        for tail in ("a", "e", "o"):
            greedy(m, m.tokenize_prompt(common + tail))
        rows = save_learned(m, tmp_path)
        assert len(rows) == 1 and rows[0]["hits"] == 2
        n = rows[0]["tokens"]
        # the common prefix of the prompts (their last few tokens merge with what follows)
        prompts = [m.tokenize_prompt(common + tail) for tail in ("a", "e", "o")]
        assert n == min(lcp(prompts[0], prompts[1]), lcp(prompts[1], prompts[2])) > 190
        header, _ = read_state(_learned_path(tmp_path, prefix_key(m), 0), prefix_key(m))
        assert header["kind"] == "learned" and header["hits"] == 2 and len(header["tokens"]) == n
    finally:
        m.close()
    m = load(tiny_gguf, learn_prefixes=2)
    try:
        (row,) = restore(m, tmp_path)
        assert row["kind"] == "learned" and row["outcome"] == "restored" and row["tokens"] == n
        greedy(m, m.tokenize_prompt("e t o n " * 10))  # an unrelated request between
        job, _ = greedy(m, m.tokenize_prompt(common + "n"))
        assert job.cached_tokens >= n - 1
    finally:
        m.close()


def test_learned_prefixes_are_saved_when_the_slots_hold_most_of_the_context(tiny_gguf: Path,
                                                                           tmp_path: Path) -> None:
    """At a stop, the idle slots' live cells fill most of the context (a calibration after READY
    and traffic leave them there): they give way so the learned state can be restored and cut,
    never "saved: 0" for want of free cells."""
    common = "the world the " * 10
    m = load(tiny_gguf, learn_prefixes=2, parallel=3)
    try:
        for tail in ("a", "e"):
            greedy(m, m.tokenize_prompt(common + tail))
        for text in ("o n e t " * 40, "x y z w " * 40):  # unrelated prompts, live in their slots
            greedy(m, m.tokenize_prompt(text)[:230])
        held = sum(len(m.cache.live(s)) for s in range(m.native.n_seq + 1))
        assert held > m.n_ctx - len(m.tokenize_prompt(common))  # too few free cells for the restore
        rows = save_learned(m, tmp_path)
        assert len(rows) == 1 and rows[0]["hits"] == 1 and rows[0]["tokens"] > 190
    finally:
        m.close()


def test_a_declared_prefix_is_not_learned_again(tiny_gguf: Path, tmp_path: Path) -> None:
    common = "the world the " * 10
    m = load(tiny_gguf, learn_prefixes=2, prefixes=[PrefixConfig(name="sys", text=SYSTEM)])
    try:
        restore(m, tmp_path)
        for tail in ("a", "e", "o"):  # requests after the declared prefix, and after another one
            greedy(m, m.tokenize_prompt(SYSTEM + tail))
            greedy(m, m.tokenize_prompt(common + tail))
        rows = save_learned(m, tmp_path)
        assert len(rows) == 1 and rows[0]["tokens"] > 190  # the other one; "sys" is declared
        header, _ = read_state(_learned_path(tmp_path, prefix_key(m), 0), prefix_key(m))
        assert header["tokens"][:50] == m.tokenize_prompt(common)[:50]
    finally:
        m.close()


def test_learned_prefixes_of_another_key_are_ignored(tiny_gguf: Path, tmp_path: Path) -> None:
    m = load(tiny_gguf, learn_prefixes=1)
    for tail in ("a", "e"):
        greedy(m, m.tokenize_prompt("the world the " * 10 + tail))
    save_learned(m, tmp_path)
    m.close()
    m = load(tiny_gguf, n_ctx=256, learn_prefixes=1)
    try:
        (row,) = restore(m, tmp_path)
        assert row["outcome"] == "ignored" and "n_ctx" in row["why"]
        assert m.cache.nbytes == 0
    finally:
        m.close()


def test_learned_prefixes_wait_out_a_change_of_key(tiny_gguf: Path, tmp_path: Path) -> None:
    common = "the world the " * 10

    def serve(n_ctx: int, traffic: bool) -> list[dict[str, object]]:
        m = load(tiny_gguf, n_ctx=n_ctx, learn_prefixes=1)
        try:
            rows = restore(m, tmp_path)
            for tail in ("a", "e") if traffic else ():
                greedy(m, m.tokenize_prompt(common + tail))
            save_learned(m, tmp_path)
            return rows
        finally:
            m.close()

    serve(512, traffic=True)  # learned under n_ctx 512
    (row,) = serve(256, traffic=False)  # a config change, no traffic before its SIGTERM
    assert row["outcome"] == "ignored" and "n_ctx 512 → 256" in row["why"]
    (row,) = serve(512, traffic=False)  # and back: what 512 learned is still there
    assert row["outcome"] == "restored" and row["tokens"] > 190
    for n_ctx in (128, 192, 320, 384):  # more keys than KEEP learn something: the oldest go
        serve(n_ctx, traffic=True)
    assert len({p.name.split(".")[1] for p in tmp_path.glob("learned.*.kvstate")}) == 3


def test_only_the_newest_states_of_a_prefix_are_kept(tiny_gguf: Path, tmp_path: Path,
                                                     declared: dict[str, object]) -> None:
    from edge.model.prefixstore import KEEP

    for n_ctx in (512, 480, 448, 416, 384):
        m = load(tiny_gguf, n_ctx=n_ctx, **declared)
        restore(m, tmp_path)
        m.close()
    def n_ctx_of(path: Path) -> int:
        data = path.read_bytes()
        size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        return json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + size])["key"]["n_ctx"]

    kept = list(tmp_path.glob("sys.*.kvstate"))
    assert len(kept) == KEEP and sorted(map(n_ctx_of, kept)) == [384, 416, 448]
