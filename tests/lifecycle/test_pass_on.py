"""A handover's pass-on (edge.lifecycle.handover.pass_on) between two uvicorn servers in one
process, built as edge builds them (edge.lifecycle.server.uvicorn_server): a request the first
one's app answers with the PASSED_ON head goes, with its connection, to the second, which
answers it and the next request on the same connection. This pins what pass_on relies on of
uvicorn (pyproject.toml's range): the h11 cycle's `scope` (the very dict the app gets), its
`trailing_data`, `Config.http_protocol_class` and the protocol's constructor, `server_state`,
`lifespan.state`, and a connection lost before any response is answered by nobody (no 500)."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
from functools import partial
from typing import Any

import pytest

from edge.lifecycle.handover.pass_on import PassOn, adopt, receive_connections, request_bytes
from edge.lifecycle.server import uvicorn_server
from edge.serve.endings import PASSED_ON


async def _body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _json(send: Any, status: int, data: dict[str, Any], extra: list[tuple[bytes, bytes]] = ()) -> None:
    raw = json.dumps(data).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()), *extra]})
    await send({"type": "http.response.body", "body": raw})


async def old_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The old process: every request is passed on (as a queued one at the switch is)."""
    await _body(receive)
    await send({"type": "http.response.start", "status": 307, "headers": [PASSED_ON]})
    await send({"type": "http.response.body", "body": b""})


async def new_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = await _body(receive)
    await _json(send, 200, {"served_by": "new", "path": scope["path"], "query": scope["query_string"].decode(),
                            "body": body.decode(), "auth": dict(scope["headers"]).get(b"authorization", b"").decode()})


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def _client(port: int) -> list[tuple[int, dict[str, Any]]]:
    """Two requests on one kept-alive connection to the old server."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    got = []
    for i in range(2):
        c.request("POST", f"/v1/completions?n={i}", body=json.dumps({"prompt": "x" * 70_000, "i": i}),
                  headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        r = c.getresponse()
        got.append((r.status, json.loads(r.read())))
    c.close()
    return got


def test_a_passed_on_request_is_answered_by_the_other_server_on_the_same_connection(caplog) -> None:
    async def go() -> tuple[list[tuple[int, dict[str, Any]]], PassOn]:
        loop = asyncio.get_running_loop()
        old_sock, new_sock = _listening(), _listening()
        passing = PassOn(old_app, lambda: old.server_state.connections)  # `old` is made next, as build_server does
        old = uvicorn_server(passing, lambda s: None)
        new = uvicorn_server(new_app, lambda s: None)
        tasks = [asyncio.ensure_future(old.serve(sockets=[old_sock])), asyncio.ensure_future(new.serve(sockets=[new_sock]))]
        await asyncio.gather(old.listening.wait(), new.listening.wait())
        ours, theirs = socket.socketpair()
        passing.to(ours)
        receive_connections(theirs, loop, partial(adopt, new))
        try:
            return await asyncio.to_thread(_client, old_sock.getsockname()[1]), passing
        finally:
            old.should_exit = new.should_exit = True
            await asyncio.gather(*tasks)
            ours.close()

    with caplog.at_level(logging.INFO):
        got, passing = asyncio.run(go())
    assert [s for s, _ in got] == [200, 200]
    for i, (_, answer) in enumerate(got):
        assert answer["served_by"] == "new" and answer["query"] == f"n={i}" and answer["auth"] == "Bearer k"
        assert json.loads(answer["body"]) == {"prompt": "x" * 70_000, "i": i}
    assert passing.passed == 1  # the second request went straight to the new server: the connection is its
    assert passing.refused == 0
    assert "ASGI callable returned without" not in caplog.text and "Exception in ASGI" not in caplog.text


def test_without_a_channel_a_passed_on_request_is_a_503_to_retry() -> None:
    async def go() -> tuple[int, dict[str, str], bytes]:
        sock = _listening()
        server = uvicorn_server(PassOn(old_app, lambda: server.server_state.connections), lambda s: None)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        await server.listening.wait()

        def one() -> tuple[int, dict[str, str], bytes]:
            c = http.client.HTTPConnection(*sock.getsockname(), timeout=30)
            c.request("POST", "/v1/completions", body=b"{}")
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()

        try:
            return await asyncio.to_thread(one)
        finally:
            server.should_exit = True
            await task

    status, headers, body = asyncio.run(go())
    assert status == 503 and headers["retry-after"] == "0" and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "server_shutting_down"


@pytest.mark.parametrize("query, version", [(b"", "1.1"), (b"a=1&b=2", "1.0")])
def test_the_request_is_sent_on_as_read_with_its_whole_body(query: bytes, version: str) -> None:
    scope = {"method": "POST", "raw_path": b"/v1/chat/completions", "query_string": query, "http_version": version,
             "headers": [(b"host", b"edge"), (b"transfer-encoding", b"chunked"), (b"expect", b"100-continue"),
                         (b"x-api-key", b"k")]}
    raw = request_bytes(scope, b'{"a": 1}')
    head, body = raw.split(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/chat/completions%s HTTP/%s" % (b"?" + query if query else b"", version.encode())
    assert lines[1:] == [b"host: edge", b"x-api-key: k", b"content-length: 8"] and body == b'{"a": 1}'
