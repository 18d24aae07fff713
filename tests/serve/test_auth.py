"""API keys (edge.serve.auth) against a real, socket-activated `edge serve` of the tiny model and
the demo ONNX Runtime engine, listening on 0.0.0.0 (reached over 127.0.0.1 only): every route
family by key (none, wrong, right as Bearer and as x-api-key), the open health routes, the 401's
shape, the `openai` client, a flood of bad keys that never reaches a model, and no key in the log
or /metrics. Then the key file's rules, and the start's refusal of a non-loopback socket without
keys (exit 78), its own or inherited, and `allow_unauthenticated`."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.config import ServerConfig
from edge.errors import ConfigError
from edge.serve.auth import ApiKeys, check_exposure, key_file, load_api_keys, parse_keys, socket_address
from kit import EDGE, PidOne, call, write_config

KEY = "sk-edge-" + secrets.token_hex(16)
OTHER_KEY = "sk-edge-" + secrets.token_hex(16)  # a second line of the key file
WRONG = "sk-wrong-" + secrets.token_hex(16)
RECIPE = Path(__file__).resolve().parents[2] / "engines" / "mlp-demo.toml"
INFER = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
FAMILIES = {
    "completions": ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}),
    "chat": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    "models": ("GET", "/v1/models", None),
    "kserve infer": ("POST", "/v2/models/mlp/infer", INFER),
    "kserve metadata": ("GET", "/v2/models/mlp", None),
    "metrics": ("GET", "/metrics", None),
}
KEYS = {
    "no key": ({}, 401),
    "wrong Bearer": ({"Authorization": f"Bearer {WRONG}"}, 401),
    "wrong x-api-key": ({"x-api-key": WRONG}, 401),
    "empty Bearer": ({"Authorization": "Bearer "}, 401),
    "Basic scheme": ({"Authorization": f"Basic {KEY}"}, 401),
    "Bearer": ({"Authorization": f"Bearer {KEY}"}, 200),
    "bearer, second key": ({"Authorization": f"bearer {OTHER_KEY}"}, 200),
    "x-api-key": ({"x-api-key": KEY}, 200),
}
GOOD = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Keyed:
    pid1: PidOne
    address: tuple[str, int]
    folder: Path


def write_keys(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Keyed]:
    pytest.importorskip("onnxruntime")
    from edge.device.identity import detect
    from edge.engines.build import build_engine
    from edge.engines.recipe import load_recipe
    from edge.engines.store import EngineStore

    d = tmp_path_factory.mktemp("keyed")
    build_engine(load_recipe(RECIPE), "onnxruntime", EngineStore(d / "store"), detect(), log=lambda s: None)
    keys = write_keys(d / "api-keys", f"# edge's keys\n\n{KEY}\n  # rotated in:\n{OTHER_KEY}\n")
    cfg = write_config(d / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys.name}"\nmetrics_auth = "key"',
                       extra=f'[[engines]]\nname = "mlp"\nbackend = "onnxruntime"\nrecipe = "{RECIPE}"\n'
                             f'store = "{d / "store"}"\n')
    with PidOne([*EDGE, "serve", "--config", str(cfg)], host="0.0.0.0") as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        yield Keyed(pid1, ("127.0.0.1", pid1.address[1]), d)
        assert pid1.stop() == 0


def scrape(address: tuple[str, int]) -> dict[tuple[str, tuple], float]:
    status, text = call(address, "GET", "/metrics", headers=GOOD)
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("case", list(KEYS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_route_family_needs_a_key(keyed: Keyed, family: str, case: str) -> None:
    method, path, body = FAMILIES[family]
    headers, expected = KEYS[case]
    status, answer = call(keyed.address, method, path, body, headers=headers)
    assert status == expected, answer
    if expected == 401:
        assert answer["error"]["code"] == "invalid_api_key"


def test_metrics_are_keyed_by_default_with_keys_and_open_only_on_purpose(tmp_path: Path, tiny_gguf: Path) -> None:
    keys = write_keys(tmp_path / "k", f"{KEY}\n")
    keyed = load_api_keys(ServerConfig(api_key_file=str(keys)), "edge.toml")
    assert keyed.keyed("/metrics") and keyed.keyed("/v1/models") and not keyed.keyed("/healthz")
    opened = load_api_keys(ServerConfig(api_key_file=str(keys), metrics_auth="open"), "edge.toml")
    assert opened.keyed("/metrics") is False and opened.keyed("/v1/models")
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"')  # no metrics_auth
    with PidOne([*EDGE, "serve", "--config", str(cfg)]) as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        assert call(pid1.address, "GET", "/metrics")[0] == 401
        assert call(pid1.address, "GET", "/metrics", headers=GOOD)[0] == 200
        assert pid1.stop() == 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/v2/health/ready"])
def test_health_routes_stay_open(keyed: Keyed, path: str) -> None:
    assert call(keyed.address, "GET", path)[0] == 200


def test_401_has_openai_shape_a_challenge_and_is_counted(keyed: Keyed) -> None:
    import http.client

    before = scrape(keyed.address)
    c = http.client.HTTPConnection(*keyed.address, timeout=30)
    c.request("POST", "/v1/chat/completions", body=json.dumps(FAMILIES["chat"][2]),
              headers={"Authorization": f"Bearer {WRONG}", "Content-Type": "application/json"})
    r = c.getresponse()
    raw = r.read().decode()
    c.close()
    assert r.status == 401 and r.getheader("WWW-Authenticate", "").startswith("Bearer")
    error = json.loads(raw)["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert WRONG not in raw and KEY not in raw
    after = scrape(keyed.address)
    key = ("edge_http_unauthorized_total", (("reason", "invalid"),))
    assert after[key] == before[key] + 1
    assert after[("edge_requests_total", (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "401")))] >= 1


def test_a_flood_of_bad_keys_never_reaches_a_model(keyed: Keyed) -> None:
    before = scrape(keyed.address)
    chat = FAMILIES["chat"][2]
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: call(keyed.address, "POST", "/v1/chat/completions", chat,
                                                headers={"x-api-key": f"{WRONG}{i}"})[0], range(200)))
    assert statuses == [401] * 200
    after = scrape(keyed.address)
    refused = ("edge_http_unauthorized_total", (("reason", "invalid"),))
    assert after[refused] - before[refused] == 200
    for name in ("edge_prompt_tokens_total", "edge_completion_tokens_total"):
        series = (name, (("model", "tiny"),))
        assert after.get(series, 0.0) == before.get(series, 0.0), name  # no prompt reached the model


def test_refused_before_the_body_is_read(keyed: Keyed) -> None:
    """A request announcing 1 MB that never sends it is answered 401 at once: the check needs
    only the head, so an unauthenticated client cannot make edge wait for (or read) a body."""
    with socket.create_connection(keyed.address, timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401 "), head[:80]


def test_openai_client_with_and_without_the_key(keyed: Keyed) -> None:
    openai = pytest.importorskip("openai")
    base = f"http://{keyed.address[0]}:{keyed.address[1]}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")
    # without a key (the client insists on one: its Authorization header is left out), and a wrong one
    for key, headers in ((KEY, {"Authorization": openai.Omit()}), (WRONG, {})):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_headers=headers)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_no_key_in_the_log_or_the_metrics(keyed: Keyed) -> None:
    call(keyed.address, "GET", "/v1/models", headers={"x-api-key": WRONG})
    _, text = call(keyed.address, "GET", "/metrics", headers=GOOD)
    log = keyed.pid1.log_tail(1 << 20)
    assert log.strip()  # the service's log is there to search
    for secret in (KEY, OTHER_KEY, WRONG):
        assert secret not in log and secret not in text


# -- the key file -----------------------------------------------------------------------------------
def test_keys_comments_and_blank_lines(tmp_path: Path) -> None:
    path = write_keys(tmp_path / "k", f"# comment\n\n  {KEY}  \n#{WRONG}\n{OTHER_KEY}\n")
    keys = load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    assert keys is not None and len(keys.digests) == 2
    assert keys.accepts(KEY.encode()) and keys.accepts(OTHER_KEY.encode())
    assert not keys.accepts(WRONG.encode()) and not keys.accepts(b"") and not keys.accepts(KEY.encode()[:-1])
    assert KEY not in repr(keys) and "2 keys" in repr(keys)
    assert load_api_keys(ServerConfig(), "edge.toml") is None


@pytest.mark.parametrize("text, words", [
    ("# only a comment\n\n", "holds no key"),
    (f"{KEY} {WRONG}\n", "line 1"),
    (f"# one\n{KEY}\nhalf\tsecretpart\n", "line 3"),
    ("clé-non-ascii\n", "line 1"),
])
def test_bad_key_files_are_config_errors_that_never_quote_a_key(tmp_path: Path, text: str, words: str) -> None:
    path = write_keys(tmp_path / "k", text)
    with pytest.raises(ConfigError) as caught:
        load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    message = str(caught.value)
    assert words in message and str(path) in message and "server.api_key_file" in message
    assert KEY not in message and WRONG not in message and "secretpart" not in message


@pytest.mark.parametrize("mode, words", [(0o602, "writable by every user (mode 0602)"),
                                         (0o660, "writable by its group (mode 0660)"),
                                         (0o620, "writable by its group (mode 0620)")])
def test_a_key_file_others_may_write_is_refused(tmp_path: Path, mode: int, words: str) -> None:
    path = write_keys(tmp_path / "k", f"{KEY}\n", mode=mode)
    with pytest.raises(ConfigError) as caught:
        load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    message = str(caught.value)
    assert words in message and str(path) in message and "server.api_key_file" in message and KEY not in message


@pytest.mark.parametrize("folder_mode, words", [(0o777, "which every user may write (mode 0777)"),
                                                (0o1777, "which every user may write (mode 1777)"),
                                                (0o770, "which its group may write (mode 0770)")])
def test_a_key_file_in_a_directory_others_may_write_is_refused(tmp_path: Path, folder_mode: int, words: str) -> None:
    """Sticky too (/tmp): anyone may create a file there under the name the config will read next."""
    folder = tmp_path / "shared"
    folder.mkdir()
    path = write_keys(folder / "k", f"{KEY}\n")
    folder.chmod(folder_mode)
    with pytest.raises(ConfigError) as caught:
        load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    assert words in str(caught.value) and str(folder) in str(caught.value)
    folder.chmod(0o755)
    assert load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml") is not None
    deeper = folder / "private"  # below a folder every user may write: anyone may rename the path's folders
    deeper.mkdir(mode=0o700)
    inner = write_keys(deeper / "k", f"{KEY}\n")
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="which every user may write"):
        load_api_keys(ServerConfig(api_key_file=str(inner)), "edge.toml")
    folder.chmod(0o1777)  # sticky, as /tmp: nobody else may rename what is in it
    assert load_api_keys(ServerConfig(api_key_file=str(inner)), "edge.toml") is not None


@pytest.mark.parametrize("short", ["Z", "0123456789abcde"])
def test_a_key_shorter_than_16_characters_is_refused_by_its_line(tmp_path: Path, short: str) -> None:
    path = write_keys(tmp_path / "k", f"# keys\n{KEY}\n{short}\n")
    with pytest.raises(ConfigError) as caught:
        load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    message = str(caught.value)
    assert f"{path} line 3: the key is shorter than 16 characters" in message and "openssl rand" in message
    assert short not in message.replace(str(path), "") and KEY not in message
    write_keys(path, f"{short}x{'y' * (15 - len(short))}\n")  # 16 characters
    assert load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml") is not None


def test_a_world_readable_key_file_is_refused(tmp_path: Path) -> None:
    path = write_keys(tmp_path / "k", f"{KEY}\n", mode=0o644)
    with pytest.raises(ConfigError, match="readable by every user .mode 0644.") as caught:
        load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml")
    assert str(path) in str(caught.value)
    path.chmod(0o640)  # a group may read it (root:edge)
    assert load_api_keys(ServerConfig(api_key_file=str(path)), "edge.toml") is not None


def test_the_systemd_credential_comes_before_api_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    configured = write_keys(tmp_path / "configured", f"{WRONG}\n")
    server = ServerConfig(api_key_file=str(configured))
    creds = tmp_path / "creds"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert key_file(server, "edge.toml") == configured  # the credential was not passed
    write_keys(creds / "edge-api-keys", f"{KEY}\n", mode=0o400)
    keys = load_api_keys(server, "edge.toml")
    assert isinstance(keys, ApiKeys) and keys.accepts(KEY.encode()) and not keys.accepts(WRONG.encode())
    assert parse_keys(f"{KEY}\n", creds / "edge-api-keys", "x") == keys.digests


# -- no open port by accident ---------------------------------------------------------------------
def test_own_socket_on_every_interface_without_keys_exits_78(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, host="0.0.0.0")
    r = subprocess.run([*EDGE, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NOTIFY_SOCKET": "", "LISTEN_FDS": ""})
    assert r.returncode == 78, r.stderr[-2000:]
    assert "the listening socket 0.0.0.0:" in r.stderr and "api_key_file" in r.stderr
    assert "allow_unauthenticated = true" in r.stderr and "Traceback" not in r.stderr


def test_inherited_socket_on_every_interface_without_keys_exits_78(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)  # the config says loopback: the socket decides
    with PidOne([*EDGE, "serve", "--config", str(cfg)], host="0.0.0.0") as pid1:
        child = pid1.start()
        assert child.wait(timeout=120) == 78
        log = pid1.log_tail()
    assert f"the listening socket 0.0.0.0:{pid1.address[1]}" in log and "allow_unauthenticated" in log


def test_allow_unauthenticated_serves_open_and_doctor_warns(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, host="0.0.0.0", server="allow_unauthenticated = true")
    with PidOne([*EDGE, "serve", "--config", str(cfg)], host="0.0.0.0") as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        assert call(("127.0.0.1", pid1.address[1]), "GET", "/v1/models")[0] == 200
        assert "with no API key (server.allow_unauthenticated = true)" in pid1.log_tail()
        _, text = call(("127.0.0.1", pid1.address[1]), "GET", "/metrics")
        assert "\nedge_sockets_without_key 1.0\n" in text and 'edge_served_without_key_total{event="start"} 1.0' in text
        assert pid1.stop() == 0
    r = subprocess.run([*EDGE, "doctor", "--config", str(cfg), "--json"], capture_output=True, text=True, timeout=120)
    access = [c for c in json.loads(r.stdout) if c["name"] == "access"]
    assert [c["level"] for c in access] == ["warn"] and "0.0.0.0:0" in access[0]["message"]


def _reload(pid1: PidOne) -> str:
    """SIGHUP, as `systemctl reload` sends it: the STATUS= of the READY=1 that ends the reload."""
    after = time.monotonic()
    pid1.proc.send_signal(signal.SIGHUP)
    return pid1.wait_count("READY", 1, after=after, timeout=120)[0].fields.get("STATUS", "")


def test_keys_are_read_again_at_a_reload_which_may_not_drop_them(tmp_path: Path, tiny_gguf: Path) -> None:
    keys = write_keys(tmp_path / "api-keys", f"{KEY}\n")
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"')
    with PidOne([*EDGE, "serve", "--config", str(cfg)], host="0.0.0.0") as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        address = ("127.0.0.1", pid1.address[1])

        write_keys(keys, f"{OTHER_KEY}\n")  # rotated
        assert _reload(pid1).startswith("ready: serving")
        assert call(address, "GET", "/v1/models", headers={"x-api-key": OTHER_KEY})[0] == 200
        assert call(address, "GET", "/v1/models", headers={"x-api-key": KEY})[0] == 401
        cfg.write_text(cfg.read_text().replace(f'api_key_file = "{keys}"', ""))  # the socket is 0.0.0.0
        status = _reload(pid1)
        assert status.startswith("reload failed:") and "allow_unauthenticated" in status
        assert call(address, "GET", "/v1/models")[0] == 401  # still keyed, with the keys it had
        assert call(address, "GET", "/v1/models", headers={"x-api-key": OTHER_KEY})[0] == 200
        assert pid1.stop() == 0


def test_a_reload_that_opens_the_socket_warns_as_a_start_does_and_counts(tmp_path: Path, tiny_gguf: Path) -> None:
    """Keys, then a reload to allow_unauthenticated on 0.0.0.0 (open on purpose): the same WARNING
    as a start logs, and /metrics says so (edge_sockets_without_key 1, a reload counted); a
    reload back to keys sets the gauge to 0."""
    keys = write_keys(tmp_path / "api-keys", f"{KEY}\n")
    keyed = write_config(tmp_path / "edge.toml", tiny_gguf, server=f'api_key_file = "{keys}"')
    text = keyed.read_text()
    warning = "with no API key (server.allow_unauthenticated = true): anyone who can reach it may use every model"
    with PidOne([*EDGE, "serve", "--config", str(keyed)], host="0.0.0.0") as pid1:
        pid1.start()
        pid1.wait_for("READY", "1", timeout=120)
        address = ("127.0.0.1", pid1.address[1])

        def families(headers: dict[str, str]) -> dict[tuple[str, tuple], float]:
            status, body = call(address, "GET", "/metrics", headers=headers)
            assert status == 200, body
            return {(x.name, tuple(sorted(x.labels.items()))): x.value
                    for fam in text_string_to_metric_families(body) for x in fam.samples}

        start = families(GOOD)
        assert start[("edge_sockets_without_key", ())] == 0 and warning not in pid1.log_tail(1 << 20)
        keyed.write_text(text.replace(f'api_key_file = "{keys}"', "allow_unauthenticated = true"))
        assert _reload(pid1).startswith("ready: serving")
        assert f"serving 0.0.0.0:{pid1.address[1]} {warning}" in pid1.log_tail(1 << 20)
        opened = families({})  # no key any more: /metrics too is open
        assert opened[("edge_sockets_without_key", ())] == 1
        assert opened[("edge_served_without_key_total", (("event", "reload"),))] == 1
        assert call(address, "GET", "/v1/models")[0] == 200
        keyed.write_text(text)
        assert _reload(pid1).startswith("ready: serving")
        closed = families(GOOD)
        assert closed[("edge_sockets_without_key", ())] == 0
        assert closed[("edge_served_without_key_total", (("event", "reload"),))] == 1
        assert call(address, "GET", "/v1/models")[0] == 401
        assert pid1.stop() == 0


@pytest.mark.parametrize("family, host, local", [
    (socket.AF_INET, "127.0.0.1", True), (socket.AF_INET, "127.0.0.2", True), (socket.AF_INET, "0.0.0.0", False),
    (socket.AF_INET6, "::1", True), (socket.AF_INET6, "::", False),
])
def test_socket_address_reads_getsockname(family: int, host: str, local: bool) -> None:
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
    except OSError as exc:
        pytest.skip(f"cannot bind {host} here: {exc}")
    with sock:
        shown, is_local = socket_address(sock)
        assert is_local is local and shown.endswith(f":{sock.getsockname()[1]}") and host in shown


def test_a_unix_socket_is_local_and_never_needs_keys(tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(tmp_path / "edge.sock"))
        assert socket_address(sock) == (f"unix:{tmp_path / 'edge.sock'}", True)
        assert check_exposure([sock], None, ServerConfig(), "edge.toml") == []
