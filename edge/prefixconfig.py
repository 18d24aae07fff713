"""A model's sub-tables: declared prefixes (`[[models.prefixes]]`) and their checks, with the file
and field in every error; `[models.embeddings]` and `[models.speculative]`. No native imports
(edge doctor and the CLI load configs anywhere)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.errors import ConfigError
from edge.toml import value_range as _range

__all__ = ["EmbeddingsConfig", "MessageConfig", "POOLING", "PrefixConfig", "PREFIX_ROLES", "SPEC_MODES",
           "SpeculativeConfig", "check_prefixes"]


@dataclass(frozen=True)
class MessageConfig:
    role: str  # system | developer | user | assistant | tool
    content: str  # the message's text


@dataclass(frozen=True)
class PrefixConfig:
    """A prefix every request of a deployment starts with, kept warm in the KV cache: exactly
    one of `text` (a completion prefix), `file` (its text, relative to the config) or `messages`
    (chat: the model's template rendered for them, `tools` included, up to where the next
    message starts)."""

    name: str  # letters, digits, '-', '_' or '.'; names its saved state on disk
    text: str | None = None  # a completion prefix, as given
    file: str | None = None  # a file holding that text (UTF-8, relative to the config file)
    messages: list[MessageConfig] | None = None  # chat: rendered by the model's template up to the next turn
    tools: list[dict[str, Any]] | None = None  # with messages: tools as a request gives them ({type = "function", ...})


PREFIX_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_prefixes(prefixes: list[PrefixConfig], source: str, where: str,
                   base_dir: Path | None) -> list[PrefixConfig]:
    """Every declared prefix checked (`where`: the model's field, `models[0]`); `file` prefixes
    read now, relative to the config file."""
    seen: set[str] = set()
    out = []
    for j, p in enumerate(prefixes):
        key = f"{where}.prefixes[{j}]"
        if not p.name or not all(c.isalnum() or c in "-_." for c in p.name) or p.name.startswith("."):
            raise ConfigError(source, f"{key}.name", f"expected letters, digits, '-', '_' or '.', found {p.name!r}")
        if p.name in seen:
            raise ConfigError(source, f"{key}.name", f"duplicate prefix name {p.name!r}")
        seen.add(p.name)
        given = [k for k in ("text", "file", "messages") if getattr(p, k) is not None]
        if len(given) != 1:
            raise ConfigError(source, key, f"expected exactly one of text, file or messages, found {given or 'none'}")
        if p.tools is not None and p.messages is None:
            raise ConfigError(source, f"{key}.tools", "tools belong to a chat prefix: give messages too")
        for i, tool in enumerate(p.tools or []):  # the shape a request's tools must have
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or \
                    not isinstance(function.get("name"), str) or not function["name"]:
                raise ConfigError(source, f"{key}.tools[{i}]", 'expected {type = "function", '
                                  'function = {name = "...", ...}}, as a request\'s tools are')
        if p.text == "" or p.messages == []:
            raise ConfigError(source, f"{key}.{given[0]}", "expected a non-empty prefix")
        for i, msg in enumerate(p.messages or []):
            if msg.role not in PREFIX_ROLES:
                raise ConfigError(source, f"{key}.messages[{i}].role",
                                  f"expected one of {list(PREFIX_ROLES)}, found {msg.role!r}")
        out.append(_read_prefix_file(p, source, key, base_dir) if p.file is not None else p)
    return out


def _read_prefix_file(p: PrefixConfig, source: str, key: str, base_dir: Path | None) -> PrefixConfig:
    """A `file` prefix becomes its text, read now (relative to the config file)."""
    path = Path(p.file or "")
    if base_dir is not None and not path.is_absolute():
        path = (base_dir / path).resolve()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, f"{key}.file", f"cannot read {path} as UTF-8 text: {exc}") from None
    if not text:
        raise ConfigError(source, f"{key}.file", f"{path} is empty; expected the prefix's text")
    return dataclasses.replace(p, file=str(path), text=text)


POOLING = ("mean", "cls", "last")  # llama.cpp's pooling of a sequence's token embeddings


@dataclass(frozen=True)
class EmbeddingsConfig:
    """The model also answers /v1/embeddings, from a second llama.cpp context on the same loaded
    weights (one mapping; llama-server's --embeddings --pooling). `embeddings = true` takes every
    default. The context's compute holds the logits of every token of a batch (llama.cpp
    computes a causal model's output layer there too): about 8 x n_batch x n_vocab bytes."""

    # mean | cls | last; unset: the GGUF's own ({arch}.pooling_type), else "mean"
    pooling: str | None = field(default=None, metadata={"choices": POOLING})
    # tokens of one decode: the longest input, and the inputs batched at once (llama-server's -ub)
    n_batch: int = field(default=512, metadata=_range(8, 1 << 16))
    normalize: bool = True  # unit vectors (L2), as OpenAI returns and llama-server by default
    # Matryoshka sizes the model was trained to be cut to: a request's `dimensions` may name one
    # (the vector cut and normalized again); any other is a 400
    dimensions: list[int] = field(default_factory=list)
    max_inputs: int = field(default=2048, metadata=_range(1, 1 << 20))  # inputs of one request (OpenAI's bound)
    # false: an input's vector is the same whatever it is batched with (to ~1e-4 in cosine); true:
    # llama.cpp's flash attention, whose CPU path for larger batches moves it by ~1.5e-3 (Gemma 3)
    flash_attn: bool = False


SPEC_MODES = ("off", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`[models.speculative]`: speculative decoding (edge.model.speculate)."""

    # off: one token per sequence per step; ngram: tokens that followed the same n tokens earlier
    # in the prompt or the answer are proposed and verified in the step's one llama_decode
    mode: str = field(default="ngram", metadata={"choices": SPEC_MODES})
    ngram_min: int = field(default=2, metadata=_range(1, 16))  # the shortest n-gram a proposal may match
    ngram_max: int = field(default=4, metadata=_range(1, 16))  # the longest (tried first)
    max_draft: int = field(default=8, metadata=_range(1, 64))  # at most this many tokens proposed per sequence per step
    # a sequence whose accepted share of its proposals falls below this (after min_drafted
    # tokens proposed) stops proposing: a failed proposal costs its rows of the step's decode
    min_acceptance: float = field(default=0.3, metadata=_range(0.0, 1.0))
    min_drafted: int = field(default=16, metadata=_range(1, 1 << 20))  # proposals judged after this many tokens
    # a step's decode rows (every sequence's next token and the proposals) above which no more
    # proposals are added: a full batch is compute-bound and a rejected row costs what it saves
    # (docs/performance.md "Speculative decoding")
    max_step_rows: int = field(default=16, metadata=_range(1, 1 << 16))
