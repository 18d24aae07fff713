"""Integer ranges as a grammar: the regex rendering of the same tree matches exactly the
integers lo..hi as JSON writes them (no leading zeros, no -0), around every bound and at random."""

from __future__ import annotations

import random
import re

import pytest

from edge.serve.schema.ranges import OPEN_DIGITS, integer_bounds, range_gbnf, range_regex, range_tree


def test_ranges_match_exactly_their_integers() -> None:
    rng = random.Random(33)
    for _ in range(1500):
        lo, hi = (rng.choice([None, rng.randint(-10 ** rng.randint(0, 7), 10 ** rng.randint(0, 7))])
                  for _ in range(2))
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        rx = re.compile(range_regex(range_tree(lo, hi)))
        for c in [v for v in (lo, hi) if v is not None] or [0]:
            for n in [*range(c - 25, c + 25), *(rng.randint(-10**9, 10**9) for _ in range(10))]:
                inside = (lo is None or n >= lo) and (hi is None or n <= hi)
                assert bool(rx.fullmatch(str(n))) == inside, (lo, hi, n)
        for junk in ("-0", "00", "01", "-01", "", "+1", "1.0"):
            assert not rx.fullmatch(junk), (lo, hi, junk)


def test_an_open_side_goes_to_the_converters_sixteen_digits() -> None:
    rx = re.compile(range_regex(range_tree(0, None)))
    assert rx.fullmatch("9" * OPEN_DIGITS) and not rx.fullmatch("1" + "0" * OPEN_DIGITS)
    assert range_gbnf(range_tree(7, 7)) == '"7"'


@pytest.mark.parametrize("schema, bounds", [
    ({"minimum": 0, "maximum": 120}, (0, 120)),
    ({"exclusiveMinimum": 0, "exclusiveMaximum": 10}, (1, 9)),
    ({"minimum": 0.5, "maximum": 9.5}, (1, 9)),
    ({"minimum": 3, "exclusiveMinimum": 3}, (4, None)),
    ({"minimum": -5.5, "exclusiveMaximum": -4}, (-5, -5)),
    ({"maximum": -1}, (None, -1)),
])
def test_bounds_of_an_integer_schema(schema: dict, bounds: tuple) -> None:
    assert integer_bounds(schema) == bounds


@pytest.mark.parametrize("schema, why", [
    ({"minimum": 5, "maximum": 4}, "no integer"), ({"minimum": "1"}, "minimum must be a finite number"),
    ({"maximum": 10**50}, "more than 40 digits"), ({"exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer"),
    ({"minimum": -5, "exclusiveMinimum": True}, "true is draft 4's form"),
    ({"maximum": 5, "exclusiveMaximum": False}, "false is draft 4's form"),
])
def test_bounds_no_integer_meets_are_refused(schema: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        integer_bounds(schema)
