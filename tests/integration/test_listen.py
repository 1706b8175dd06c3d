"""Every socket a default ``reshard up`` listens on is on loopback (issue 11).

The sockets come from the kernel's own tables (``/proc/net/tcp`` and ``tcp6``),
matched to the cluster's processes through their open file descriptors: the
planner's gRPC port, its rendezvous store, the dashboard, every agent's gRPC
port and whatever the agents' process group opens.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path

import pytest

from .conftest import reshard_up

LISTEN = "0A"


def _descendants(pid: int) -> list[int]:
    out = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        for child in children.read_text().split():
            out += _descendants(int(child))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(int(m.group(1)))
    return inodes


def _decode(hex_address: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(ip_hex)
    # The kernel prints each 32-bit word in host byte order (little-endian here).
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port_hex, 16)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == LISTEN and inode in owner:
                found.append((owner[inode], *_decode(local)))
    return found


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # gloo listens on ::ffff:127.0.0.1
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net tables")
def test_a_default_reshard_up_listens_on_loopback_only():
    with reshard_up("--hosts", "2", "--devices-per-host", "1") as (proc, lines):
        pids = _descendants(proc.pid)
        assert len(pids) == 4  # reshard up, the planner and two agents
        sockets = listening_sockets(pids)
        ports = {port for _, _, port in sockets}
        printed = {int(m) for m in re.findall(r"127\.0\.0\.1:(\d+)", "".join(lines))}
        assert printed <= ports, f"printed ports {printed} not all found listening in {sockets}"
        # gRPC of the planner and two agents, the dashboard and the rendezvous store at least.
        assert len(sockets) >= 5, sockets
        open_ = [(pid, ip, port) for pid, ip, port in sockets if not _loopback(ip)]
        assert not open_, f"sockets listening beyond loopback: {open_}"
