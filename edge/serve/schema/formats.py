"""The `format` values edge enforces, as grammars of exactly the valid texts where a grammar can
say it: `date` with the days of each month and February 29 in leap years only (year 0001-9999,
as Python's `date.fromisoformat` and JSON Schema's checker take them), `time` (RFC 3339
`full-time`: 00-23 h, 00-59 min and s, an optional fraction, `Z` or an offset), `date-time`
(`date`, `T`, `time`), `uuid` (8-4-4-4-12 hex digits). Rule names start with `f-`, which no
other rule's does.
"""

from __future__ import annotations

__all__ = ["FORMAT_RULES"]

_DATE = {
    "f-year": '"000" [1-9] | "00" [1-9] [0-9] | "0" [1-9] [0-9]{2} | [1-9] [0-9]{3}',
    # years divisible by 4, with the centuries only where divisible by 400 (no year 0)
    "f-leap4": '"0" [48] | [2468] [048] | [13579] [26]',
    "f-leap": '[0-9] [0-9] f-leap4 | f-leap4 "00"',
    "f-d28": '"0" [1-9] | "1" [0-9] | "2" [0-8]',
    "f-md": ('("01" | "03" | "05" | "07" | "08" | "10" | "12") "-" (f-d28 | "29" | "30" | "31")'
             ' | ("04" | "06" | "09" | "11") "-" (f-d28 | "29" | "30") | "02-" f-d28'),
    "f-date": 'f-year "-" f-md | f-leap "-02-29"',
}
_TIME = {
    "f-hms": '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{1,9})?',
    "f-time": 'f-hms ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])',
}
FORMAT_RULES: dict[str, dict[str, str]] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": {**_DATE, **_TIME, "f-date-time": 'f-date "T" f-time'},
    "uuid": {"f-uuid": '[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}'},
}
