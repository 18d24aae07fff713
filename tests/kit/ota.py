"""OTA test fixtures shared by the OTA and Mender tests (registered as a pytest plugin in
conftest.py): keys, two tiny models, bundles A and B, a live service; and the tools for tests
where space matters: a small tmpfs (`tmpfs`), filling it (`fill`), a snapshot of an OTA tree."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kit.configs import EDGE
from edge.ota.bundle import build_bundle, keygen
from edge.ota.install import Ota
from harness.ggufgen import write_tiny_llama
from harness.pid1 import PidOne

__all__ = ["A", "B", "healthy_url", "MODEL_CFG", "VERSIONS", "build_version", "cfg_text", "committed", "damage", "device",
           "edge_ota", "fill", "install", "kit", "live", "tmpfs", "tree"]


def cfg_text(model: str, extra: str = "") -> str:
    return f'[[models]]\nname = "m"\npath = "models/{model}"\nn_ctx = 256\n[warmup]\ndecode_tokens = 4\n{extra}'


VERSIONS = {"A": "1.0.0", "B": "2.0.0"}
A, B = VERSIONS["A"], VERSIONS["B"]


@pytest.fixture()
def kit(tmp_path: Path):
    """Keys, two tiny models (different weights: different answers), bundles A and B."""
    key = tmp_path / "signing.key"
    pub = keygen(key)
    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=2)
    bundles = {}
    for v, m in (("A", a), ("B", b)):
        bundles[v] = tmp_path / f"{v}.edgeb"
        build_bundle(bundles[v], version=VERSIONS[v], files=[(m, f"models/{m.name}", "model", None)],
                     config=cfg_text(m.name), key=key)
    device_cfg = tmp_path / "device.toml"
    device_cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "state"}"\n[[models]]\nname = "x"\npath = "x.gguf"\n')
    return {"dir": tmp_path, "key": key, "pub": pub, "a": a, "b": b, "bundles": bundles, "cfg": device_cfg,
            "ota": Ota(tmp_path / "state" / "ota")}


def device(tmp_path: Path, *, model_bytes: int, keep: int) -> dict:
    """A signing key, a model file of random bytes, a device config and its OTA root (no service)."""
    key = tmp_path / "signing.key"
    pub = keygen(key)
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(model_bytes))
    cfg = tmp_path / "device.toml"
    cfg.write_text(f'[paths]\nstate_dir = "{tmp_path / "state"}"\n[[models]]\nname = "x"\npath = "x.gguf"\n')
    return {"dir": tmp_path, "key": key, "pub": pub, "model": model, "cfg": cfg,
            "ota": Ota(tmp_path / "state" / "ota", keep=keep)}


MODEL_CFG = '[[models]]\nname = "m"\npath = "models/m.gguf"\n'


def build_version(dev, version: str, *, config: str = MODEL_CFG, model: Path | None = None, base=None) -> Path:
    """A bundle of `version` for a `device()`: its model (or `model`) as models/m.gguf, thin when
    `base` (a manifest) is given."""
    out = dev["dir"] / f"{version}{'-thin' if base else ''}.edgeb"
    build_bundle(out, version=version, files=[(model or dev["model"], "models/m.gguf", "model", None)],
                 config=config, key=dev["key"], base=base)
    return out


def damage(path: Path, at: int = 300) -> None:
    """Flip one bit of a file in place (flash bit-rot: same inode, size and mode)."""
    mode = path.stat().st_mode
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    path.chmod(mode)


def edge_ota(kit, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGE, "ota", *args, "--config", str(kit["cfg"])], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def install(kit, version: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return edge_ota(kit, "install", str(kit["bundles"][version]), "--pubkey", str(kit["pub"]), *extra, env=env)


def committed(kit, version: str) -> None:
    r = install(kit, version, "--no-activate")
    assert r.returncode == 0, r.stderr
    r = edge_ota(kit, "commit")
    assert r.returncode == 0, r.stderr


@pytest.fixture()
def live(kit):
    """A real service on the OTA `current` config; health checks hit its /readyz."""
    committed(kit, "A")
    pid1 = PidOne([*EDGE, "serve", "--config", str(kit["ota"].root / "current" / "edge.toml")])
    pid1.start()
    pid1.wait_for("READY", "1")
    yield pid1
    pid1.close()




@contextlib.contextmanager
def tmpfs(mnt: Path, size: str, nr_inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size` (and at most nr_inodes inodes) at `mnt`; skips, saying why, where this
    process may not mount (not root, or no CAP_SYS_ADMIN in a container)."""
    mnt.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        why = f"cannot mount a tmpfs ({opts}) here: {r.stderr.strip() or r.returncode}"
        print(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def fill(where: Path, blocks: bool = True, inodes: bool = True) -> Path:
    """Fill the file system of `where` (its free blocks, its free inodes, or both) with files in
    where/filler, until it answers ENOSPC; the folder, to free it again."""
    filler = where / "filler"
    filler.mkdir()
    if blocks:
        with open(filler / "blocks", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (4 << 10))
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    n = 0
    while inodes:
        try:
            (filler / f"i{n}").touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            break
        n += 1
    return filler


def tree(ota: Ota) -> dict:
    """Everything under the OTA root but the lock: what a refusal must not change."""
    from edge.fsutil import sha256_file

    return {str(p.relative_to(ota.root)): (os.readlink(p) if p.is_symlink() else
                                           sha256_file(p) if p.is_file() else "dir")
            for p in sorted(ota.root.rglob("*")) if p.name not in (".lock",)}


def healthy_url() -> tuple[str, object]:
    """A health URL on 127.0.0.1 (port 0) that answers 200 (the restarted service's), and its
    server (shut it down when done)."""
    import http.server
    import threading

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/readyz", server
