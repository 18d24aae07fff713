"""What an OpenAI embeddings request asks for, checked field by field (`POST /v1/embeddings`).

`input` is a string, an array of strings, an array of token ids (one input) or an array of such
arrays, as OpenAI's API takes it (an array may mix strings and token arrays, as llama-server
allows); `encoding_format` is "float" or "base64" (little-endian float32, as OpenAI encodes it);
`dimensions` is the vector's full size or one of the Matryoshka sizes the model's config names
(`[models.embeddings] dimensions`): a vector is never cut to a size the model was not trained
for. `user` is accepted and logged. Any other field is a 400 naming it, as for completions
(edge.serve.openai). No native imports: the model's limits come in as plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge.errors import RequestError

__all__ = ["EmbedAsk", "EmbedLimits", "parse_embeddings"]

_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbedLimits:
    """What the model's embeddings context can do (edge.model.embed.EmbedContext)."""
    n_embd: int  # the pooled vector's size
    n_vocab: int
    max_inputs: int  # [models.embeddings] max_inputs
    matryoshka: tuple[int, ...] = ()  # [models.embeddings] dimensions


@dataclass(frozen=True)
class EmbedAsk:
    """One request, checked: its inputs in order (text, or token ids as given), how to encode."""
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None  # None: the full vector
    user: str | None = None


def parse_embeddings(body: dict[str, Any], limits: EmbedLimits) -> EmbedAsk:
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} for /v1/embeddings; expected some of "
                           f"{sorted(_FIELDS)}", param=unknown[0])
    if "input" not in body:
        raise RequestError("missing field 'input': a string, an array of strings, an array of token ids "
                           "or an array of such arrays", param="input")
    fmt = body.get("encoding_format", "float")
    if fmt not in FORMATS:
        raise RequestError(f"encoding_format must be one of {list(FORMATS)}, found {fmt!r}", param="encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, found {type(user).__name__}", param="user")
    return EmbedAsk(_inputs(body["input"], limits), fmt, _dimensions(body.get("dimensions"), limits), user)


def _inputs(raw: Any, limits: EmbedLimits) -> list[str | list[int]]:
    if isinstance(raw, str) or _token_array(raw):
        items: list[Any] = [raw]
    elif isinstance(raw, list):
        items = raw
    else:
        raise RequestError(f"input must be a string or an array, found {type(raw).__name__}", param="input")
    if not items:
        raise RequestError("input is an empty array: give at least one input", param="input")
    if len(items) > limits.max_inputs:
        raise RequestError(f"input has {len(items)} items: more than the {limits.max_inputs} this model takes "
                           "in one request (models[].embeddings.max_inputs)", param="input")
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise RequestError(f"{where} is an empty string: nothing to embed", param=where)
            out.append(item)
        elif _token_array(item):
            bad = next((t for t in item if not 0 <= t < limits.n_vocab), None)
            if bad is not None:
                raise RequestError(f"{where} holds token id {bad}, outside this model's vocabulary "
                                   f"(0 ... {limits.n_vocab - 1})", param=where)
            out.append(list(item))
        else:
            raise RequestError(f"{where} must be a string or a non-empty array of token ids (integers), "
                               f"found {_kind(item)}", param=where)
    return out


def _token_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _kind(v: Any) -> str:
    if isinstance(v, list):
        return "an empty array" if not v else "an array holding something other than integers"
    return type(v).__name__


def _dimensions(raw: Any, limits: EmbedLimits) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise RequestError(f"dimensions must be a positive integer, found {raw!r}", param="dimensions")
    if raw == limits.n_embd:
        return None
    if raw in limits.matryoshka:
        return raw
    sizes = sorted({limits.n_embd, *limits.matryoshka})
    raise RequestError(f"dimensions {raw} is not a size this model's vectors can honestly be cut to: "
                       f"expected one of {sizes} (other sizes need a model trained for them, declared "
                       "in models[].embeddings.dimensions)", param="dimensions")
