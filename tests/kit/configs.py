"""What the tests give edge: a config file in a tmp dir for one tiny model, listening on port 0
unless told otherwise (`write_config`)."""

from __future__ import annotations

from pathlib import Path

from harness import EDGE

__all__ = ["EDGE", "write_config"]


def write_config(path: Path, model: Path, *, port: int = 0, extra_model: str = "",
                 extra: str = "", n_ctx: int = 256, server: str = "", host: str = "127.0.0.1") -> Path:
    path.write_text(f"""
[server]
host = "{host}"
port = {port}
{server}

[paths]
state_dir = "{path.parent / 'state'}"
cache_dir = "{path.parent / 'cache'}"

[[models]]
name = "tiny"
path = "{model}"
n_ctx = {n_ctx}
{extra_model}

[warmup]
decode_tokens = 4
{extra}
""")
    return path
