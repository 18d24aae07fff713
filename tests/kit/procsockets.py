"""A process's listening sockets as the kernel shows them, never as the process says: the socket
inodes of its open descriptors (`/proc/PID/fd`, links `socket:[INODE]`) joined with the tables
of its network namespace (`/proc/PID/net/tcp`, `tcp6`: state 0A is LISTEN; `/proc/PID/net/unix`:
flag __SO_ACCEPTCON marks a listening socket)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Listener", "listening", "socket_inodes"]

_TCP_LISTEN = "0A"
_SO_ACCEPTCON = 0x10000


@dataclass(frozen=True)
class Listener:
    family: str  # "tcp", "tcp6" or "unix"
    address: str  # host:port, or the Unix socket's path ("" for an unnamed one, "@..." abstract)
    inode: int


def socket_inodes(pid: int) -> set[int]:
    """The inodes of every socket `pid` holds open (a descriptor closed meanwhile is skipped)."""
    found = set()
    folder = Path(f"/proc/{pid}/fd")
    for fd in os.listdir(folder):
        try:
            target = os.readlink(folder / fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _hex_address(text: str, v6: bool) -> str:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc prints the address as 32-bit words in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    shown = f"[{ip}]" if v6 else str(ip)
    return f"{shown}:{int(port, 16)}"


def _tcp(pid: int, name: str) -> dict[int, Listener]:
    out = {}
    try:
        lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
    except FileNotFoundError:  # no IPv6 in this kernel
        return out
    for line in lines:
        cols = line.split()
        if cols[3] == _TCP_LISTEN:
            out[int(cols[9])] = Listener(name, _hex_address(cols[1], name == "tcp6"), int(cols[9]))
    return out


def _unix(pid: int) -> dict[int, Listener]:
    out = {}
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        cols = line.split(None, 7)
        if int(cols[3], 16) & _SO_ACCEPTCON:
            out[int(cols[6])] = Listener("unix", cols[7] if len(cols) > 7 else "", int(cols[6]))
    return out


def listening(pid: int) -> set[Listener]:
    """Every socket `pid` listens on: TCP over IPv4 and IPv6, and Unix stream sockets."""
    table = {**_tcp(pid, "tcp"), **_tcp(pid, "tcp6"), **_unix(pid)}
    return {table[i] for i in socket_inodes(pid) if i in table}
