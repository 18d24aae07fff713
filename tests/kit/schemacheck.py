"""What an output held to a JSON schema must be, checked strictly: UTF-8 (no byte sequence a
strict decoder refuses), JSON that every parser reads alike (no NaN or Infinity, no key twice in
one object, no lone surrogate escape), and valid against the schema by the `jsonschema`
validator, Draft 2020-12, formats checked (tests/serve/test_schemaproperty.py, the live fuzz)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["invalid", "strict_json"]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key twice in one object: {sorted(k for k in keys if keys.count(k) > 1)[:3]}")
    return dict(pairs)


def strict_json(text: bytes | str) -> Any:
    """The JSON value of `text`; ValueError (UnicodeDecodeError among them) where it is not
    strictly UTF-8 and JSON."""
    s = text.decode("utf-8") if isinstance(text, bytes) else text
    value = json.loads(s, parse_constant=_no_constant, object_pairs_hook=_no_repeats)
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape: UnicodeEncodeError
    return value


def invalid(schema: Any, text: bytes | str) -> str | None:
    """Why `text` is not a valid instance of `schema` (None: it is)."""
    import jsonschema

    try:
        value = strict_json(text)
    except (ValueError, UnicodeError) as exc:
        return f"not strict UTF-8 JSON: {exc}"
    cls = jsonschema.Draft202012Validator
    errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return errors[0].message if errors else None
