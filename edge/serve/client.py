"""HTTP/1.1 on the wire for edge's own clients (warm-up, harness, benchmarks, demo): one request
per connection, Connection: close, chunked responses (SSE streams) unframed."""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["encode_request", "parse_response", "request"]


def encode_request(method: str, path: str, body: dict[str, Any] | bytes | None = None) -> bytes:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else b"")
    return (f"{method} {path} HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def parse_response(raw: bytes) -> tuple[int, bytes]:
    """(status, body) of a whole response read to EOF; status 0 if it is not HTTP/1.1."""
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    if b"transfer-encoding: chunked" in head.lower():
        payload = _dechunk(payload)
    return status, payload


def _dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2


def request(address: tuple[str, int], method: str, path: str,
            body: dict[str, Any] | bytes | None = None, timeout: float = 300.0) -> tuple[int, bytes]:
    """One blocking request on its own connection."""
    with socket.create_connection(address, timeout=timeout) as s:
        s.sendall(encode_request(method, path, body))
        raw = b"".join(iter(lambda: s.recv(65536), b""))
    return parse_response(raw)
