"""/metrics against a real `edge serve` subprocess: hostile paths, route templates, streams timed to
their end, warm-up counted apart, phases per model, and `promtool check metrics`."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.serve.app import ServiceState, build_app
from edge.device.identity import detect
from edge.engines.build import build_engine
from edge.engines.recipe import load_recipe
from edge.engines.store import EngineStore
from edge.serve.metrics import UNMATCHED, Metrics
from edge.serve.worker import EngineWorker
from kit import EDGE, dies_with_us, write_config

RECIPE = Path(__file__).resolve().parents[2] / "engines" / "mlp-demo.toml"

Families = dict[str, list]  # family name -> its samples


@dataclass
class Service:
    address: tuple[str, int]
    first_scrape: str  # taken right after READY=1, before any other request
    report: dict
    proc: subprocess.Popen
    log: Path


def _spawn(cfg: Path, listener: socket.socket, notify_path: str, log: Path) -> subprocess.Popen:
    """`edge serve` as systemd starts it: the listening socket as fd 3 (LISTEN_FDS/LISTEN_PID, the
    pid that exec keeps) and NOTIFY_SOCKET for READY=1."""
    fd = listener.fileno()
    env = {**os.environ, "LISTEN_FDS": "1", "NOTIFY_SOCKET": notify_path}
    # bash, not sh: dash takes single-digit fds only in redirections
    script = f'export LISTEN_PID=$$; exec "$@" 3<&{fd} {fd}<&-'
    with open(log, "wb") as out:
        return subprocess.Popen(dies_with_us(["bash", "-c", script, "bash", *EDGE, "serve", "--config", str(cfg)]),
                                env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)


def _wait_ready(notify: socket.socket, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    notify.settimeout(0.5)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"edge serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if b"READY=1" in notify.recv(4096).split(b"\n"):
                return
        except socket.timeout:
            continue
    raise TimeoutError(f"no READY=1 in {timeout} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("metrics")
    # a language model and an engine side by side: both are warmed up, each phase per target
    build_engine(load_recipe(RECIPE), "onnxruntime", EngineStore(tmp / "store"), detect(), log=lambda s: None)
    engine = (f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{RECIPE}"\n'
              f'store = "{tmp / "store"}"\n')
    cfg = write_config(tmp / "edge.toml", tiny_gguf, n_ctx=512, extra=engine)
    listener = socket.create_server(("127.0.0.1", 0))
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify"))
    proc = _spawn(cfg, listener, str(tmp / "notify"), tmp / "service.log")
    try:
        _wait_ready(notify, proc, tmp / "service.log")
        address = listener.getsockname()[:2]
        report = json.loads((tmp / "state" / "last-start.json").read_text())
        yield Service(address, get(address, "/metrics")[1].decode(), report, proc, tmp / "service.log")
    finally:
        proc.kill()
        proc.wait(30)
        notify.close()
        listener.close()


def get(address: tuple[str, int], path: str, method: str = "GET",
        body: dict | None = None) -> tuple[int, bytes]:
    c = http.client.HTTPConnection(*address, timeout=60)
    c.request(method, path, body=json.dumps(body) if body is not None else None,
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def raw(address: tuple[str, int], request_line: bytes) -> bytes:
    with socket.create_connection(address, timeout=30) as s:
        s.sendall(request_line + b"\r\nHost: x\r\nConnection: close\r\n\r\n")
        return b"".join(iter(lambda: s.recv(65536), b""))


def families(text: str) -> Families:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(fams: Families, family: str, sample: str, **labels: str) -> float:
    """The sum of `sample` over the series of `family` whose labels include `labels`."""
    return sum(s.value for s in fams.get(family, []) if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def delta(before: Families, after: Families, family: str, sample: str, **labels: str) -> float:
    return value(after, family, sample, **labels) - value(before, family, sample, **labels)


def scrape(service: Service) -> Families:
    status, text = get(service.address, "/metrics")
    assert status == 200
    return families(text.decode())


def test_warmup_traffic_is_counted_apart(service: Service) -> None:
    fams = families(service.first_scrape)
    steps = [s for p in service.report["phases"] if p["name"] == "warmup" for s in p["detail"]["steps"]]
    assert {s["model"] for s in steps} == {"tiny", "mlp"}
    # every warm-up request crossed the middleware, and none of them counts as production traffic
    assert value(fams, "edge_warmup_requests", "edge_warmup_requests_total") == len(steps)
    assert value(fams, "edge_warmup_requests", "edge_warmup_requests_total",
                 route="/v2/models/{name}/infer") == sum(s["model"] == "mlp" for s in steps)
    assert value(fams, "edge_requests", "edge_requests_total") == 0
    assert value(fams, "edge_request_duration_seconds", "edge_request_duration_seconds_count") == 0
    assert value(fams, "edge_completion_tokens", "edge_completion_tokens_total") == 0
    assert value(fams, "edge_time_to_first_token_seconds", "edge_time_to_first_token_seconds_count") == 0
    assert value(fams, "edge_ready", "edge_ready") == 1
    assert value(fams, "edge_queue_depth", "edge_queue_depth", model="tiny", kind="model") == 0
    assert value(fams, "edge_queue_depth", "edge_queue_depth", model="mlp", kind="engine") == 0


def test_hostile_path_404_405_keep_exposition_parseable(service: Service) -> None:
    before = scrape(service)
    # scope["path"] is percent-decoded: this path holds a '"', a newline and a backslash
    assert raw(service.address, b'GET /v1/x"%0A%5C%22%7D%201 HTTP/1.1').startswith(b"HTTP/1.1 404")
    assert get(service.address, "/v1/completions")[0] == 405
    assert raw(service.address, b"BREW /healthz HTTP/1.1").startswith(b"HTTP/1.1 405")
    assert get(service.address, '/v2/models/no"pe%0A/infer', "POST", {"inputs": []})[0] == 404
    after = scrape(service)  # parses: text_string_to_metric_families raises on a broken exposition
    routes = {s.labels["route"] for s in after["edge_requests"]}
    assert routes <= {UNMATCHED, "/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz",
                      "/readyz", "/metrics", "/v2/models/{name}", "/v2/models/{name}/infer"}

    def more(**labels: str) -> float:
        return delta(before, after, "edge_requests", "edge_requests_total", **labels)

    assert more(route=UNMATCHED, method="GET", status="404") == 1
    assert more(route="/v1/completions", method="GET", status="405") == 1
    assert more(route="/healthz", method="OTHER", status="405") == 1
    assert more(route="/v2/models/{name}/infer", method="POST", status="404") == 1


def test_stream_is_timed_to_its_last_chunk(service: Service) -> None:
    before = scrape(service)
    body = json.dumps({"prompt": "Hello", "max_tokens": 64, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(service.address, timeout=60) as s:
        t_sent = time.perf_counter()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = s.recv(65536)
        t_first = time.perf_counter()
        while b"data: [DONE]" not in got:
            chunk = s.recv(65536)
            assert chunk, got[-300:]
            got += chunk
        t_done = time.perf_counter()
        got += b"".join(iter(lambda: s.recv(65536), b""))
        t_end = time.perf_counter()
    # a tiny model's 64 tokens may come in few events: pieces that arrive while the event loop is
    # busy are merged into one (docs/internals.md, "Steady state"); the last one says why the stream ended
    assert got.startswith(b"HTTP/1.1 200") and b'"finish_reason": "length"' in got.replace(b'":"', b'": "')
    after = scrape(service)
    fam, labels = "edge_request_duration_seconds", {"route": "/v1/completions", "method": "POST"}
    assert delta(before, after, fam, fam + "_count", **labels) == 1
    server_s = delta(before, after, fam, fam + "_sum", **labels)
    # The server's clock runs from the request's arrival to the last chunk (its connection closes
    # only after that): it fits inside the client's send-to-EOF span, and covers the stream the
    # client saw, first bytes to the last event. That second span is widened by how late the
    # client's process is woken for the last event (milliseconds on contended cores, as long as a
    # tiny model's whole stream): hence half of it; a clock stopped when the response object is
    # made reads under a hundredth.
    assert 0.5 * (t_done - t_first) <= server_s <= t_end - t_sent, \
        (t_done - t_first, server_s, t_end - t_sent)
    fam = "edge_time_to_first_token_seconds"
    assert delta(before, after, fam, fam + "_count", model="tiny") == 1


def test_tokens_counted_per_model(service: Service) -> None:
    before = scrape(service)
    status, data = get(service.address, "/v1/completions", "POST",
                       {"model": "tiny", "prompt": "Hello there", "max_tokens": 7, "temperature": 0})
    assert status == 200
    usage = json.loads(data)["usage"]
    after = scrape(service)
    for kind in ("prompt", "completion"):
        fam, sample = f"edge_{kind}_tokens", f"edge_{kind}_tokens_total"
        assert value(after, fam, sample, model="tiny") - value(before, fam, sample, model="tiny") \
            == usage[f"{kind}_tokens"]


def test_client_abort_counted_per_model(service: Service) -> None:
    def aborts() -> float:
        return value(scrape(service), "edge_client_aborts", "edge_client_aborts_total", model="tiny")

    requests = scrape(service)
    before = aborts()
    body = json.dumps({"prompt": "Hello", "max_tokens": 480, "temperature": 0, "stream": True}).encode()
    with socket.create_connection(service.address, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data: " not in got:
            got += s.recv(4096)
    # gone after the first chunk: the service notices at its next send or disconnect check
    deadline = time.monotonic() + 30
    while (now := aborts()) == before:
        assert time.monotonic() < deadline, "the abort was never counted"
    assert now == before + 1
    # The stream is counted as what it was for the client, 499 (as a non-streamed abort is), not
    # as the 200 its first bytes said; and logged at info level.
    after = scrape(service)
    labels = {"route": "/v1/completions", "method": "POST"}
    assert delta(requests, after, "edge_requests", "edge_requests_total", status="499", **labels) == 1
    assert delta(requests, after, "edge_requests", "edge_requests_total", status="200", **labels) == 0
    assert "INFO status 499 (client closed request): completion for model 'tiny', the client left " \
           "mid-stream" in service.log.read_text()


def test_limits_layer_answers_and_app_failures_are_counted_once() -> None:
    """In process: a 413 of the limits layer reaches edge_requests_total through `observe`, and
    an exception of the app is one 500 (counted by the app's middleware, answered in JSON by the
    limits layer), not two."""
    from edge.serve.limits import LimitsMiddleware, RequestLimits

    async def boom(scope, receive, send) -> None:  # a bare ASGI app: no framework answers for it
        await receive()
        raise RuntimeError("a bug")

    m = Metrics()
    inner = m.instrument(boom, None)
    app = LimitsMiddleware(inner, RequestLimits(max_body_bytes=10, body_timeout_s=5), inner.observe)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://edge") as c:
            return [await c.post("/boom", content=b"x" * 11), await c.post("/boom", content=b"{}")]

    big, failed = asyncio.run(go())
    assert big.status_code == 413 and failed.status_code == 500
    assert failed.json()["error"]["code"] == "internal_error"
    fams = families(m.render())
    assert value(fams, "edge_requests", "edge_requests_total", route=UNMATCHED, status="413") == 1
    assert value(fams, "edge_requests", "edge_requests_total", route=UNMATCHED, status="500") == 1
    assert value(fams, "edge_requests", "edge_requests_total") == 2


def test_start_phases_per_model(service: Service) -> None:
    fams = scrape(service)
    samples = {(s.labels["phase"], s.labels["model"], s.labels["kind"]): s.value
               for s in fams["edge_start_phase_seconds"] if s.labels["event"] == "start"}
    for p in service.report["phases"]:
        kind = next((k for k in ("model", "engine") if k in p["detail"]), "")
        key = (p["name"], p["detail"].get(kind, ""), kind)
        assert samples[key] == pytest.approx(p["seconds"]), key
    # the model's warm-up and the engine's are two series, not one overwriting the other
    assert {k for k in samples if k[0] == "warmup"} == {("warmup", "tiny", "model"),
                                                          ("warmup", "mlp", "engine")}
    assert ("model_load", "tiny", "model") in samples


def test_model_and_engine_phases_do_not_overwrite_each_other() -> None:
    m = Metrics()
    m.set_phases([{"name": "warmup", "seconds": 1.5, "detail": {"model": "llm"}},
                  {"name": "warmup", "seconds": 0.25, "detail": {"engine": "vision"}},
                  {"name": "config", "seconds": 0.01, "detail": {}}])
    fams = families(m.render())
    got = {(s.labels["phase"], s.labels["model"], s.labels["kind"]): s.value
           for s in fams["edge_start_phase_seconds"]}
    assert got == {("warmup", "llm", "model"): 1.5, ("warmup", "vision", "engine"): 0.25,
                   ("config", "", ""): 0.01}


def test_templated_route_label_in_process() -> None:
    # An engine whose worker is never opened (no engine file behind it): the name asked for is
    # another, so the KServe handler answers 404 before touching it. What is checked is the label
    # of a templated route, and the engine's queue depth beside it.
    vision = EngineWorker("vision", stored=None)  # type: ignore[arg-type]
    state = ServiceState(workers={}, engines={"vision": vision})
    state.ready = True
    app = build_app(state)

    async def go() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as c:
            r = await c.post('/v2/models/no"pe%0A/infer', content=b"{}")
            assert r.status_code == 404
            return (await c.get("/metrics")).text

    try:
        fams = families(asyncio.run(go()))
    finally:
        vision.close()
    assert value(fams, "edge_requests", "edge_requests_total", route="/v2/models/{name}/infer",
                 method="POST", status="404") == 1
    assert value(fams, "edge_queue_depth", "edge_queue_depth", model="vision", kind="engine") == 0


def test_promtool_lint_passes(service: Service) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        print("promtool not found (Debian package `prometheus`, installed by scripts/setup): "
              "lint skipped")
        pytest.skip("promtool not found: install the Debian package prometheus (scripts/setup)")
    raw(service.address, b"GET /nowhere HTTP/1.1")
    get(service.address, "/v1/completions", "POST", {"prompt": "Hi", "max_tokens": 2})
    text = get(service.address, "/metrics")[1]
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert p.returncode == 0, (p.stdout + p.stderr).decode()
