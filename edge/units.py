"""systemd units for a device: rendered for the installed `edge`, written atomically.

The service is started at boot (WantedBy=multi-user.target), not on the first connection: the
point is that the model is paged in, locked and warm before traffic comes. The socket unit holds
the listening socket across restarts, so connections made meanwhile wait in its backlog.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from edge.errors import EX_CONFIG, EX_DATAERR, EX_NOPERM
from edge.fsutil import atomic_write

__all__ = ["UnitOptions", "render_service", "render_socket", "install_units", "default_edge_command"]

# Jetson (nvgpu/nvhost) and discrete-GPU (nvidia) device nodes CUDA opens. A node that does not
# exist on a given device is simply not there to allow; systemd logs nothing for it.
GPU_DEVICES = [
    "/dev/nvmap", "/dev/nvhost-ctrl", "/dev/nvhost-ctrl-gpu", "/dev/nvhost-prof-gpu",
    "/dev/nvhost-gpu", "/dev/nvhost-as-gpu", "/dev/nvhost-dbg-gpu", "/dev/nvhost-tsg-gpu",
    "/dev/nvhost-sched-gpu", "/dev/nvhost-power-gpu", "/dev/nvhost-nvsched-gpu",
    "/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
]
GPU_DEVICE_CLASSES = ["char-nvidia-frontend", "char-nvidia-uvm", "char-nvgpu", "char-nvhost"]


def default_edge_command() -> str:
    """The absolute command that runs this edge: the console script beside this Python, if any."""
    script = Path(sys.executable).with_name("edge")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script)
    found = shutil.which("edge")
    return found if found else f"{sys.executable} -m edge.cli"


@dataclass(frozen=True)
class UnitOptions:
    edge: str = field(default_factory=default_edge_command)
    config: str = "/etc/edge/edge.toml"
    listen: tuple[str, ...] = ("127.0.0.1:8088",)
    unix_socket: str | None = None
    socket_group: str | None = None
    backlog: int = 4096
    user: bool = False  # a user unit (systemctl --user): no privileged sandboxing
    watchdog_s: int = 30
    start_timeout_s: int = 300
    stop_timeout_s: int = 45  # above the service's drain_timeout_s (30 by default)

    @property
    def loopback_only(self) -> bool:
        return all(a.split(":")[0] in ("127.0.0.1", "localhost", "[::1]") for a in self.listen)


def render_socket(o: UnitOptions) -> str:
    lines = ["[Unit]", "Description=edge inference service socket (holds connections across restarts)",
             "", "[Socket]"]
    lines += [f"ListenStream={a}" for a in o.listen]
    if o.unix_socket:
        lines += [f"ListenStream={o.unix_socket}", "SocketMode=0660"]
        if o.socket_group:
            lines.append(f"SocketGroup={o.socket_group}")
    lines += [f"Backlog={o.backlog}", "NoDelay=true", "", "[Install]", "WantedBy=sockets.target", ""]
    return "\n".join(lines)


def render_service(o: UnitOptions) -> str:
    home = o.edge.startswith(("/home/", "/root/")) or o.config.startswith(("/home/", "/root/"))
    lines = [
        "# Rendered by `edge units print`; see README \"systemd\" for every choice made here.",
        "# Left out on purpose, each because it breaks the GPU path or mlock:",
        "#   MemoryDenyWriteExecute=  CUDA's PTX JIT and libffi (ctypes callbacks) map W+X pages",
        "#   PrivateDevices=          hides /dev/nvmap, /dev/nvhost-* and /dev/nvidia*; DevicePolicy=",
        "#                            closed + DeviceAllow= below limit devices instead",
        "#   PrivateUsers=            GPU device access through the video/render groups is untested",
        "#                            inside a user namespace on L4T",
        "#   ProcSubset=pid           device identity reads /proc/device-tree and the CUDA driver /proc",
        "#   SystemCallFilter=~@resources  ggml thread pools may set affinity and priority",
        "[Unit]",
        "Description=edge inference service (paged-in, locked and warmed up before READY)",
        "Requires=edge.socket",
        "After=edge.socket network.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={o.edge} serve --config {o.config}",
        # zero-gap reload (README "Reload"); below TimeoutStartSec=, which systemd also applies to reloads
        f"ExecReload={o.edge} reload --config {o.config} --timeout {max(1, o.start_timeout_s - 15)}",
        "Restart=on-failure",
        "RestartSec=2",
        # config error, bad model file, mlock refused: a restart cannot fix these
        f"RestartPreventExitStatus={EX_DATAERR} {EX_NOPERM} {EX_CONFIG}",
        f"TimeoutStartSec={o.start_timeout_s}",
        f"TimeoutStopSec={o.stop_timeout_s}",
        f"WatchdogSec={o.watchdog_s}",
        "KillMode=mixed",
        "LimitMEMLOCK=infinity",
        "StateDirectory=edge",
        "CacheDirectory=edge",
        "ConfigurationDirectory=edge",
        "UMask=0077",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={'read-only' if home else 'yes'}",
        "PrivateTmp=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
    ]
    if o.loopback_only and not o.user:
        lines += ["IPAddressDeny=any", "IPAddressAllow=localhost"]
    if not o.user:
        lines += [
            "DynamicUser=yes",
            "SupplementaryGroups=video render",
            "CapabilityBoundingSet=",
            "AmbientCapabilities=",
            "KeyringMode=private",
            "DevicePolicy=closed",
        ]
        lines += [f"DeviceAllow={d} rw" for d in GPU_DEVICES + GPU_DEVICE_CLASSES]
    target = "default.target" if o.user else "multi-user.target"
    lines += ["", "[Install]", f"WantedBy={target}", "Also=edge.socket", ""]
    return "\n".join(lines)


def unit_dir(prefix: str, user: bool) -> Path:
    if user:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(prefix + base) / "systemd" / "user" if prefix != "/" else Path(base) / "systemd" / "user"
    return Path(prefix) / "etc" / "systemd" / "system"


def install_units(o: UnitOptions, prefix: str = "/") -> list[Path]:
    """Write edge.socket and edge.service atomically into the unit directory; return their paths."""
    folder = unit_dir(prefix, o.user)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("edge.socket", render_socket(o)), ("edge.service", render_service(o))):
        atomic_write(folder / name, text, mode=0o644)
        written.append(folder / name)
    return written
