"""systemd units for a device: rendered for the installed `edge`, written atomically.

The service is started at boot (WantedBy=multi-user.target), not on the first connection: the
point is that the model is paged in, locked and warm before traffic comes. The socket unit holds
the listening socket across restarts, so connections made meanwhile wait in its backlog.
"""

from __future__ import annotations

import os
import shutil
import string
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from edge.config import DEFAULT_MAX_CONNECTIONS, SYSTEM_CONFIG
from edge.errors import EX_CONFIG, EX_DATAERR, EX_NOPERM, EX_SAFE_MODE_EXHAUSTED
from edge.fsutil import atomic_write, fsync_dir
from edge.host.gpu_nodes import GPU_DEVICE_CLASSES, GPU_DEVICES, UVM_UNIT, nvidia_minors, render_uvm
from edge.serve.limits import nofile_for

__all__ = ["UnitOptions", "render_service", "render_socket", "install_units", "install_starter_config", "reclaim_config_dir",
           "render_rearm", "REARM_UNIT", "installed_service", "starter_path", "with_drop_ins", "default_edge_command",
           "STARTER_CONFIG", "START_LIMIT_BURST", "START_LIMIT_INTERVAL_S"]

# The unit's start limit only catches what edge cannot bound itself: edge ends a crash loop on its
# own (safe mode's steps, then a give-up that answers 503 and is not a crash), so the limit is set
# above what a person's restarts (10 in a minute), OTA activations and socket-triggered starts
# add up to, and above the crashes safe mode needs to climb its ladders; a start that keeps
# failing before edge's journal runs (a broken install) still stops after 20 tries in 2 minutes
# (RestartSec=2 alone would retry forever).
START_LIMIT_BURST = 20
START_LIMIT_INTERVAL_S = 120

STARTER_CONFIG = """\
# Starter config written by `edge units install` (it never overwrites an existing file).
# Every field and its default: docs/config.md. After editing: systemctl restart edge.service
[server]
drain_timeout_s = 30.0

[[models]]
name = "gemma3-270m"
path = "builtin:gemma3-270m"   # the embedded default model (extra `default-model`); or a .gguf path
use_mlock = true
"""


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
    groups: tuple[str, ...] = ("video", "render")  # GPU device access on L4T and desktop distros
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # the config's server.max_connections
    devices: tuple[str, ...] | None = None  # DeviceAllow= entries; None: every platform's
    modprobe: str | None = None  # nvidia-modprobe, which the oneshot edge-nvidia-uvm.service runs first (dGPU)

    @property
    def loopback_only(self) -> bool:
        return all(a.split(":")[0] in ("127.0.0.1", "localhost", "[::1]") for a in self.listen)


REARM_UNIT = "edge-socket-rearm.service"


def render_socket(o: UnitOptions) -> str:
    lines = ["[Unit]", "Description=edge inference service socket (holds connections across restarts)",
             # systemd stops a socket whose service hits its start limit (result
             # service-start-limit-hit), and each later connection would do it again: the socket
             # is started again at once, never rate-limited, so something always listens
             f"OnFailure={REARM_UNIT}", "StartLimitIntervalSec=0", "", "[Socket]"]
    lines += [f"ListenStream={a}" for a in o.listen]
    if o.unix_socket:
        lines += [f"ListenStream={o.unix_socket}", "SocketMode=0660"]
        if o.socket_group:
            lines.append(f"SocketGroup={o.socket_group}")
    lines += [f"Backlog={o.backlog}", "NoDelay=true", "", "[Install]", "WantedBy=sockets.target", ""]
    return "\n".join(lines)


SERVICE = string.Template("""\
# Rendered by `edge units print`; see docs/deploy.md ("The units in detail") for every choice made here.
# Left out on purpose, each because it breaks the GPU path or mlock:
#   MemoryDenyWriteExecute=  CUDA's PTX JIT and libffi (ctypes callbacks) map W+X pages
#   PrivateDevices=          hides /dev/nvmap, /dev/nvhost-* and /dev/nvidia*; DevicePolicy=
#                            closed + DeviceAllow= below limit devices instead
#   PrivateUsers=            GPU device access through the video/render groups is untested
#                            inside a user namespace on L4T
#   ProcSubset=pid           device identity reads /proc/device-tree and the CUDA driver /proc
#   SystemCallFilter=~@resources  ggml thread pools may set affinity and priority
# ExecStop=edge stop: after a handover the main process was started by the old one, not by systemd
# ("not our child"), and systemd 249-252 does not wait for such a main process after its SIGTERM:
# it SIGKILLs it at once, in-flight requests and all, and the stop is recorded as a crash. `edge
# stop` sends the SIGTERM itself and waits until the process is gone (the drain), which systemd
# waits for (up to TimeoutStopSec=); KillMode=control-group then ends anything left.
[Unit]
Description=edge inference service (paged-in, locked and warmed up before READY)
Requires=edge.socket
After=edge.socket network.target nvidia-persistenced.service
${uvm}StartLimitIntervalSec=$limit_interval
StartLimitBurst=$limit_burst

[Service]
Type=notify
NotifyAccess=all
ExecStart=$edge serve --config $config
ExecReload=$edge reload --config $config --timeout $reload_timeout
ExecStop=$edge stop
ExecStopPost=$edge record-stop --config $config
Restart=on-failure
RestartSec=2
RestartPreventExitStatus=$no_restart
TimeoutStartSec=$start_timeout
TimeoutStopSec=$stop_timeout
WatchdogSec=$watchdog
KillMode=control-group
LimitMEMLOCK=infinity
LimitNICE=+0
Environment=CUDA_CACHE_PATH=%C/edge/cuda
LimitNOFILE=$nofile
StateDirectory=edge
CacheDirectory=edge
# API keys and TLS (docs/security.md): each file root's, mode 0600;
# uncomment what you use, then systemctl daemon-reload && systemctl restart edge.service
#LoadCredential=edge-api-keys:/etc/edge/api-keys
#LoadCredential=edge-tls-cert:/etc/edge/tls/cert.pem
#LoadCredential=edge-tls-key:/etc/edge/tls/key.pem
UMask=0077
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=$protect_home
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=mincore
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
${system}
[Install]
WantedBy=$target
Also=edge.socket
""")
# Why some lines are as they are (comments in the rendered unit would be read by every device):
# - ExecReload=: below TimeoutStartSec=, which systemd also applies to reloads.
# - NotifyAccess=all: a handover's new process (edge.lifecycle.handover.handover) is the old one's child; the
#   old one sends MAINPID=<new> and the new one's watchdog pings count before it is the main process.
# - RestartPreventExitStatus=: config error, bad model or engine file, mlock refused, no GPU for
#   offloaded layers, safe mode exhausted: a restart cannot fix these.
# - ExecStopPost=: `edge record-stop` records how the main process ended ($SERVICE_RESULT,
#   $EXIT_CODE, $EXIT_STATUS), so a crash keeps its signal even when the process wrote nothing.
# - CUDA_CACHE_PATH: CUDA's PTX JIT cache (default ~/.nv, absent for a DynamicUser) kept across
#   restarts, so kernels are compiled once per driver, not once per start.
# - LimitNICE=+0: a handover's new process starts at a lower CPU priority and takes nice 0 back
#   before it serves (edge.lifecycle.handover.priority); never above the service's own priority.
# - LimitNOFILE=: server.max_connections plus the files (edge.serve.limits.nofile_for).
# - No ConfigurationDirectory=: with DynamicUser= it chowns /etc/edge to the service's uid, which
#   could then rewrite its own config and the OTA key; ProtectSystem=strict keeps /etc read-only.
# - SystemCallFilter=mincore: page-in's resident_before; in no syscall group of systemd 252.


def _system_lines(o: UnitOptions) -> str:
    """What only a system unit has: loopback-only IP policy, the dynamic user, no capabilities,
    and the device policy with every GPU node of the platforms `o.devices` names."""
    if o.user:
        return ""
    lines = ["IPAddressDeny=any", "IPAddressAllow=localhost"] if o.loopback_only else []
    lines += ["DynamicUser=yes", *([f"SupplementaryGroups={' '.join(o.groups)}"] if o.groups else []),
              "CapabilityBoundingSet=", "AmbientCapabilities=", "KeyringMode=private", "DevicePolicy=closed"]
    lines += [f"DeviceAllow={d} rw" for d in (o.devices if o.devices is not None else GPU_DEVICES + GPU_DEVICE_CLASSES)]
    return "\n".join(lines) + "\n"


def _uvm_lines(o: UnitOptions) -> str:
    """A system unit on a host with nvidia-modprobe pulls in the oneshot that makes the NVIDIA
    driver's nodes (edge.host.gpu_nodes.render_uvm) and starts after it."""
    return f"Wants={UVM_UNIT}\nAfter={UVM_UNIT}\n" if o.modprobe and not o.user else ""


def render_service(o: UnitOptions) -> str:
    home = o.edge.startswith(("/home/", "/root/")) or o.config.startswith(("/home/", "/root/"))
    return SERVICE.substitute(
        limit_interval=START_LIMIT_INTERVAL_S, limit_burst=START_LIMIT_BURST, uvm=_uvm_lines(o),
        edge=o.edge, config=o.config, reload_timeout=max(1, o.start_timeout_s - 15),
        no_restart=f"{EX_DATAERR} {EX_SAFE_MODE_EXHAUSTED} {EX_NOPERM} {EX_CONFIG}", start_timeout=o.start_timeout_s,
        stop_timeout=o.stop_timeout_s, watchdog=o.watchdog_s, nofile=nofile_for(o.max_connections),
        protect_home="read-only" if home else "yes", system=_system_lines(o),
        target="default.target" if o.user else "multi-user.target")


def render_rearm(o: UnitOptions) -> str:
    return "\n".join([
        "[Unit]", "Description=listen again on edge.socket after edge.service hit its start limit",
        "StartLimitIntervalSec=0", "", "[Service]", "Type=oneshot",
        "ExecStart=systemctl " + ("--user " if o.user else "") + "start --no-block edge.socket", ""])


def unit_dir(prefix: str, user: bool) -> Path:
    if user:
        base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        return Path(prefix + base) / "systemd" / "user" if prefix != "/" else Path(base) / "systemd" / "user"
    return Path(prefix) / "etc" / "systemd" / "system"


def starter_path(config: str) -> str:
    """Where `edge units install` puts the starter config for units that read `config`: there,
    unless it is an OTA-managed `<state_dir>/ota/current/edge.toml`, a link every install moves
    and never a file to write (one written there would stand where the link must go); then the
    device's own config, which the first `edge ota recover` records as the factory config that
    `current` points at until a version is installed (edge.ota.factory)."""
    return str(SYSTEM_CONFIG) if Path(config).parts[-3:] == ("ota", "current", "edge.toml") else config


def with_drop_ins(unit: Path) -> str:
    """A unit file's text with its drop-ins (`<unit>.d/*.conf`, in name order, as `systemctl
    edit` writes them) after it: what systemd reads, so the last setting of a key wins and list
    settings (LoadCredential=) add up."""
    drop_ins = sorted(unit.with_name(unit.name + ".d").glob("*.conf"))
    return "\n".join(p.read_text() for p in [unit, *drop_ins])


def installed_service(unit_dirs: list[Path]) -> str | None:
    """The installed edge.service with its drop-ins: of the first unit dir that has both units."""
    for d in unit_dirs:
        if (d / "edge.socket").is_file() and (d / "edge.service").is_file():
            return with_drop_ins(d / "edge.service")
    return None


def install_starter_config(path: Path) -> bool:
    """Write STARTER_CONFIG to `path` unless a file is there; True if written.

    Written to a temp file, fsynced, then hard-linked into place: the link fails if a config
    appeared meanwhile, so an existing one is never replaced and no half-written file is seen.
    """
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        atomic_write(tmp, STARTER_CONFIG, mode=0o644)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def existing_groups(prefix: str, groups: tuple[str, ...]) -> tuple[str, ...]:
    """The groups of `groups` that <prefix>/etc/group has: a missing one fails the start (216/GROUP)."""
    try:
        text = (Path(prefix) / "etc" / "group").read_text()
    except OSError:
        return groups
    have = {line.split(":", 1)[0] for line in text.splitlines()}
    return tuple(g for g in groups if g in have)


def reclaim_config_dir(folder: Path) -> bool:
    """Give `folder` (and what is in it) back to root if a dynamic uid owns it; True if it did.

    Units before this one had ConfigurationDirectory=edge with DynamicUser=yes, which chowns
    /etc/edge to the service's uid on every start; that uid may later be handed to another service.
    """
    if os.geteuid() != 0 or not folder.is_dir() or folder.stat().st_uid == 0:
        return False
    for here, dirs, files in os.walk(folder):
        for name in [here, *(os.path.join(here, n) for n in dirs + files)]:
            os.chown(name, 0, 0, follow_symlinks=False)
    return True


def install_units(o: UnitOptions, prefix: str = "/") -> list[Path]:
    """Write edge.socket and edge.service atomically into the unit directory; return their paths.

    SupplementaryGroups= keeps only groups this system has (a headless Debian without udev has
    no `render`)."""
    o = replace(o, groups=existing_groups(prefix, o.groups))
    folder = unit_dir(prefix, o.user)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    units = [("edge.socket", render_socket(o)), ("edge.service", render_service(o)), (REARM_UNIT, render_rearm(o))]
    if _uvm_lines(o):
        units.append((UVM_UNIT, render_uvm(str(o.modprobe), nvidia_minors(o.devices))))
    for name, text in units:
        atomic_write(folder / name, text, mode=0o644)
        written.append(folder / name)
    return written
