"""The shipped units: valid for systemd, hardened, in sync with what `edge units` renders."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edge.config import parse_config
from edge.host.doctor import _limit_bytes, run_checks, unit_config
from edge.errors import EX_CONFIG, EX_DATAERR, EX_NOPERM, EX_SAFE_MODE_EXHAUSTED
from edge.host.gpu_nodes import GPU_DEVICE_CLASSES, UVM_UNIT, platform_policy, present_nodes
from edge.host.units import (REARM_UNIT, STARTER_CONFIG, UnitOptions, existing_groups, install_starter_config,
                             install_units, reclaim_config_dir, render_rearm, render_service, render_socket)
from kit import EDGE, write_config

ROOT = Path(__file__).resolve().parents[2]
analyze = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze")


def _write(tmp_path: Path, o: UnitOptions) -> tuple[Path, Path]:
    sock, svc = tmp_path / "edge.socket", tmp_path / "edge.service"
    sock.write_text(render_socket(o))
    svc.write_text(render_service(o))
    return sock, svc


@analyze
@pytest.mark.parametrize("opts", [
    UnitOptions(),
    UnitOptions(listen=("0.0.0.0:9000", "[::1]:9001"), unix_socket="/run/edge/edge.sock", socket_group="video"),
])
def test_systemd_analyze_verify_passes(tmp_path: Path, opts: UnitOptions) -> None:
    sock, svc = _write(tmp_path, opts)
    r = subprocess.run(["systemd-analyze", "verify", str(sock), str(svc)], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "edge.service" not in r.stderr and "edge.socket" not in r.stderr, r.stderr


@analyze
def test_security_exposure_is_at_most_2_5(tmp_path: Path) -> None:
    _, svc = _write(tmp_path, UnitOptions())
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", str(svc)],
                       capture_output=True, text=True, cwd=tmp_path)
    m = re.search(r"Overall exposure level for edge.service: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    score = float(m.group(1))
    print(f"\nsystemd-analyze security exposure: {score}")
    assert score <= 2.5


def test_service_has_what_cold_start_needs() -> None:
    text = render_service(UnitOptions(edge="/opt/edge/venv/bin/edge"))
    for line in ("Type=notify", "NotifyAccess=all", "LimitMEMLOCK=infinity", "WatchdogSec=30",
                 "Restart=on-failure",
                 f"RestartPreventExitStatus={EX_DATAERR} {EX_SAFE_MODE_EXHAUSTED} {EX_NOPERM} {EX_CONFIG}",
                 "ExecStart=/opt/edge/venv/bin/edge serve --config /etc/edge/edge.toml",
                 "ExecStopPost=/opt/edge/venv/bin/edge record-stop --config /etc/edge/edge.toml",
                 "StateDirectory=edge", "CacheDirectory=edge", "DynamicUser=yes",
                 "SupplementaryGroups=video render", "DeviceAllow=/dev/nvmap rw",
                 "DeviceAllow=/dev/nvidiactl rw", "CapabilityBoundingSet=", "ProtectSystem=strict",
                 "SystemCallFilter=@system-service", "WantedBy=multi-user.target"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert "MemoryDenyWriteExecute" in text.split("[Unit]")[0]  # documented as left out
    sock = render_socket(UnitOptions(unix_socket="/run/edge.sock", socket_group="video"))
    for line in ("ListenStream=127.0.0.1:8088", "ListenStream=/run/edge.sock", "SocketMode=0660",
                 "SocketGroup=video", "Backlog=4096"):
        assert re.search(rf"^{re.escape(line)}$", sock, re.M), line


FIX = Path(__file__).parents[1] / "fixtures" / "devices"


def _printed_units(stdout: str) -> dict[str, str]:
    """`edge units print`'s output, unit by unit ("# <name>" headers)."""
    parts = re.split(r"^# (edge[\w.-]*\.(?:service|socket))\n", stdout, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


# What each platform's unit must allow, by NVIDIA's lists (edge/host/gpu_nodes.py says which)
MUST_ALLOW = {
    "jetpack6": {"/dev/nvmap", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu/igpu0/ctrl", "/dev/host1x-fence",
                 "/dev/dri/renderD128", "/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-modeset"},
    "jetpack7": {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                 "/dev/nvmap", "/dev/host1x-fence", "/dev/dri/renderD128", "/dev/dri/renderD129",
                 "/dev/dri/renderD130", "char-nvidia-uvm"},
    "dgpu": {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "char-nvidia-uvm"},
}
NEVER_ALLOW = {  # another platform's nodes; display, PVA and NvSciIpc nodes on every one
    "jetpack6": ("/dev/nvidia-uvm", "char-nvidia"),
    "jetpack7": ("/dev/nvgpu", "/dev/nvhost", "char-nvgpu"),
    "dgpu": ("/dev/nvgpu", "/dev/nvhost", "/dev/nvmap", "/dev/host1x-fence"),
}


@pytest.mark.parametrize("image", [False, True], ids=["live", "image"])
@pytest.mark.parametrize("tree, platform", [("orin-agx", "jetpack6"), ("orin-nano-jp6", "jetpack6"),
                                            ("thor-jp7", "jetpack7"), ("dgpu-x86", "dgpu")])
def test_units_print_on_a_device_tree_names_every_gpu_node_it_has_and_systemd_accepts_them(
        tmp_path: Path, tree: str, platform: str, image: bool) -> None:
    """From a live tree (its dev/ and proc/) and from an image of it (a rootfs without either, as
    `edge units install --prefix <rootfs>` sees one) alike."""
    root = FIX / tree
    if image:
        root = tmp_path / "rootfs"
        shutil.copytree(FIX / tree, root, ignore=shutil.ignore_patterns("dev", "proc"))
    r = subprocess.run([*EDGE, "units", "print", "--root", str(root)],  # this edge: verify runs it
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    units = _printed_units(r.stdout)
    allowed = re.findall(r"^DeviceAllow=(\S+) rw$", units["edge.service"], re.M)
    nodes = present_nodes(FIX / tree)
    by_class = [n for n in nodes if n.startswith("/dev/nvidia-caps/") and "char-nvidia-caps" in allowed]  # MIG's
    assert nodes and [n for n in nodes if n not in allowed + by_class] == [n for n in nodes if "/dri/card" in n]
    assert not [a for a in allowed if a == "char-drm" or re.search(r"/dri/card|/fb0|pva|nvsciipc", a)]
    assert platform_policy(root).platform == platform
    assert MUST_ALLOW[platform] - set(allowed) == set()
    assert not [d for d in allowed if d.startswith(NEVER_ALLOW[platform])]
    if not image:  # only what the device has, and the driver nodes made on demand (no warning per path)
        assert [a for a in allowed if a.startswith("/dev/") and a not in nodes and not a.startswith("/dev/nvidia")] == []
    assert (UVM_UNIT in units) == (platform == "dgpu") and "ExecStartPre=" not in units["edge.service"]
    if not shutil.which("systemd-analyze"):
        print("systemd-analyze is not installed: the rendered units were not verified")
        return
    for name, text in units.items():
        (tmp_path / name).write_text(text)
    v = subprocess.run(["systemd-analyze", "verify", *sorted(str(tmp_path / n) for n in units)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert v.returncode == 0 and not [n for n in units if n in v.stderr], v.stderr


def test_a_dgpu_unit_loads_nvidia_uvm_in_a_oneshot_outside_the_device_policy(tmp_path: Path) -> None:
    """nvidia-modprobe as ExecStartPre=+ cannot work: systemd applies DeviceAllow= to the whole
    cgroup (systemd issue 26035), and char-nvidia-uvm is resolved before the module is loaded."""
    policy = platform_policy(FIX / "dgpu-x86")
    o = UnitOptions(devices=policy.devices, modprobe=policy.modprobe)
    text = render_service(o)
    unit = text.split("[Service]")[0]
    assert f"Wants={UVM_UNIT}" in unit and f"After={UVM_UNIT}" in unit and "ExecStartPre=" not in text
    written = install_units(o, prefix=str(tmp_path))
    uvm = (tmp_path / "etc" / "systemd" / "system" / UVM_UNIT).read_text()
    assert tmp_path / "etc" / "systemd" / "system" / UVM_UNIT in written
    for line in ("Before=edge.service", "Type=oneshot", "RemainAfterExit=yes",
                 "ExecStart=-/usr/bin/nvidia-modprobe -c=255", "ExecStart=-/usr/bin/nvidia-modprobe -c=1",
                 "ExecStart=-/usr/bin/nvidia-modprobe -u -c=0", "ConditionPathExists=/usr/bin/nvidia-modprobe"):
        assert re.search(rf"^{re.escape(line)}$", uvm, re.M), line
    generic = render_service(UnitOptions())  # the shipped unit: every platform, ordered after the daemon
    assert UVM_UNIT not in generic and "nvidia-persistenced.service" in generic.split("[Service]")[0]
    assert UVM_UNIT not in render_service(UnitOptions(user=True, modprobe="/usr/bin/nvidia-modprobe"))
    jp6 = platform_policy(FIX / "orin-agx")
    install_units(UnitOptions(devices=jp6.devices, modprobe=jp6.modprobe), prefix=str(tmp_path / "jp6"))
    assert not (tmp_path / "jp6" / "etc" / "systemd" / "system" / UVM_UNIT).exists()


def test_user_units_leave_out_privileged_sandboxing() -> None:
    text = render_service(UnitOptions(user=True))
    assert not re.search(r"^(DynamicUser|DeviceAllow|SupplementaryGroups|CapabilityBoundingSet)=", text, re.M)
    assert "WantedBy=default.target" in text and "LimitMEMLOCK=infinity" in text


def test_shipped_units_match_the_renderer() -> None:
    o = UnitOptions(edge="/opt/edge/venv/bin/edge")
    assert (ROOT / "systemd" / "edge.service").read_text() == render_service(o)
    assert (ROOT / "systemd" / "edge.socket").read_text() == render_socket(o)
    assert (ROOT / "systemd" / REARM_UNIT).read_text() == render_rearm(o)


def test_units_install_writes_atomically_and_tells_what_to_run(tmp_path: Path) -> None:
    r = subprocess.run([*EDGE, "units", "install", "--prefix", str(tmp_path), "--listen", "127.0.0.1:9999"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "etc" / "systemd" / "system"
    assert sorted(p.name for p in d.iterdir()) == [REARM_UNIT, "edge.service", "edge.socket"]  # no temp files
    assert "ListenStream=127.0.0.1:9999" in (d / "edge.socket").read_text()
    assert (d / "edge.service").stat().st_mode & 0o777 == 0o644
    assert "systemctl daemon-reload" in r.stdout and "enable --now edge.socket edge.service" in r.stdout
    starter = tmp_path / "etc" / "edge" / "edge.toml"
    assert starter.read_text() == STARTER_CONFIG and starter.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in starter.parent.iterdir()) == ["edge.toml"]
    starter.write_text("# mine\n")
    r = subprocess.run([*EDGE, "units", "install", "--prefix", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and f"kept {starter}" in r.stdout
    assert starter.read_text() == "# mine\n"  # never overwritten
    printed = subprocess.run([*EDGE, "units", "print", "--listen", "127.0.0.1:9999", "--root", str(tmp_path)], capture_output=True,
                             text=True, timeout=60).stdout
    assert (d / "edge.service").read_text() in printed


def test_units_install_into_unwritable_place_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([*EDGE, "units", "install", "--prefix", str(blocker)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and f"'--prefix': {blocker} is not an existing directory" in r.stderr
    r = subprocess.run([*EDGE, "units", "install", "--prefix", "/proc"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cannot write units under /proc" in r.stderr and "Traceback" not in r.stderr


def _levels(checks) -> dict[str, str]:
    return {c.name: c.level for c in checks}


def test_doctor_reports_each_problem_with_its_fix(tmp_path: Path, tiny_gguf: Path) -> None:
    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    units = tmp_path / "units"
    checks = run_checks(str(cfg), [units])
    lv = _levels(checks)
    assert lv["config"] == "ok" and lv["model tiny"] == "ok" and lv["units"] == "warn"
    assert "edge units install" in next(c for c in checks if c.name == "units").fix

    install_units(UnitOptions(), prefix=str(units / "root"))
    sysdir = units / "root" / "etc" / "systemd" / "system"
    assert _levels(run_checks(str(cfg), [sysdir]))["mlock"] == "ok"
    svc = sysdir / "edge.service"
    svc.write_text(svc.read_text().replace("LimitMEMLOCK=infinity\n", ""))
    small = next(c for c in run_checks(str(cfg), [sysdir]) if c.name == "mlock")
    # without LimitMEMLOCK= the service gets systemd's default 8 MiB: enough for the tiny model
    assert small.level == "ok" and "8 MiB" in small.message and "not verified" in small.message

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:4000])
    cfg2 = write_config(tmp_path / "edge2.toml", cut)
    model = next(c for c in run_checks(str(cfg2), [units]) if c.name == "model tiny")
    assert model.level == "fail" and "truncated" in model.message


def test_doctor_cli_exit_codes(tmp_path: Path, tiny_gguf: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[models]]\nname = 1\n")
    r = subprocess.run([*EDGE, "doctor", "--config", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "[FAIL] config" in r.stdout and "models[0].name" in r.stdout
    good = write_config(tmp_path / "edge.toml", tiny_gguf)
    r = subprocess.run([*EDGE, "doctor", "--config", str(good), "--json"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and '"name": "model tiny"' in r.stdout


def test_starter_config_is_valid_and_never_replaces_one(tmp_path: Path) -> None:
    cfg = parse_config(STARTER_CONFIG, source="starter")
    assert [m.path for m in cfg.models] == ["builtin:gemma3-270m"]
    target = tmp_path / "etc" / "edge" / "edge.toml"
    assert install_starter_config(target) is True and target.read_text() == STARTER_CONFIG
    target.write_text("x")
    assert install_starter_config(target) is False and target.read_text() == "x"
    assert sorted(p.name for p in target.parent.iterdir()) == ["edge.toml"]  # no temp file left


def test_service_unit_fixes_from_the_real_systemd_run() -> None:
    text = render_service(UnitOptions())
    assert "ConfigurationDirectory=" not in text.replace("# No ConfigurationDirectory=", "")
    assert re.search(r"^SystemCallFilter=mincore$", text, re.M)
    assert re.search(r"^StartLimitBurst=\d+$", text, re.M) and re.search(r"^StartLimitIntervalSec=\d+$", text, re.M)
    assert text.index("StartLimitBurst=") < text.index("[Service]")  # a [Unit] setting
    assert "Environment=CUDA_CACHE_PATH=%C/edge/cuda" in text
    assert "char-drm" not in GPU_DEVICE_CLASSES and "DeviceAllow=char-drm" not in text  # KMS nodes too
    for node in ("/dev/nvmap", "/dev/nvhost-ctxsw-gpu", "/dev/nvhost-nvsched_ctrl_fifo-gpu", "/dev/nvgpu/igpu0/ctrl",
                 "/dev/dri/renderD128", "/dev/dri/renderD129", "/dev/nvidiactl", "/dev/nvidia-uvm", *GPU_DEVICE_CLASSES):
        assert re.search(rf"^DeviceAllow={re.escape(node)} rw$", text, re.M), node
    sock = render_socket(UnitOptions())
    assert f"OnFailure={REARM_UNIT}" in sock and "StartLimitIntervalSec=0" in sock
    assert "ExecStart=systemctl start --no-block edge.socket" in render_rearm(UnitOptions())


def test_install_keeps_only_groups_the_system_has(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\n")
    assert existing_groups(str(tmp_path), ("video", "render")) == ("video",)
    install_units(UnitOptions(), prefix=str(tmp_path))
    svc = (tmp_path / "etc" / "systemd" / "system" / "edge.service").read_text()
    assert re.search(r"^SupplementaryGroups=video$", svc, re.M)


def test_doctor_reads_the_units_exec_start_and_limits(tmp_path: Path, tiny_gguf: Path) -> None:
    assert unit_config("ExecStart=/opt/edge/venv/bin/edge serve --config /etc/edge/edge.toml\n") == "/etc/edge/edge.toml"
    assert unit_config("ExecStart=-/x/edge serve --config=/a/b.toml\n") == "/a/b.toml"
    assert unit_config("ExecStart=/x/edge serve\n") is None
    assert _limit_bytes("infinity") is None and _limit_bytes("64M") == 64 * 2**20
    assert _limit_bytes("8M:16M") == 8 * 2**20 and _limit_bytes("4096") == 4096

    cfg = write_config(tmp_path / "edge.toml", tiny_gguf)
    sysdir = tmp_path / "root" / "etc" / "systemd" / "system"
    install_units(UnitOptions(config=str(tmp_path / "missing.toml")), prefix=str(tmp_path / "root"))
    first = run_checks(None, [sysdir])[0]  # no --config: doctor checks what the unit runs
    assert first.level == "fail" and "missing.toml" in first.message and "edge units install" in first.fix
    install_units(UnitOptions(config=str(cfg)), prefix=str(tmp_path / "root"))
    checks = {c.name: c for c in run_checks(None, [sysdir])}
    assert checks["config"].level == "ok" and "the config edge.service runs" in checks["config"].message
    svc = sysdir / "edge.service"
    svc.write_text(svc.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOCK=1K"))
    mlock = next(c for c in run_checks(None, [sysdir]) if c.name == "mlock")
    assert mlock.level == "fail" and "LimitMEMLOCK=1K" in mlock.message
    other = write_config(tmp_path / "other.toml", tiny_gguf)
    warn = [c for c in run_checks(str(other), [sysdir]) if c.name == "units" and c.level == "warn"]
    assert warn and str(cfg) in warn[0].message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_install_gives_a_config_dir_owned_by_a_dynamic_uid_back_to_root(tmp_path: Path) -> None:
    etc = tmp_path / "etc" / "edge"
    etc.mkdir(parents=True)
    (etc / "ota.pub").write_text("key")
    for p in (etc, etc / "ota.pub"):
        os.chown(p, 61234, 61234)  # what ConfigurationDirectory= + DynamicUser= left behind
    assert reclaim_config_dir(etc) is True
    assert {p.stat().st_uid for p in (etc, etc / "ota.pub")} == {0}
    assert reclaim_config_dir(etc) is False


def test_the_credential_lines_are_rendered_commented_out() -> None:
    """Keys and TLS by systemd credential (docs/security.md): rendered for a
    person to uncomment, never in force by default (a missing file would fail every start)."""
    text = render_service(UnitOptions())
    for name, path in (("edge-api-keys", "/etc/edge/api-keys"), ("edge-tls-cert", "/etc/edge/tls/cert.pem"),
                       ("edge-tls-key", "/etc/edge/tls/key.pem")):
        assert re.search(rf"^#LoadCredential={name}:{re.escape(path)}$", text, re.M), name
    assert not re.search(r"^LoadCredential=", text, re.M)


def test_units_on_the_ota_config_put_the_starter_where_the_factory_config_is(tmp_path: Path) -> None:
    """docs/ota.md "End to end": `edge units install --config <state>/ota/current/edge.toml` writes
    no file where the `current` link must go; the starter config (if none is there) is the
    device's own, which the first `edge ota recover` makes the factory config."""
    current = "/var/lib/edge/ota/current/edge.toml"
    r = subprocess.run([*EDGE, "units", "install", "--prefix", str(tmp_path), "--config", current,
                        "--edge", "/opt/edge/venv/bin/edge"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    svc = (tmp_path / "etc" / "systemd" / "system" / "edge.service").read_text()
    assert f"serve --config {current}" in svc and f"reload --config {current}" in svc
    assert (tmp_path / "etc" / "edge" / "edge.toml").read_text() == STARTER_CONFIG
    assert not (tmp_path / "var").exists()
    assert "factory config /etc/edge/edge.toml" in r.stdout
