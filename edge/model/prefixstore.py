"""Prefix states on disk: declared prefixes restored at every start, learned ones kept across
restarts.

`<cache_dir>/prefix/<model>/<name>.<key digest>.kvstate` holds a declared prefix's KV state (the
digest covers the key and the prefix's tokens, so the states of the last few configurations
coexist and a reload back to an earlier one restores instead of recomputing; KEEP per prefix),
`learned.<key digest>.<i>.kvstate` the i-th prefix that traffic reused most before the last
SIGTERM under that key (those of the KEEP newest keys are kept, so a configuration changed back
finds them again). A file is

    MAGIC (8 bytes) | header length (4 bytes, little-endian) | header (JSON) | state

where the header carries the key (everything that makes a state valid for this model and
context: model sha256 or file identity, llama.cpp version and build, n_ctx, batch sizes, KV
types, GPU layers, flash attention), the prefix's token ids, the state's size and CRC-32. A file
is given to llama.cpp only when every check passes; otherwise it is ignored, the report says why
(`key n_ctx 2048 → 1024`, `truncated`, `checksum`), and the state is computed again and rewritten
(temp file, fsync, rename). llama.cpp's own check (llama_state_seq_set_data refusing it) is the
last one.

Every function here that touches the model runs on its worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from edge.errors import ConfigError, RequestError
from edge.fsutil import atomic_write, private_dir
from edge.model.promptcache import Entry, PromptCache

if TYPE_CHECKING:
    from edge.config import PrefixConfig
    from edge.model.llm import GGUFModel

__all__ = ["MAGIC", "StateRejected", "compute_state", "cut_state", "load_state", "prefix_key", "prefix_tokens",
           "read_state", "restore_prefixes", "save_learned", "write_state"]

log = logging.getLogger("edge")

MAGIC = b"EDGEKV\x00\x01"
FORMAT = 1
_HEAD = struct.Struct("<I")
MAX_HEADER = 64 << 20  # a header longer than this is not one of ours
KEEP = 3  # state files kept per declared prefix (other keys: other n_ctx, model, build)


class StateRejected(Exception):
    """A state file that must not reach llama.cpp; the message says why."""


# -- states between a slot's sequence and files (a free slot: Slots.spare) ---------------------------------
def load_state(cache: PromptCache, seq: int, tokens: list[int], state: bytearray, whole: bool = False) -> bool:
    """A saved state into sequence `seq`, its tokens made live; False (and an empty sequence)
    where llama.cpp refuses it."""
    ok = cache.native.set_state(seq, state, whole)
    cache.lives[seq] = list(tokens) if ok else []
    return ok


def compute_state(cache: PromptCache, seq: int, tokens: list[int]) -> bytearray:
    """`tokens` prefilled from position 0 into sequence `seq`; its state after them."""
    cache.reset(seq)
    try:
        cache.native.decode(seq, tokens, 0)
    except BaseException:
        cache.reset(seq)
        raise
    cache.lives[seq] = list(tokens)
    return cache.native.state_bytes(seq)


def cut_state(cache: PromptCache, seq: int, e: Entry, n: int) -> tuple[list[int], bytearray] | None:
    """`e`'s tokens and windowed state (for a file) cut to its first n tokens, where its window
    reaches back that far (else whole); None where llama.cpp refuses the state."""
    key = next(k for k, x in cache.entries.items() if x is e)
    if not cache.load(seq, key, n):
        return None
    cache.lives[seq] = list(e.tokens)
    native = cache.native
    if n < len(e.tokens) and native.reaches(e.pos_min, n) and native.keep(seq, n):
        cache.lives[seq] = cache.live(seq)[:n]
    elif not e.whole:
        return list(e.tokens), e.state
    return list(cache.live(seq)), native.state_bytes(seq)


def folder_for(cache_dir: Path, model: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return cache_dir / "prefix" / safe


def prefix_key(model: GGUFModel) -> dict[str, Any]:
    """What makes a saved KV state valid for this loaded model and context."""
    from edge.model.gpu import llama_build
    from edge.model.identity import context_identity

    p = model.native.params
    return {"format": FORMAT, **context_identity(model, llama_build()), "type_k": int(p.type_k),
            "type_v": int(p.type_v)}


def prefix_tokens(model: GGUFModel, p: PrefixConfig, source: str = "", field: str = "") -> list[int]:
    """A declared prefix's tokens: its text as a completion prompt starts, or its messages (and
    tools) rendered by the chat template up to where the next turn's content would begin. A
    template that cannot render them is a ConfigError naming `field` (models[i].prefixes[j])."""
    if p.messages is None:
        return model.tokenize_prompt(p.text or "")
    msgs = [{"role": m.role, "content": m.content} for m in p.messages]
    if p.tools and not model.supports_tools:
        raise ConfigError(source, f"{field}.tools", f"model {model.cfg.name!r}'s chat template has no "
                          "tool support (it never mentions `tools`), so it would leave them out: set "
                          "the model's chat_template to one that does, or remove tools")
    try:
        text, added_bos = model.turn_prefix(msgs, p.tools)
    except RequestError as exc:
        raise ConfigError(source, f"{field}.messages", str(exc)) from None
    return model.native.tokenize(text.encode("utf-8"), add_bos=not added_bos, special=True)


# -- the file ------------------------------------------------------------------------------------
def write_state(path: Path, key: dict[str, Any], tokens: list[int], state: bytes | bytearray, **meta: Any) -> None:
    header = json.dumps({"format": FORMAT, "key": key, "tokens": tokens, "state_bytes": len(state),
                         "state_crc32": zlib.crc32(state), **meta}).encode()
    private_dir(path.parent)  # a state's token ids decode back to its prompt
    atomic_write(path, [MAGIC, _HEAD.pack(len(header)), header, state])


def _read_header(f: BinaryIO) -> dict[str, Any]:
    """The header of an open state file, its position left at the state; StateRejected if it is
    not one of edge's or is cut short."""
    head = f.read(len(MAGIC) + _HEAD.size)
    if head[:len(MAGIC)] != MAGIC:
        raise StateRejected("not an edge KV state file (magic)")
    if len(head) < len(MAGIC) + _HEAD.size:
        raise StateRejected("truncated header")
    (hlen,) = _HEAD.unpack_from(head, len(MAGIC))
    raw = f.read(hlen) if hlen <= MAX_HEADER else b""
    if len(raw) != hlen or not raw:
        raise StateRejected("truncated header")
    try:
        header = json.loads(raw)
        int(header["state_bytes"]), int(header["state_crc32"]), header["key"], header["tokens"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StateRejected(f"unreadable header ({type(exc).__name__})") from None
    return header


def read_state(path: Path, key: dict[str, Any], tokens: list[int] | None = None) -> tuple[dict[str, Any], bytearray]:
    """(header, state) of a file that passes every check, else StateRejected naming the first
    that fails. `tokens`: the token ids the state must be of (a declared prefix). The state is
    read into the buffer that keeps it (once)."""
    from edge.model.identity import key_differences

    try:
        with open(path, "rb") as f:
            header = _read_header(f)
            stored_key, size = header["key"], int(header["state_bytes"])
            left = os.fstat(f.fileno()).st_size - f.tell()
            if not 0 <= size <= left:  # before a buffer of that size is made
                raise StateRejected(f"truncated: {max(left, 0)} of {size} state bytes" if size > left
                                    else f"unreadable header (state_bytes {size})")
            if not isinstance(stored_key, dict) or stored_key != key:
                diff = key_differences(stored_key, key) if isinstance(stored_key, dict) else ["key"]
                raise StateRejected(f"saved for another model or context: {', '.join(diff[:3])}")
            if tokens is not None and header["tokens"] != tokens:
                raise StateRejected("saved for other prefix tokens (its text or the template changed)")
            state = bytearray(size)
            got = f.readinto(state)
            extra = f.read(1)
    except FileNotFoundError:
        raise StateRejected("no saved state") from None
    except OSError as exc:
        raise StateRejected(f"unreadable: {exc.strerror or exc}") from None
    if got != size or extra:
        raise StateRejected(f"truncated: {got} of {size} state bytes" if got != size else "longer than its header says")
    if zlib.crc32(state) != int(header["state_crc32"]):
        raise StateRejected("checksum mismatch (corrupt)")
    return header, state


# -- at a start ------------------------------------------------------------------------------------
@dataclass
class _Where:
    source: str  # the config file
    field: str  # models[i]


def restore_prefixes(model: GGUFModel, folder: Path, source: str, field: str,
                     recompute: bool = False) -> list[dict[str, Any]]:
    """Every declared prefix of the model into its prompt cache (pinned), restored from disk or
    computed and saved; then the learned ones that still fit. One report row each. Works in a
    free slot (Slots.spare), which holds the last one's cells afterwards."""
    where, key = _Where(source, field), prefix_key(model)
    with model.slots.spare() as seq:
        rows = [_declared(model, seq, folder, key, where, j, p, recompute) for j, p in enumerate(model.cfg.prefixes)]
        rows += _learned(model, seq, folder, key) if model.cfg.learn_prefixes else []
    if any(r["outcome"] == "no room" for r in rows):  # every state made first: the whole need
        need = sum(r["bytes"] for r in rows)
        raise ConfigError(source, f"{field}.prompt_cache_mb", f"the declared prefixes need {need / 2**20:.2f} "
                          f"MiB of KV state ({need} bytes), more than the prompt cache's "
                          f"{model.cache.limit_bytes / 2**20:.2f} MiB: raise prompt_cache_mb to at least "
                          f"{-(-need // 2**20)}")
    return rows


def _declared(model: GGUFModel, seq: int, folder: Path, key: dict[str, Any], where: _Where, j: int,
              p: PrefixConfig, recompute: bool) -> dict[str, Any]:
    t0, cache = time.perf_counter(), model.cache
    name = f"{where.field}.prefixes[{j}]"
    tokens = prefix_tokens(model, p, where.source, name)
    if len(tokens) >= model.n_ctx:
        raise ConfigError(where.source, name, f"prefix {p.name!r} is {len(tokens)} tokens: it leaves no "
                          f"room in the context of {model.n_ctx} tokens (n_ctx)")
    path, state, why = _state_path(folder, p.name, key, tokens), None, "edge warmup --calibrate"
    if not recompute:
        try:
            state = read_state(path, key, tokens)[1]
            if not load_state(cache, seq, tokens, state):
                state, why = None, "llama.cpp refused the saved state"
        except StateRejected as exc:
            why = _why_new(folder, p.name, key) if not path.exists() else str(exc)
    outcome = "restored" if state is not None else "computed"
    if state is None:
        if path.exists():  # a damaged file is worth a warning; a recompute asked for is not
            log.log(logging.INFO if recompute else logging.WARNING, "%s: prefix %r: %s (%s): computing "
                    "it again", model.cfg.name, p.name, why, path)
        state = compute_state(cache, seq, tokens)
        write_state(path, key, tokens, state, kind="declared", name=p.name)
        _prune(folder, p.name)
    if not cache.add(Entry(list(tokens), state, name=p.name, pinned=True, pos_min=model.native.window_min(seq))):
        outcome = "no room"  # restore_prefixes refuses the config once every state's size is known
    return {"prefix": p.name, "kind": "declared", "tokens": len(tokens), "bytes": len(state),
            "outcome": outcome, "why": "" if outcome == "restored" else why,
            "seconds": round(time.perf_counter() - t0, 4)}


def _digest(value: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _state_path(folder: Path, name: str, key: dict[str, Any], tokens: list[int]) -> Path:
    return folder / f"{name}.{_digest([key, tokens])}.kvstate"


def _others(folder: Path, name: str) -> list[Path]:
    """The prefix's state files (`<name>.<16 hex digits>.kvstate`), newest first."""
    own = re.compile(rf"{re.escape(name)}\.[0-9a-f]{{16}}\.kvstate")
    found = [p for p in folder.glob(f"{name}.*.kvstate") if own.fullmatch(p.name)]
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def _key_changes(paths: list[Path], key: dict[str, Any]) -> Iterator[list[str] | None]:
    """For each readable state file of `paths`, in order: None when it was saved under `key`,
    else the key's fields that differ (unreadable files are passed over)."""
    from edge.model.identity import key_differences

    for path in paths:
        try:
            with open(path, "rb") as f:
                stored = _read_header(f)["key"]
        except (OSError, StateRejected):
            continue
        yield None if stored == key else key_differences(stored, key) if isinstance(stored, dict) else ["key"]


def _why_new(folder: Path, name: str, key: dict[str, Any]) -> str:
    """Why there is no state for this key: what changed since the newest one saved."""
    newest = None
    for diff in _key_changes(_others(folder, name), key):
        if diff is None:  # a state of this very key, for other tokens
            return "no saved state for this key (the prefix's tokens changed)"
        if newest is None:
            newest = diff
    if newest is None:
        return "no saved state"
    return "no saved state for this key" + (f" ({', '.join(newest[:3])})" if newest else "")


def _prune(folder: Path, name: str) -> None:
    for old in _others(folder, name)[KEEP:]:
        old.unlink(missing_ok=True)


def _learned_path(folder: Path, key: dict[str, Any], i: int) -> Path:
    return folder / f"learned.{_digest(key)}.{i}.kvstate"


def _learned_files(folder: Path) -> dict[str, list[Path]]:
    """Learned state files by key digest, the key saved most recently first."""
    own = re.compile(r"learned\.([0-9a-f]{16})\.\d+\.kvstate")
    by_key: dict[str, list[Path]] = {}
    for path in folder.glob("learned.*.kvstate"):
        m = own.fullmatch(path.name)
        if m:
            by_key.setdefault(m[1], []).append(path)
    newest = {k: max(p.stat().st_mtime_ns for p in paths) for k, paths in by_key.items()}
    return dict(sorted(by_key.items(), key=lambda kv: -newest[kv[0]]))


def _learned_elsewhere(folder: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The row saying why no learned state is restored when only other keys have some."""
    for diff in _key_changes([min(paths) for paths in _learned_files(folder).values()], key):
        diff = diff or []
        return {"prefix": "learned", "kind": "learned", "tokens": 0, "bytes": 0, "outcome": "ignored",
                "why": "saved for another model or context" + (f": {', '.join(diff[:3])}" if diff else ""),
                "seconds": 0.0}
    return None


def _learned(model: GGUFModel, seq: int, folder: Path, key: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(model.cfg.learn_prefixes):
        path = _learned_path(folder, key, i)
        if not path.exists():
            if i == 0 and (elsewhere := _learned_elsewhere(folder, key)) is not None:
                rows.append(elsewhere)
            break
        t0 = time.perf_counter()
        row = {"prefix": f"learned-{i}", "kind": "learned", "tokens": 0, "bytes": 0, "outcome": "ignored"}
        try:
            header, state = read_state(path, key)
            tokens = [int(t) for t in header["tokens"]]
            row.update(tokens=len(tokens), bytes=len(state))
            if len(tokens) >= model.n_ctx:
                row["why"] = f"{len(tokens)} tokens: no room in the context of {model.n_ctx}"
            elif not load_state(model.cache, seq, tokens, state):
                row["why"] = "llama.cpp refused the saved state"
            elif not model.cache.add(Entry(tokens, state, hits=int(header.get("hits", 0)), checkpoint=True,
                                           reused=int(header.get("reused", 0)),
                                           pos_min=model.native.window_min(seq))):
                row["why"] = "no room beside the declared prefixes (prompt_cache_mb)"
            else:
                row["outcome"] = "restored"
        except (StateRejected, ValueError, TypeError) as exc:
            row["why"] = str(exc)
        row["seconds"] = round(time.perf_counter() - t0, 4)
        rows.append(row)
    return rows


# -- at SIGTERM --------------------------------------------------------------------------------------
def save_learned(model: GGUFModel, folder: Path) -> list[dict[str, Any]]:
    """The `learn_prefixes` states traffic reused most, each cut to the part it reused, written
    for the next start; older learned files beyond them removed. Runs after the drain."""
    cache, key = model.cache, prefix_key(model)
    rows: list[dict[str, Any]] = []
    # room for the longest: the idle slots' live cells give way first (a restore needs free
    # cells; after calibration and traffic they may hold most of the context)
    need = max((len(e.tokens) for e in cache.most_reused(model.cfg.learn_prefixes)), default=0)
    with model.slots.spare(need=need) as seq:
        for e in cache.most_reused(model.cfg.learn_prefixes):  # again: giving way may have merged some
            got = cut_state(cache, seq, e, max(1, min(e.reused, len(e.tokens))))  # whole where a window cannot be cut
            if got is None:
                continue
            tokens, state = got
            write_state(_learned_path(folder, key, len(rows)), key, tokens, state, kind="learned", hits=e.hits,
                        reused=len(tokens))
            rows.append({"prefix": f"learned-{len(rows)}", "tokens": len(tokens), "hits": e.hits})
        cache.reset(seq)
    mine = _digest(key)
    for n, (digest, paths) in enumerate(_learned_files(folder).items()):
        for path in paths:  # this key's beyond what was just saved; keys older than the KEEP newest
            index = int(path.name.split(".")[2])
            if (digest == mine and index >= len(rows)) or (digest != mine and n >= KEEP):
                path.unlink(missing_ok=True)
    for path in folder.glob("learned-*.kvstate"):  # the names of edge before keys were in them
        path.unlink(missing_ok=True)
    return rows
