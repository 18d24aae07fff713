"""A model's own sub-tables: declared prefixes (`[[models.prefixes]]`) and LoRA adapters
(`[[models.adapters]]`), and their checks, with the file and field in every error. No native
imports (edge doctor and the CLI load configs anywhere)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge.errors import ConfigError

__all__ = ["AdapterConfig", "MessageConfig", "PrefixConfig", "PREFIX_ROLES", "check_adapters", "check_prefixes"]


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
