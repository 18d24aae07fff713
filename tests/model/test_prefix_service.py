"""The prompt cache in a real `edge serve` (kit.PidOne): declared prefixes restored at every
start and reload, learned prefixes across a SIGTERM, the cache's metrics, concurrency."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kit import EDGE, write_config
from kit import metric, post

SYSTEM = "Hello world. " * 8  # 140 tokens in the tiny vocabulary
PREFIXES = f'[[models.prefixes]]\nname = "sys"\ntext = "{SYSTEM}"\n'
CHAT_PREFIX = ('[[models.prefixes]]\nname = "chat"\n'
               'messages = [{role = "system", content = "You answer in one word."}]\n')


def report(cfg: Path, kind: str = "start") -> dict[str, Any]:
    return json.loads((cfg.parent / "state" / f"last-{kind}.json").read_text())


def prefix_rows(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["prefix"]: row for p in rep["phases"] if p["name"] == "prefix_states"
            for row in p["detail"]["prefixes"]}


def complete(address: tuple[str, int], prompt: str, **extra: Any) -> dict[str, Any]:
    status, body = post(address, "/v1/completions",
                        {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})
    assert status == 200, body
    return body


def cached(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_declared_prefix_is_computed_at_the_first_start_and_restored_at_the_next(
        tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512, extra_model=PREFIXES)
    first = service(cfg)
    row = prefix_rows(report(cfg))["sys"]
    assert row["outcome"] == "computed" and row["tokens"] == 140
    answer = complete(first.address, SYSTEM + "the a")
    assert cached(answer) >= 139  # warm-up ran after the restore: the pinned state served it
    assert first.stop() == 0
    second = service(cfg)
    row = prefix_rows(report(cfg))["sys"]
    assert row["outcome"] == "restored" and row["why"] == ""
    again = complete(second.address, SYSTEM + "the a")
    assert cached(again) >= 139 and again["choices"][0]["text"] == answer["choices"][0]["text"]
    complete(second.address, "a the e " * 10)  # an unrelated request
    assert cached(complete(second.address, SYSTEM + "the e")) >= 139
    assert metric(second.address, "edge_prompt_cache_hits_total", model="tiny") >= 2
    assert metric(second.address, "edge_prompt_cache_misses_total", model="tiny") >= 1
    held = metric(second.address, "edge_prompt_cache_bytes", model="tiny")
    assert 0 < held <= metric(second.address, "edge_prompt_cache_limit_bytes", model="tiny")
    assert metric(second.address, "edge_prompt_cache_reused_tokens_total", model="tiny") >= 2 * 139


def test_a_reload_restores_or_computes_the_prefixes_of_the_new_set(tmp_path: Path, tiny_gguf: Path,
                                                                   service) -> None:
    a = write_config(tmp_path / "a.toml", tiny_gguf, n_ctx=512, extra_model=PREFIXES)
    b = write_config(tmp_path / "b.toml", tiny_gguf, n_ctx=384, extra_model=PREFIXES)
    live = service(a)
    for cfg, outcome in ((b, "computed"), (a, "restored")):
        done = subprocess.run([*EDGE, "reload", "--config", str(cfg)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        row = prefix_rows(report(a, "reload"))["sys"]
        assert row["outcome"] == outcome, row
        assert cached(complete(live.address, SYSTEM + "the o")) >= 139


def test_learned_prefixes_are_saved_at_sigterm_and_restored_at_the_next_start(
        tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512, extra_model="learn_prefixes = 2")
    common = "the world the " * 10
    first = service(cfg)
    for tail in ("a", "e", "o"):
        complete(first.address, common + tail)
    assert first.stop() == 0
    assert "learned prefixes saved for the next start: 1 (" in first.log_tail()
    second = service(cfg)
    (row,) = prefix_rows(report(cfg)).values()
    assert row["kind"] == "learned" and row["outcome"] == "restored" and row["tokens"] > 190
    assert cached(complete(second.address, common + "n")) >= row["tokens"] - 1


def test_a_chat_prefix_serves_chat_requests(tmp_path: Path, tiny_gguf: Path, service) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512, extra_model=CHAT_PREFIX)
    live = service(cfg)
    row = prefix_rows(report(cfg))["chat"]
    for question in ("Hi", "Why?"):
        status, body = post(live.address, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": "You answer in one word."},
                         {"role": "user", "content": question}], "max_tokens": 3, "temperature": 0})
        assert status == 200, body
        assert cached(body) >= row["tokens"] - 1


def test_sliding_window_prefixes_and_chats_in_turns_are_reused_over_http(tmp_path: Path, tiny_swa_gguf: Path,
                                                                         service) -> None:
    """A model whose sliding-window layers keep only their window (the tiny Gemma 3): two
    completion prefixes in turns, and two chats whose turns alternate, each re-sending its
    history; every repeat reuses what it repeats (usage.prompt_tokens_details.cached_tokens).
    One slot: its states are whole (cut back anywhere the window cache still reaches); with
    several, the tiny window's cache (32 cells a slot) is pruned by the others' prefills."""
    cfg = write_config(tmp_path / "edge.toml", tiny_swa_gguf, n_ctx=1024, extra_model="parallel = 1")
    live = service(cfg)
    prefixes = ["Hello world. " * 12, "the a world " * 16]
    for rnd in range(3):
        for j, prefix in enumerate(prefixes):
            body = complete(live.address, prefix + ("the", "a", "tea")[rnd] + " note" * j)
            assert cached(body) >= (130 if rnd else 0) and (rnd or cached(body) < 16), (rnd, j, body["usage"])
    chats = [[{"role": "system", "content": system}] for system in prefixes]
    previous = [0, 0]
    for turn in range(4):
        for c, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": "the world " * (3 + turn)})
            status, body = post(live.address, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                                       "temperature": 0})
            assert status == 200, body
            assert cached(body) >= previous[c], (turn, c, body["usage"])
            previous[c] = body["usage"]["prompt_tokens"]
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert metric(live.address, "edge_prompt_cache_bytes", model="tiny") <= metric(
        live.address, "edge_prompt_cache_limit_bytes", model="tiny")


def test_concurrent_requests_never_see_another_ones_state(tmp_path: Path, tiny_gguf: Path, service) -> None:
    """Requests on a model are sequential; restores happen between them. Answers under load
    equal the answers the same requests got one at a time."""
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512, extra_model=PREFIXES)
    live = service(cfg)
    prompts = [SYSTEM + t for t in ("the a", "the e", "world", "o n")] + ["a the e " * 10, "n o t e " * 9]
    alone = {p: complete(live.address, p, max_tokens=6)["choices"][0]["text"] for p in prompts}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: (p, complete(live.address, p, max_tokens=6)["choices"][0]["text"]),
                            prompts * 4))
    assert all(text == alone[p] for p, text in got)


@pytest.mark.parametrize("bad, field", [
    ('[[models.prefixes]]\nname = "x"\n', "models[0].prefixes[0]"),
    ('[[models.prefixes]]\nname = "x"\ntext = "a"\nfile = "b"\n', "models[0].prefixes[0]"),
    ('[[models.prefixes]]\nname = "x y"\ntext = "a"\n', "models[0].prefixes[0].name"),
    ('[[models.prefixes]]\nname = "x"\nfile = "missing.txt"\n', "models[0].prefixes[0].file"),
    ('[[models.prefixes]]\nname = "x"\ntext = "a"\n[[models.prefixes]]\nname = "x"\ntext = "b"\n',
     "models[0].prefixes[1].name"),
    ('prompt_cache_mb = 0\nlearn_prefixes = 1', "models[0].prompt_cache_mb"),
    ('flash_attn = "yes"', "models[0].flash_attn"),
    ('n_ubatch = 1024', "models[0].n_ubatch"),
])
def test_bad_prompt_cache_config_names_the_field(tmp_path: Path, tiny_gguf: Path, bad: str, field: str) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, extra_model=bad)
    done = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    assert f"{cfg}: {field}:" in done.stderr and "Traceback" not in done.stderr


def test_a_prefix_that_cannot_fit_fails_the_start_naming_it(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=128, extra_model=PREFIXES)
    done = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr
    assert "models[0].prefixes[0]: prefix 'sys' is 140 tokens" in done.stderr


def test_cache_prompt_false_repeats_bit_for_bit_and_greedy_repeats_its_text(tmp_path: Path, tiny_gguf: Path,
                                                                            service) -> None:
    """docs/api.md "Reproducibility": cache_prompt: false (no KV reuse) repeats every logprob
    exactly, whatever the requests before it were; with the cache, a request that reuses the same
    prefix in the same way repeats exactly too (against a prefill from position 0 it is another
    computation, llama.cpp's to round: kit.replay)."""
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=512)
    live = service(cfg)
    ask = {"max_tokens": 6, "logprobs": 2}

    def run(prompt: str, **extra: Any) -> tuple[str, list[float], int]:
        body = complete(live.address, prompt, **ask, **extra)
        choice = body["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"], cached(body)

    exact = [run(SYSTEM + "the a", cache_prompt=False)]
    run("a the e " * 10)
    exact.append(run(SYSTEM + "the a", cache_prompt=False))
    exact.append(run(SYSTEM + "the a", cache_prompt=False))  # right after itself
    assert exact[0] == exact[1] == exact[2] and exact[0][2] == 0
    reused = run(SYSTEM + "the a")  # the whole prompt but one token from the cache
    assert reused[2] >= 139 and run(SYSTEM + "the a") == reused  # reused the same way: the same floats
    status, body = post(live.address, "/v1/completions", {"prompt": "x", "cache_prompt": "no"})
    assert status == 400 and body["error"]["param"] == "cache_prompt"


def test_an_ota_activation_by_reload_serves_the_new_versions_prefix_at_once(kit) -> None:
    """A version that declares a prefix computes its state while it warms beside the serving
    version; the first request after the switch reuses it."""
    from edge.ota.bundle import build_bundle
    from kit import PidOne
    from kit.ota import cfg_text, edge_ota

    paths = f'[paths]\nstate_dir = "{kit["dir"] / "state"}"\n'
    bundles = {}
    for v, extra in (("1.0.0", ""), ("1.1.0", PREFIXES)):
        bundles[v] = kit["dir"] / f"prefix-{v}.edgeb"
        config = cfg_text("a.gguf", paths).replace("n_ctx = 256", "n_ctx = 512") + extra
        build_bundle(bundles[v], version=v, files=[(kit["a"], "models/a.gguf", "model", None)], config=config,
                     key=kit["key"])
    r = edge_ota(kit, "install", str(bundles["1.0.0"]), "--pubkey", str(kit["pub"]), "--no-activate")
    assert r.returncode == 0, r.stderr
    assert edge_ota(kit, "commit").returncode == 0
    with PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")]) as live:
        live.start()
        live.wait_for("READY", "1")
        assert cached(complete(live.address, SYSTEM + "the a")) < 16  # 1.0.0 declares nothing
        r = edge_ota(kit, "install", str(bundles["1.1.0"]), "--pubkey", str(kit["pub"]), "--reload",
                     "--timeout", "120")
        assert r.returncode == 0, r.stderr
        rows = {row["prefix"]: row for p in json.loads((kit["dir"] / "state" / "last-reload.json").read_text())["phases"]
                if p["name"] == "prefix_states" for row in p["detail"]["prefixes"]}
        assert rows["sys"]["outcome"] == "computed"
        assert cached(complete(live.address, SYSTEM + "the e")) >= 139
