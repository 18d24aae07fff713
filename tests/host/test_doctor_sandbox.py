"""`edge doctor`'s check of the files the service opens under its unit (edge.host.doctor_sandbox),
against the unit `edge units` renders (edge.host.units.render_service) and drop-ins on it: a TLS
key only root may read, a model under /root (ProtectHome=yes), a key file in a group the service
is not in, a file under /tmp (PrivateTmp=yes), and what a credential or a drop-in changes.

The files live in a folder every user may enter under /dev/shm: pytest's own tmp folders are
0700 (nothing in them could be read by another user whatever its mode), and the unit's
PrivateTmp=yes hides /tmp and /var/tmp from the service. Modes bind another user only when root
owns the files: run as another user, the cases that need root are skipped, saying so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.config import load_config
from edge.host.doctor_sandbox import Sandbox, sandbox_checks
from edge.host.units import UnitOptions, render_service, render_socket
from kit import EDGE

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="file modes bind another user only when root owns the files")
KEY = "sk-sandbox-" + "3" * 24


SHARED = Path("/dev/shm")


@pytest.fixture()
def base() -> Iterator[Path]:
    if not SHARED.is_dir():
        pytest.skip("no /dev/shm: the files need a folder the unit does not hide (PrivateTmp=yes hides /tmp)")
    folder = Path(tempfile.mkdtemp(prefix="edge-sandbox-", dir=SHARED))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def _files(base: Path, tiny_gguf: Path, model: str | None = None, server: str = "") -> Path:
    shutil.copy(tiny_gguf, base / "tiny.gguf")
    (base / "tiny.gguf").chmod(0o644)
    config = base / "edge.toml"
    config.write_text(f'[server]\n{server}\n[[models]]\nname = "tiny"\npath = "{model or base / "tiny.gguf"}"\n')
    config.chmod(0o644)
    return config


def _tls(base: Path) -> str:
    from kit.tls import self_signed

    cert, key = self_signed(base)
    cert.chmod(0o644)
    return f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'  # the key: root's, 0600


UNIT = render_service(UnitOptions())


def _fails(config: Path, unit: str = UNIT) -> dict[str, tuple[str, str]]:
    """The failed checks by the config field of the file they name: (message, fix)."""
    return {re.search(r" \((\S+)\): ", c[2]).group(1): (c[2], c[3])
            for c in sandbox_checks(load_config(config), unit) if c[1] == "fail"}


def test_the_rendered_unit_is_read_as_systemd_runs_it() -> None:
    box = Sandbox.of(UNIT)
    assert box.uid is None and "DynamicUser" in box.who  # a uid that owns nothing
    assert box.hides(Path("/root/m.gguf")) == "ProtectHome=yes hides /root"
    assert box.hides(Path("/home/ada/models/m.gguf")) == "ProtectHome=yes hides /home"
    assert box.hides(Path("/tmp/m.gguf")) == "PrivateTmp=yes hides /tmp" and box.hides(Path("/srv/m.gguf")) is None
    home = render_service(UnitOptions(edge="/home/ada/venv/bin/edge"))  # edge itself in a home: read-only
    assert Sandbox.of(home).hides(Path("/home/ada/m.gguf")) is None
    tmpfs = Sandbox.of(UNIT + "\n[Service]\nProtectHome=tmpfs\nBindReadOnlyPaths=/home/ada/models\n")
    assert tmpfs.hides(Path("/home/ada/models/m.gguf")) is None and tmpfs.hides(Path("/home/ada/x")) is not None
    reset = Sandbox.of(UNIT + "\n[Service]\nInaccessiblePaths=-/srv/secret\nPrivateTmp=no\n")
    assert reset.hides(Path("/srv/secret/m.gguf")) == "InaccessiblePaths= hides /srv/secret"
    assert reset.hides(Path("/tmp/m.gguf")) is None


@as_root
def test_a_root_only_tls_key_and_a_model_under_root_fail_before_the_start(base: Path, tiny_gguf: Path) -> None:
    config = _files(base, tiny_gguf, model="/root/edge-models/tiny.gguf", server=_tls(base))
    fails = _fails(config)
    assert set(fails) == {"server.tls_key_file", "models[0].path"}, fails
    message, fix = fails["server.tls_key_file"]
    assert str(base / "edge.key") in message and "may not read it (mode 0600, root:root)" in message
    assert f"LoadCredential=edge-tls-key:{base / 'edge.key'}" in fix
    message, fix = fails["models[0].path"]
    assert "ProtectHome=yes hides /root" in message and "models[0].path" in message
    assert "/var/lib/edge-models" in fix and "BindReadOnlyPaths=/root/edge-models" in fix
    # the documented drop-in: the key by credential, which systemd reads as root
    drop_in = UNIT + f"\n[Service]\nLoadCredential=edge-tls-key:{base / 'edge.key'}\n"
    assert set(_fails(config, drop_in)) == {"models[0].path"}
    fine = _files(base, tiny_gguf)
    checks = sandbox_checks(load_config(fine), UNIT)
    assert [c[1] for c in checks] == ["ok"] and str(base / "tiny.gguf") in checks[0][2]


@as_root
def test_group_and_folder_modes_against_supplementary_groups(base: Path, tiny_gguf: Path) -> None:
    import grp

    keys = base / "keys" / "api-keys"
    keys.parent.mkdir(mode=0o750)
    keys.write_text(KEY + "\n")
    keys.chmod(0o640)
    config = _files(base, tiny_gguf, server=f'api_key_file = "{keys}"\n')
    message, fix = _fails(config)["server.api_key_file"]
    assert f"its folder {keys.parent} (mode 0750, root:root) is closed to its DynamicUser" in message
    assert "LoadCredential=edge-api-keys:" in fix
    group = next((g for g in ("video", "render") if _has_group(g)), None)
    if group is None:
        pytest.skip("no video or render group here to give the files to")
    gid = grp.getgrnam(group).gr_gid
    os.chown(keys.parent, 0, gid)
    os.chown(keys, 0, gid)
    assert _fails(config) == {}  # the rendered unit's SupplementaryGroups= names it
    assert "server.api_key_file" in _fails(config, UNIT.replace("SupplementaryGroups=", "SupplementaryGroups=nogroup-x "
                                                    ).replace(f" {group}", ""))


def _has_group(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
        return True
    except KeyError:
        return False


@as_root
def test_edge_doctor_reads_the_installed_unit_and_its_drop_ins(base: Path, tiny_gguf: Path) -> None:
    """Through `edge doctor --json` with a unit dir: edge.service as rendered, then a drop-in
    (as `systemctl edit` writes it) that passes the TLS key by credential."""
    config = _files(base, tiny_gguf, server=_tls(base))
    units = base / "units"
    units.mkdir()
    (units / "edge.socket").write_text(render_socket(UnitOptions()))
    (units / "edge.service").write_text(render_service(UnitOptions(config=str(config))))

    def unit_files() -> list[dict]:
        code = ("import json,sys;from pathlib import Path;from edge.host.doctor import run_checks;"
                "print(json.dumps([c.__dict__ for c in run_checks(None, [Path(sys.argv[1])])]))")
        r = subprocess.run([EDGE[0], "-c", code, str(units)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [c for c in json.loads(r.stdout) if c["name"] == "unit files"]

    (found,) = unit_files()
    assert found["level"] == "fail" and "TLS key" in found["message"] and "LoadCredential=edge-tls-key" in found["fix"]
    (units / "edge.service.d").mkdir()
    (units / "edge.service.d" / "override.conf").write_text(
        f"[Service]\nLoadCredential=edge-tls-key:{base / 'edge.key'}\n")
    (found,) = unit_files()
    assert found["level"] == "ok", found
