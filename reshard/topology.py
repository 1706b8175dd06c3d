"""Network topology the cost model sees: one full-duplex NIC per host,
device-to-device links inside a host, and each device's memory bandwidth.

Link bandwidths are given in Gbit/s, as NICs are sold; memory bandwidth in
GB/s (10^9 bytes), as memory is sold. The cost model works in bytes per second.
Compute steps are priced as a roofline: the longer of their bytes over the
device's memory bandwidth and their floating-point operations over its rate
(``device_gflops``, GFLOP/s). The defaults (20 GB/s, 20 GFLOP/s) are a
conservative single CPU core; agents measure their own device when they start
(``reshard.server.agent.probe``) and the planner's topology carries the figures
per host, so estimates follow the machines they run on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from reshard.errors import InvalidTopologyError
from reshard.jsonio import brief, field_of, need

__all__ = ["Topology"]


def _positive(name: str, value, unit: str = "Gbit/s") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidTopologyError(
            f"{name} is {brief(value)}; bandwidths must be positive numbers of {unit}, and finite"
        )
    return float(value)


@dataclass(frozen=True)
class Topology:
    """Per-host NIC bandwidth (send and receive each at that rate), intra-host bandwidth
    and per-device memory bandwidth, each with per-host overrides."""

    nic_gbps: float = 10.0
    intra_host_gbps: float = 100.0
    host_nic_gbps: tuple[tuple[str, float], ...] = field(default=())
    host_intra_gbps: tuple[tuple[str, float], ...] = field(default=())
    memory_gb_per_s: float = 20.0
    host_memory_gb_per_s: tuple[tuple[str, float], ...] = field(default=())
    device_gflops: float = 20.0
    host_device_gflops: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "nic_gbps", _positive("nic_gbps", self.nic_gbps))
        object.__setattr__(self, "intra_host_gbps", _positive("intra_host_gbps", self.intra_host_gbps))
        object.__setattr__(self, "memory_gb_per_s", _positive("memory_gb_per_s", self.memory_gb_per_s, "GB/s"))
        object.__setattr__(self, "device_gflops", _positive("device_gflops", self.device_gflops, "GFLOP/s"))
        for attr, unit in (("host_nic_gbps", "Gbit/s"), ("host_intra_gbps", "Gbit/s"), ("host_memory_gb_per_s", "GB/s"),
                           ("host_device_gflops", "GFLOP/s")):
            raw = getattr(self, attr)
            items = raw.items() if isinstance(raw, Mapping) else raw
            norm = tuple(sorted((str(h), _positive(f"{attr}[{h!r}]", v, unit)) for h, v in items))
            object.__setattr__(self, attr, norm)

    def nic_bytes_per_s(self, host: str) -> float:
        return dict(self.host_nic_gbps).get(host, self.nic_gbps) * 1e9 / 8

    def intra_bytes_per_s(self, host: str) -> float:
        return dict(self.host_intra_gbps).get(host, self.intra_host_gbps) * 1e9 / 8

    def memory_bytes_per_s(self, host: str) -> float:
        """How fast one device of ``host`` reads plus writes its own memory."""
        return dict(self.host_memory_gb_per_s).get(host, self.memory_gb_per_s) * 1e9

    def flops_per_s(self, host: str) -> float:
        """How many floating-point operations one device of ``host`` runs a second."""
        return dict(self.host_device_gflops).get(host, self.device_gflops) * 1e9

    def to_json(self) -> dict:
        return {
            "nic_gbps": self.nic_gbps,
            "intra_host_gbps": self.intra_host_gbps,
            "host_nic_gbps": dict(self.host_nic_gbps),
            "host_intra_gbps": dict(self.host_intra_gbps),
            "memory_gb_per_s": self.memory_gb_per_s,
            "host_memory_gb_per_s": dict(self.host_memory_gb_per_s),
            "device_gflops": self.device_gflops,
            "host_device_gflops": dict(self.host_device_gflops),
        }

    @classmethod
    def from_json(cls, data) -> "Topology":
        need(data, "object", "topology JSON", InvalidTopologyError)
        for key in ("host_nic_gbps", "host_intra_gbps", "host_memory_gb_per_s", "host_device_gflops"):
            field_of(data, key, "object", "topology JSON", InvalidTopologyError, default={})
        return cls(
            nic_gbps=data.get("nic_gbps", 10.0),
            intra_host_gbps=data.get("intra_host_gbps", 100.0),
            host_nic_gbps=data.get("host_nic_gbps", {}),
            host_intra_gbps=data.get("host_intra_gbps", {}),
            # Topology JSON written before memory bandwidth existed reads with the default.
            memory_gb_per_s=data.get("memory_gb_per_s", 20.0),
            host_memory_gb_per_s=data.get("host_memory_gb_per_s", {}),
            device_gflops=data.get("device_gflops", 20.0),
            host_device_gflops=data.get("host_device_gflops", {}),
        )

    def __str__(self) -> str:
        extra = f", {len(self.host_nic_gbps)} NIC overrides" if self.host_nic_gbps else ""
        return f"Topology(NIC {self.nic_gbps:g} Gbit/s, intra-host {self.intra_host_gbps:g} Gbit/s{extra})"
