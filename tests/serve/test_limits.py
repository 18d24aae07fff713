"""Hostile traffic against a real `edge serve` (kit.PidOne, 127.0.0.1, port 0): idle floods,
slowloris heads, slow and large bodies, lone surrogates, huge prompts, restarts under
keep-alive clients, and the inherited socket's backlog. After each, a normal request works."""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from kit import metric, post, write_config
from kit.docs import section as docs_section

NORMAL = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def _answers(address: tuple[str, int]) -> None:
    status, body = post(address, "/v1/completions", NORMAL)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1


def _server(tmp_path: Path, tiny_gguf: Path, service, server: str, **options):
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    text = cfg.read_text().replace('[server]\n', f'[server]\n{server}\n', 1)
    cfg.write_text(text)
    return service(cfg, **options)


def _tcp_info(sock: socket.socket) -> tuple[int, int]:
    """(accept queue length now, its maximum: the backlog) of a listening TCP socket."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("II", info, 24)


def _connections_held(pid: int, port: int) -> int:
    """TCP connections to `port` that process `pid` holds open (its fds vs /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed meanwhile
        if target.startswith("socket:"):
            inodes.add(target[8:-1])
    held = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and f[3] == "01" and f[9] in inodes:
            held += 1
    return held


def _until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)  # bounded poll of a real condition


def _closed_by_server(conn: socket.socket, timeout: float = 30.0, dribble: bytes | None = None) -> bool:
    """Wait (bounded) for the server to close `conn`, sending `dribble` every 0.2 s meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        readable, _, _ = select.select([conn], [], [], 0.2)
        if readable:
            try:
                if conn.recv(65536) == b"":
                    return True
            except ConnectionResetError:
                return True
        elif dribble:
            try:
                conn.sendall(dribble)
            except (BrokenPipeError, ConnectionResetError):
                return True
    return False


# -- connections ---------------------------------------------------------------------------------
def _closed(conns: list[socket.socket]) -> int:
    """How many of `conns` the server has closed by now (EOF or reset waiting to be read)."""
    poller = select.poll()  # not select(): a flood's descriptors pass FD_SETSIZE
    by_fd = {c.fileno(): c for c in conns}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    closed = 0
    for fd, _ in poller.poll(0):
        try:
            closed += by_fd[fd].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except ConnectionResetError:
            closed += 1
        except BlockingIOError:
            pass
    return closed


def _raise_nofile(need: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"this test needs {need} file descriptors; the hard RLIMIT_NOFILE is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


FLOOD = 1100
FLOOD_HEADER_TIMEOUT_S = 120.0  # so large that only shedding can free a slot within the test


@pytest.mark.parametrize("nofile", [None, 1024], ids=["default-limits", "LimitNOFILE=1024"])
def test_a_flood_of_half_heads_is_shed_and_a_normal_client_is_answered(tmp_path, tiny_gguf, nofile) -> None:
    from kit import EDGE
    from kit import PidOne, half_heads, metric

    _raise_nofile(FLOOD + 200)
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    cfg.write_text(cfg.read_text().replace("[server]\n", f"[server]\nheader_timeout_s = {FLOOD_HEADER_TIMEOUT_S}\n"))
    argv = [*EDGE, "serve", "--config", str(cfg)]
    if nofile is not None:  # as under the unit's LimitNOFILE=1024: edge lowers max_connections
        argv = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *argv]
    with PidOne(argv) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        lowered = re.search(r"serving at most (\d+) connections", pid1.log_tail(100_000))
        limit = int(lowered.group(1)) if lowered else 1024
        assert (limit == 768) == (nofile == 1024)
        flood = half_heads(pid1.address, FLOOD)
        try:
            t0 = time.monotonic()
            status, body = post(pid1.address, "/v1/completions", NORMAL, timeout=FLOOD_HEADER_TIMEOUT_S / 4)
            latency = time.monotonic() - t0
            assert status == 200, body
            print(f"\nflood of {FLOOD} half heads at max_connections {limit}: a normal client answered "
                  f"in {latency:.3f} s (header_timeout_s {FLOOD_HEADER_TIMEOUT_S:g}; load average "
                  f"{os.getloadavg()[0]:.2f})")
            assert latency < FLOOD_HEADER_TIMEOUT_S / 8  # shed at once, not freed by the timeout
            # Room was made for the flood's last connections and the normal client by closing the
            # flood's oldest: counted, logged once for the burst; the service stays at its limit.
            needed = FLOOD + 1 - limit
            _until(lambda: _closed(flood) >= needed, f"{needed} flood connections closed")
            assert metric(pid1.address, "edge_connections_shed_total") >= needed
            assert _connections_held(pid1.proc.pid, pid1.address[1]) <= limit
            assert _closed(flood[-100:]) == 0  # the youngest were kept
            log = pid1.log_tail(1_000_000)
            assert log.count("closing the connections that waited longest for a request head") == 1, log[-3000:]
        finally:
            for c in flood:
                c.close()
        _answers(pid1.address)


def test_connections_in_a_request_are_never_shed(tmp_path, tiny_gguf, service) -> None:
    pid1 = _server(tmp_path, tiny_gguf, service, "max_connections = 4\nbody_timeout_s = 60.0")
    pid, port = pid1.proc.pid, pid1.address[1]
    busy = [socket.create_connection(pid1.address, timeout=30) for _ in range(4)]
    answered = threading.Event()
    try:
        for c in busy:  # each in a request: its head is complete, its body half sent
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 36\r\n\r\n{\"prompt\": ")
        _until(lambda: _connections_held(pid, port) == 4, "4 connections held")
        # A new client waits in the listen backlog: nothing may be shed to admit it.
        waiting = threading.Thread(target=lambda: (_answers(pid1.address), answered.set()), daemon=True)
        waiting.start()
        _until(lambda: _tcp_info(pid1.listener)[0] == 1, "1 connection left in the backlog")
        # The kernel queues the connection before the server's loop turns to accept it and says so.
        _until(lambda: "connection limit reached: 4 open (server.max_connections)" in pid1.log_tail(100_000),
               "the limit said in the log")
        assert _closed(busy) == 0 and not answered.is_set() and _tcp_info(pid1.listener)[0] == 1
        for c in busy:  # the requests end: their connections go idle, and now may be shed
            c.sendall(b'"Hello", "max_tokens": 2}')
            assert c.recv(65536).startswith(b"HTTP/1.1 200")
        waiting.join(60)
        assert answered.is_set()
    finally:
        for c in busy:
            c.close()
    assert "Traceback" not in pid1.log_tail(100_000)


def test_slowloris_head_is_closed(tmp_path, tiny_gguf, service) -> None:
    pid1 = _server(tmp_path, tiny_gguf, service, "header_timeout_s = 1.0")
    with socket.create_connection(pid1.address, timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert _closed_by_server(c, dribble=b"X-Slow: 1\r\n")
    _answers(pid1.address)


def test_idle_keepalive_connection_is_closed(tmp_path, tiny_gguf, service) -> None:
    pid1 = _server(tmp_path, tiny_gguf, service, "keepalive_timeout_s = 0.5")
    with socket.create_connection(pid1.address, timeout=30) as c:
        body = json.dumps(NORMAL).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        first = c.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower()
        assert _closed_by_server(c)  # kept alive, then closed once idle
    _answers(pid1.address)


def test_slow_body_is_408_and_large_body_413(tmp_path, tiny_gguf, service) -> None:
    pid1 = _server(tmp_path, tiny_gguf, service, "body_timeout_s = 1.0\nmax_body_bytes = 4096")
    with socket.create_connection(pid1.address, timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        raw = b"".join(iter(lambda: c.recv(65536), b""))
    assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
    assert b"server.body_timeout_s" in raw

    big = json.dumps({"prompt": "x" * 100_000}).encode()
    c = http.client.HTTPConnection(*pid1.address, timeout=30)
    c.request("POST", "/v1/completions", body=big, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    answer = json.loads(r.read())
    assert r.status == 413 and "Content-Length is" in answer["error"]["message"]
    assert "server.max_body_bytes" in answer["error"]["message"]
    # The same body streamed (chunked, no Content-Length): counted, refused once over the limit.
    c.request("POST", "/v1/completions", body=iter([big[i:i + 1000] for i in range(0, len(big), 1000)]),
              headers={"Content-Type": "application/json"}, encode_chunked=True)
    r = c.getresponse()
    answer = json.loads(r.read())
    assert r.status == 413 and "more than 4096 bytes arrived" in answer["error"]["message"]
    c.close()
    # The limits layer's answers are counted like the app's, by route and status.
    assert metric(pid1.address, "edge_requests_total", route="/v1/completions", status="408") == 1
    assert metric(pid1.address, "edge_requests_total", route="/v1/completions", status="413") == 2
    _answers(pid1.address)


# -- request input -------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": "\udfff"}]}, "messages[1].content"),
])
def test_lone_surrogate_is_400_naming_the_field(tiny_config, service, path, body, field) -> None:
    pid1 = service(tiny_config)
    status, answer = post(pid1.address, path, body)
    assert status == 400, answer
    assert answer["error"]["message"].startswith(f"{field}: ") and "surrogate" in answer["error"]["message"]
    assert metric(pid1.address, "edge_requests_total", route=path, status="400") == 1
    _answers(pid1.address)


def test_raw_surrogates_utf16_bodies_and_huge_logit_bias_keys_are_400_never_500(tiny_config, service) -> None:
    """Issue 33's last 500s: a surrogate's own bytes in a UTF-8 body, a UTF-16 body with a lone
    surrogate (json.loads decodes both with "surrogatepass"), a logit_bias key of 5,000 digits
    (past Python's int() digit limit)."""
    pid1 = service(tiny_config)
    chat = '{"messages": [{"role": "user", "content": "a \ud800 b"}], "max_tokens": 2}'
    cases = [
        ("/v1/completions", b'{"prompt": "a \xed\xa0\x80 b", "max_tokens": 2}', "prompt"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a \xed\xb0\x80"}]}', "messages"),
        ("/v1/chat/completions", chat.encode("utf-16", "surrogatepass"), "messages"),  # with a BOM
        ("/v1/chat/completions", chat.encode("utf-16-le", "surrogatepass"), "messages"),
        ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "logit_bias": {"7" * 5000: 1}}).encode(),
         "logit_bias"),
    ]
    for path, body, field in cases:
        status, _, answer = _post_bytes(pid1.address, path, body)
        assert status == 400, (path, body[:60], answer)
        assert answer["error"]["param"] == field and answer["error"]["message"].startswith(field), answer
    # a UTF-16 body without a lone surrogate (an emoji is a surrogate pair there) is served
    ok = '{"messages": [{"role": "user", "content": "hi \U0001F600"}], "max_tokens": 2}'
    assert _post_bytes(pid1.address, "/v1/chat/completions", ok.encode("utf-16"))[0] == 200
    assert metric(pid1.address, "edge_requests_total", status="400") == len(cases)
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    assert "Traceback" not in pid1.log_tail(100_000)


def test_a_request_that_samples_too_slowly_is_ended_at_the_request_limit_and_the_next_is_served(
        tmp_path, tiny_gguf, service) -> None:
    """The limit on the tiny model: a request under a grammar of 256 alternatives asking for
    2,000 tokens holds the model longer than `request_timeout_s = 0.2`. It ends at the token that
    passes the limit with the documented 422 `generation_timeout` (streamed: an error event, then
    [DONE]), and a request that queued behind it is answered. (The tiny vocabulary keeps even a
    wide grammar cheap per token; Gemma's test below makes the sampling itself slow.)"""
    # one thread: a decode never waits for a second one that a busy machine has not scheduled
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, n_ctx=2048, extra_model="n_threads = 1")
    cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nrequest_timeout_s = 0.2\n", 1))
    pid1 = service(cfg)
    schema = {"type": "array", "items": {"enum": [f"w{i:05d}" for i in range(256)]}, "minItems": 700}
    slow = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    status, answer = post(pid1.address, "/v1/chat/completions", slow)
    assert status == 422 and answer["error"]["code"] == "generation_timeout", answer
    assert "server.request_timeout_s = 0.2 s" in answer["error"]["message"], answer
    told = int(re.search(r"\((\d+) tokens of this choice", answer["error"]["message"])[1])
    assert 0 < told < 2000
    # streamed, with a normal request sent once the slow one is admitted (its first event, the
    # role, comes as its generation is handed to the model's thread): it waits its turn
    c = http.client.HTTPConnection(*pid1.address, timeout=120)
    c.request("POST", "/v1/chat/completions", body=json.dumps({**slow, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: {")
    queued: dict[str, object] = {}
    normal = threading.Thread(target=lambda: queued.update(answer=post(pid1.address, "/v1/completions", NORMAL)))
    normal.start()
    rest = r.read().decode()
    c.close()
    normal.join(120)
    errors = [json.loads(e[6:]) for e in rest.splitlines() if e.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "generation_timeout", rest[-500:]
    assert rest.rstrip().endswith("data: [DONE]")
    assert queued["answer"][0] == 200, queued
    assert metric(pid1.address, "edge_requests_total", route="/v1/chat/completions", status="422") == 1
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    assert "Traceback" not in pid1.log_tail(100_000)


@pytest.mark.gemma
def test_gemma_sampling_made_slow_by_a_wide_grammar_is_ended_at_the_request_limit(tmp_path, gemma_path,
                                                                                  service) -> None:
    """What really makes a token's sampling slow: a grammar of 128 look-alike objects at once (256
    grammar stacks, the most a JSON schema may keep) over Gemma 3's 262,144 candidates, each time the token drawn
    (temperature 1) is one the grammar rejects; a tenth of a second and more per such token. The
    request ends at `request_timeout_s` with 422 `generation_timeout`, and the request queued
    behind it is answered."""
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>user\\n{{ m['content'] }}"
                "<end_of_turn>\\n{% endfor %}<start_of_turn>model\\n")
    cfg = write_config(tmp_path / "edge.toml", gemma_path, n_ctx=1024, extra_model=f'chat_template = "{template}"')
    cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nrequest_timeout_s = 3.0\n", 1))
    pid1 = service(cfg, timeout=300)
    keys = [f"{chr(97 + i % 26)}{i:03d}" for i in range(128)]  # 256 grammar stacks: the most accepted
    schema = {"type": "array", "minItems": 100, "items": {"anyOf": [
        {"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in keys]}}
    slow = {"messages": [{"role": "user", "content": "Write a poem about the sea."}], "max_tokens": 400,
            "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
    queued: dict[str, object] = {}
    c = http.client.HTTPConnection(*pid1.address, timeout=300)
    c.request("POST", "/v1/chat/completions", body=json.dumps({**slow, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: {")
    normal = threading.Thread(target=lambda: queued.update(answer=post(
        pid1.address, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})))
    normal.start()
    rest = r.read().decode()
    c.close()
    normal.join(300)
    errors = [json.loads(e[6:])["error"] for e in rest.splitlines() if e.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["code"] == "generation_timeout", rest[-500:]
    assert "server.request_timeout_s = 3 s" in errors[0]["message"]
    assert queued["answer"][0] == 200, queued
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    assert "Traceback" not in pid1.log_tail(100_000)


def _post_bytes(address: tuple[str, int], path: str, body: bytes) -> tuple[int, str, object]:
    c = http.client.HTTPConnection(*address, timeout=60)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        raw = r.read().decode()
    finally:
        c.close()
    return r.status, r.getheader("content-type", ""), json.loads(raw) if raw.startswith("{") else raw


def _nested(levels: int, leaf: object) -> object:
    for _ in range(levels):
        leaf = {"k": leaf}
    return leaf


def test_deep_json_is_400_naming_the_limit_never_500(tiny_config, service) -> None:
    from edge.serve.jsoncheck import MAX_JSON_DEPTH

    pid1 = service(tiny_config)
    kinds = {"arrays": (b"[", b"]"), "objects": (b'{"a":', b"}")}
    leaves = {"plain": b"1", "lone surrogate": b'"\\ud800"'}
    cases = [(n, k, leaf) for n in (10_000, 100_000) for k in kinds for leaf in leaves]
    for n, kind, leaf in cases:
        opening, closing = kinds[kind]
        status, ctype, answer = _post_bytes(pid1.address, "/v1/chat/completions",
                                            opening * n + leaves[leaf] + closing * n)
        assert (status, ctype) == (400, "application/json"), (n, kind, leaf, status, answer)
        assert f"more than {MAX_JSON_DEPTH} levels deep" in answer["error"]["message"], answer
        assert answer["error"]["code"] == "json_too_deep"
    assert metric(pid1.address, "edge_requests_total", route="/v1/chat/completions", status="400") == len(cases)
    assert metric(pid1.address, "edge_requests_total", status="500") == 0
    # The limit itself: the body's object and `metadata` count, 64 levels pass, 65 do not.
    at_limit = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "metadata": _nested(MAX_JSON_DEPTH - 1, "x")}
    assert post(pid1.address, "/v1/chat/completions", at_limit)[0] == 200
    status, answer = post(pid1.address, "/v1/chat/completions", {**at_limit, "metadata": {"k": at_limit["metadata"]}})
    assert status == 400 and "levels deep" in answer["error"]["message"]
    assert "Traceback" not in pid1.log_tail(100_000)


def test_prompt_too_long_by_bytes_is_refused_before_tokenizing(tiny_config, service) -> None:
    pid1 = service(tiny_config)
    status, answer = post(pid1.address, "/v1/completions", {"prompt": "word " * 400_000, "max_tokens": 2})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "2000000 bytes" in answer["error"]["message"]
    _answers(pid1.address)


# -- restarts ------------------------------------------------------------------------------------
class KeepAliveClients:
    """N threads, each reusing one HTTP/1.1 connection for as long as the server keeps it open
    (http.client reconnects after a `Connection: close`), every answer checked."""

    def __init__(self, address: tuple[str, int], n: int = 6) -> None:
        self.address, self.n = address, n
        self.ok = self.reused = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]

    def _loop(self) -> None:
        c = http.client.HTTPConnection(*self.address, timeout=60)
        body = json.dumps(NORMAL)
        deadline = time.monotonic() + 180
        while not self._stop.is_set() and time.monotonic() < deadline:
            reused = c.sock is not None
            try:
                c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                r = c.getresponse()
                data = r.read()
                good, err = r.status == 200, f"HTTP {r.status} {data[:100]!r}"
            except (OSError, http.client.HTTPException) as exc:
                good, err = False, f"{type(exc).__name__}: {exc} (reused connection: {reused})"
                c.close()
            with self._lock:
                if good:
                    self.ok += 1
                    self.reused += reused
                else:
                    self.errors.append(err)
        c.close()

    def wait_ok(self, n: int) -> None:
        _until(lambda: self.ok >= n, f"{n} answers ({self.ok}; errors {self.errors[:3]})", 120)

    def __enter__(self) -> "KeepAliveClients":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def test_restarts_under_keepalive_clients_fail_nothing(tmp_path, tiny_gguf, service) -> None:
    pid1 = service(write_config(tmp_path / "edge.toml", tiny_gguf))
    with KeepAliveClients(pid1.address) as clients:
        clients.wait_ok(20)
        for _ in range(2):
            assert pid1.stop() == 0
            before = clients.ok
            pid1.start()
            pid1.wait_for("READY", "1")
            clients.wait_ok(before + 20)
    print(f"\nkeep-alive restarts: {clients.ok} ok ({clients.reused} on reused connections), "
          f"{len(clients.errors)} failed")
    assert clients.errors == []
    assert clients.reused > clients.ok // 2  # the clients really kept their connections alive
    assert "Traceback" not in pid1.log_tail(100_000)


def test_inherited_socket_keeps_its_backlog(tiny_config, service) -> None:
    pid1 = service(tiny_config, backlog=300)
    assert _tcp_info(pid1.listener)[1] == 300
    _answers(pid1.address)
    assert pid1.stop() == 0
    assert _tcp_info(pid1.listener)[1] == 300


@pytest.mark.parametrize("shape, words", [
    ([4294967296, 4294967296, 16], "holds 295147905179352825856 values, more than any tensor may"),
    ([0, 1 << 40], "more than any tensor may"),
])
def test_kserve_shape_overflow_is_400_naming_the_input(ort_service, shape, words) -> None:
    pid1, _ = ort_service
    status, body = post(pid1.address, "/v2/models/mlp/infer",
                        {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": []}]})
    assert status == 400, body
    assert body["error"]["message"].startswith("inputs[0] (x): shape") and words in body["error"]["message"]
    status, _ = post(pid1.address, "/v2/models/mlp/infer",
                     {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.0] * 16}]})
    assert status == 200


def test_kserve_non_finite_data_and_overflowing_outputs_are_400_never_500(ort_service) -> None:
    """NaN, Infinity, -Infinity (which Python's JSON parser takes), 1e400 (infinity once parsed)
    and integers past INT64 are a 400 naming the input; finite inputs that overflow inside the
    model give outputs JSON cannot carry: the documented `output_not_finite`, never a 500."""
    pid1, _ = ort_service
    before = metric(pid1.address, "edge_requests_total", status="500")

    def infer(data: str, datatype: str = "FP32") -> tuple[int, dict]:
        body = f'{{"inputs": [{{"name": "x", "shape": [1, 16], "datatype": "{datatype}", "data": {data}}}]}}'
        status, _, answer = _post_bytes(pid1.address, "/v2/models/mlp/infer", body.encode())
        return status, answer

    for bad in ("NaN", "Infinity", "-Infinity", "1e400", "1e39"):
        status, answer = infer("[" + ", ".join(["0.5"] * 15 + [bad]) + "]")
        assert status == 400, (bad, answer)
        assert answer["error"]["param"] == "inputs", answer
        assert answer["error"]["message"].startswith("inputs[0] (x): data holds"), answer
        assert "at flat index 15" in answer["error"]["message"], answer
    status, answer = infer("[" + ", ".join(["3.4e38"] * 16) + "]")
    assert status == 400, answer
    assert answer["error"]["code"] == "output_not_finite" and "not finite" in answer["error"]["message"], answer
    status, answer = infer("[" + ", ".join(["1"] * 15 + ["1" + "0" * 30]) + "]", datatype="INT64")
    assert status == 400 and "outside the range of INT64" in answer["error"]["message"], answer
    assert infer("[" + ", ".join(["0.5"] * 16) + "]")[0] == 200
    assert metric(pid1.address, "edge_requests_total", status="500") == before  # the service is shared
    assert "Traceback" not in pid1.log_tail(100_000)


def test_file_descriptor_limit_fits_max_connections(tmp_path, tiny_gguf) -> None:
    from edge.config import ServerConfig
    from edge.serve.limits import nofile_for
    from edge.host.units import UnitOptions, render_service
    from kit import EDGE, PidOne

    assert f"LimitNOFILE={nofile_for(ServerConfig().max_connections)}\n" in render_service(UnitOptions())
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    cfg.write_text(cfg.read_text().replace("[server]\n", "[server]\nmax_connections = 100\n"))
    # A soft limit below what 100 connections need is raised (the hard one allows it) ...
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < nofile_for(100):
        pytest.skip(f"the hard RLIMIT_NOFILE here ({hard}) is below {nofile_for(100)}")
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    argv = ["prlimit", f"--nofile=64:{hard_text}", "--", *EDGE, "serve", "--config", str(cfg)]
    with PidOne(argv) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        limits = Path(f"/proc/{pid1.proc.pid}/limits").read_text()
        assert re.search(rf"Max open files\s+{nofile_for(100)}\s+{hard_text}\s", limits), limits
        _answers(pid1.address)
    # ... and where the hard limit cannot hold them, fewer are served, with a warning.
    argv[1] = "--nofile=600:600"
    with PidOne(argv) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1")
        _answers(pid1.address)
        assert "RLIMIT_NOFILE is 600 (LimitNOFILE= of the unit): serving at most 450 connections" \
            in pid1.log_tail(100_000)


def test_documented_limits_match_the_config() -> None:
    from edge import toml
    from edge.config import ServerConfig
    from edge.serve.jsoncheck import MAX_JSON_DEPTH
    from edge.serve.limits import FD_RESERVE

    block = docs_section("A commented example").split("```toml\n", 1)[1].split("```", 1)[0]  # docs/config.md
    server = toml.loads(block.split("[paths]", 1)[0])["server"]
    defaults = ServerConfig()
    for name, value in server.items():
        assert getattr(defaults, name) == value, name
    section = docs_section("Limits (what one client may hold or send)")  # docs/api.md
    for name in ("max_connections", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
                 "max_body_bytes", "max_queue"):
        assert f"`{name}`" in section and name in server, name
    assert f"`max_connections` + {FD_RESERVE}" in section
    assert f"| JSON nested more than {MAX_JSON_DEPTH} arrays/objects deep" in section
