"""UCX's environment for the agent's NIXL transport: the one network interface UCX may use, found from --listen.

UCX has no authentication (docs/security.md), and by default it opens TCP listeners on, and reaches peers
through, every interface of the machine. An agent told to listen on one address keeps its NIXL traffic on that
address's interface: ``UCX_NET_DEVICES`` names it (``lo`` for the default 127.0.0.1), so UCX's TCP transport
binds there only; shared memory between processes of one host stays on. ``tcp_only`` (``--nixl-tcp-only``) adds
``UCX_TLS=tcp``: the emulated lab's hosts share one kernel, and UCX would otherwise move their bytes through
shared memory, around the shaped links. A variable already set in the agent's environment is the operator's
choice and is kept. UCX reads its environment when the NIXL agent is made, so this runs before that.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping

__all__ = ["ucx_environment", "interface_of"]

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def _ipv4_of(name: str) -> ipaddress.IPv4Address | None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return ipaddress.IPv4Address(packed[20:24])


def _ipv6_interfaces() -> dict[ipaddress.IPv6Address, str]:
    try:
        with open("/proc/net/if_inet6") as f:  # hex address, index, prefix, scope, flags, name
            rows = [line.split() for line in f]
    except OSError:
        return {}
    return {ipaddress.IPv6Address(int(r[0], 16)): r[5] for r in rows if len(r) == 6}


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds ``address`` (an IP or a name that resolves to one),
    the loopback interface for any loopback address; None when no interface holds it, or it cannot be told here."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(address, None)[0][4][0])
        except (OSError, IndexError, ValueError):
            return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    if ip.version == 6 and not ip.is_loopback:
        return _ipv6_interfaces().get(ip)
    for name in names:
        held = _ipv4_of(name)
        if held is not None and (held == ip or (ip.is_loopback and held.is_loopback)):
            return name
    return None


def ucx_environment(listen: str, advertise: str | None = None, tcp_only: bool = False,
                    environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """(the UCX variables to set, what the log should say about it) for an agent listening on ``listen``
    (``host:port``), reached at ``advertise``; variables set in ``environ`` are left out (kept as the operator
    set them). A wildcard ``listen`` binds to the interface of ``advertise`` when it is an address of this
    machine; with neither, UCX keeps its default of every interface, and the line says so."""
    environ = environ if environ is not None else {}
    want: dict[str, str] = {}
    host = listen.rsplit(":", 1)[0]
    if host in _WILDCARDS and advertise:
        host = advertise.rsplit(":", 1)[0]
    iface = None if host in _WILDCARDS else interface_of(host)
    if iface is not None:
        want["UCX_NET_DEVICES"] = iface
    if tcp_only:
        want["UCX_TLS"] = "tcp"
    kept = {k: environ[k] for k in ("UCX_NET_DEVICES", "UCX_TLS") if k in environ}
    out = {k: v for k, v in want.items() if k not in kept}
    said = [f"{k}={v}" for k, v in out.items()] + [f"{k}={v} (as set)" for k, v in kept.items()]
    if iface is None and "UCX_NET_DEVICES" not in kept:
        said.append(f"UCX may use every network interface: no interface of this machine holds the listen address "
                    f"{listen!r}" + (f" or the advertised {advertise!r}" if advertise else "")
                    + "; set UCX_NET_DEVICES to the one NIXL traffic should take")
    return out, "; ".join(said) or "UCX's defaults"
