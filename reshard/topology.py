"""Network topology the cost model sees: one full-duplex NIC per host, and
device-to-device links inside a host.

Bandwidths are given in Gbit/s, as NICs are sold; the cost model works in bytes
per second.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from reshard.errors import InvalidTopologyError

__all__ = ["Topology"]


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidTopologyError(f"{name} is {value!r}; bandwidths must be positive numbers of Gbit/s")
    return float(value)


@dataclass(frozen=True)
class Topology:
    """Per-host NIC bandwidth (send and receive each at that rate) and intra-host bandwidth."""

    nic_gbps: float = 10.0
    intra_host_gbps: float = 100.0
    host_nic_gbps: tuple[tuple[str, float], ...] = field(default=())
    host_intra_gbps: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "nic_gbps", _positive("nic_gbps", self.nic_gbps))
        object.__setattr__(self, "intra_host_gbps", _positive("intra_host_gbps", self.intra_host_gbps))
        for attr in ("host_nic_gbps", "host_intra_gbps"):
            raw = getattr(self, attr)
            items = raw.items() if isinstance(raw, Mapping) else raw
            norm = tuple(sorted((str(h), _positive(f"{attr}[{h!r}]", v)) for h, v in items))
            object.__setattr__(self, attr, norm)

    def nic_bytes_per_s(self, host: str) -> float:
        return dict(self.host_nic_gbps).get(host, self.nic_gbps) * 1e9 / 8

    def intra_bytes_per_s(self, host: str) -> float:
        return dict(self.host_intra_gbps).get(host, self.intra_host_gbps) * 1e9 / 8

    def to_json(self) -> dict:
        return {
            "nic_gbps": self.nic_gbps,
            "intra_host_gbps": self.intra_host_gbps,
            "host_nic_gbps": dict(self.host_nic_gbps),
            "host_intra_gbps": dict(self.host_intra_gbps),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "Topology":
        return cls(
            nic_gbps=data.get("nic_gbps", 10.0),
            intra_host_gbps=data.get("intra_host_gbps", 100.0),
            host_nic_gbps=data.get("host_nic_gbps", {}),
            host_intra_gbps=data.get("host_intra_gbps", {}),
        )

    def __str__(self) -> str:
        extra = f", {len(self.host_nic_gbps)} NIC overrides" if self.host_nic_gbps else ""
        return f"Topology(NIC {self.nic_gbps:g} Gbit/s, intra-host {self.intra_host_gbps:g} Gbit/s{extra})"
