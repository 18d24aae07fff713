"""Where the checkout is: the generators read systemd/, docs/ and edge/ from it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
