"""A model's own sub-tables: declared prefixes (`[[models.prefixes]]`) and LoRA adapters
(`[[models.adapters]]`) and their checks, with the file and field in every error;
`[models.embeddings]` and `[models.speculative]`. No native imports (edge doctor and the CLI
load configs anywhere)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.errors import ConfigError
from edge.toml import value_range as _range

__all__ = ["AdapterConfig", "EmbeddingsConfig", "MessageConfig", "POOLING", "PrefixConfig", "PREFIX_ROLES",
           "SPEC_MODES", "SpeculativeConfig", "check_adapters", "check_prefixes"]


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


@dataclass(frozen=True)
class AdapterConfig:
    """A LoRA adapter of the model (a GGUF of general.type "adapter", made for this model's
    architecture and shapes): loaded with the model on its weights, chosen per request
    (`model = "base:name"` or `lora = [{name, scale}]`; docs/api.md)."""

    name: str  # the adapter's name in requests and /v1/models: letters, digits, '-', '_' or '.'
    path: str  # the adapter's GGUF file (relative to the config file)
    scale: float = 1.0  # the scale a request that names no scale gets (0: the base model's output)


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


def _plain_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "-_." for c in name) and not name.startswith(".")


def check_adapters(adapters: list[AdapterConfig], source: str, where: str,
                   base_dir: Path | None) -> list[AdapterConfig]:
    """Every adapter's name and scale checked (`where`: the model's field, `models[0]`); its path
    made absolute, relative to the config file (an OTA version dir holds both). The file itself
    is checked at the load, against the model (edge.model.adapters)."""
    seen: set[str] = set()
    out = []
    for j, a in enumerate(adapters):
        key = f"{where}.adapters[{j}]"
        if not _plain_name(a.name):
            raise ConfigError(source, f"{key}.name", f"expected letters, digits, '-', '_' or '.', found {a.name!r}")
        if a.name in seen:
            raise ConfigError(source, f"{key}.name", f"duplicate adapter name {a.name!r}")
        seen.add(a.name)
        if not a.path:
            raise ConfigError(source, f"{key}.path", "expected the path of a GGUF LoRA adapter, found an empty string")
        if not -100.0 <= a.scale <= 100.0 or a.scale != a.scale:
            raise ConfigError(source, f"{key}.scale", f"expected a number from -100 to 100, found {a.scale!r}")
        path = Path(a.path)
        if base_dir is not None and not path.is_absolute():
            path = (base_dir / path).resolve()
        out.append(dataclasses.replace(a, path=str(path)))
    return out


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
