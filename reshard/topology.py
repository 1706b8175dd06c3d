"""Network topology the cost model sees: each host's full-duplex NICs, device-to-device links inside a host, and
each device's memory bandwidth.

Link bandwidths are given in Gbit/s, as NICs are sold; memory bandwidth in
GB/s (10^9 bytes), as memory is sold. The cost model works in bytes per second.

A host has ``nics_per_host`` NICs of ``nic_gbps`` each (one, by default). A GPU host has one per GPU, each on
its own rail (NIC ``i`` of every host on one switch): the cost model prices a host's network as one link of
their summed rate, which assumes its traffic spreads over its rails, as a plan that sends each box from the
device that holds it (to a peer on the same rail) does, and as NCCL's PXN does by crossing NVLink to the NIC of
the right rail. `rail_bytes_per_s` is one NIC's rate, what one device's traffic gets when it cannot spread.
A per-host override (``host_nic_gbps``, what an agent reports) is that host's whole network rate.
`Topology.gpu_hosts` builds the GPU host of today's weight-sync records: 8 x 400 Gbit/s and NVLink 4.
Hosts that are agents of one machine (``host_machine``: the planner's registry names each host's machine by the
address its agent listens at) move bytes between them as copies through that machine's memory, on its cores, not
over NICs: the cost model still prices each host's NIC alone, and `reshard.strategies` keeps a chain over a star
between them (`Topology.apart`).
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

__all__ = ["Topology", "MAX_NICS_PER_HOST"]

# More NICs than any host has (GPU hosts carry one per GPU, 8 today); a cap keeps a typo from meaning a terabit.
MAX_NICS_PER_HOST = 64


def _positive(name: str, value, unit: str = "Gbit/s") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidTopologyError(
            f"{name} is {brief(value)}; bandwidths must be positive numbers of {unit}, and finite"
        )
    return float(value)


@dataclass(frozen=True)
class Topology:
    """Per-host NIC bandwidth (send and receive each at that rate: ``nics_per_host`` NICs of ``nic_gbps``),
    intra-host bandwidth and per-device memory bandwidth, each with per-host overrides."""

    nic_gbps: float = 10.0
    intra_host_gbps: float = 100.0
    host_nic_gbps: tuple[tuple[str, float], ...] = field(default=())
    host_intra_gbps: tuple[tuple[str, float], ...] = field(default=())
    memory_gb_per_s: float = 20.0
    host_memory_gb_per_s: tuple[tuple[str, float], ...] = field(default=())
    device_gflops: float = 20.0
    host_device_gflops: tuple[tuple[str, float], ...] = field(default=())
    nics_per_host: int = 1
    # (host, machine) where hosts share a machine; a host not named is a machine of its own
    host_machine: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self):
        n = self.nics_per_host
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NICS_PER_HOST:
            raise InvalidTopologyError(
                f"nics_per_host is {brief(n)}; a host has a whole number of NICs from 1 to {MAX_NICS_PER_HOST} "
                f"(a GPU host has one per GPU: 8)"
            )
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
        raw = self.host_machine.items() if isinstance(self.host_machine, Mapping) else self.host_machine
        machines = tuple(sorted((str(h), str(m)) for h, m in raw))
        if any(not m for _, m in machines):
            raise InvalidTopologyError(f"host_machine names a host with an empty machine: {brief(dict(machines))}")
        object.__setattr__(self, "host_machine", machines)
        object.__setattr__(self, "_machines", dict(machines))

    @classmethod
    def gpu_hosts(cls, nics: int = 8, nic_gbps: float = 400.0, nvlink_gbps: float = 3600.0,
                  memory_gb_per_s: float = 3350.0, device_gflops: float = 67_000.0) -> "Topology":
        """Hosts of GPUs with one ``nic_gbps`` NIC per GPU, rail-aligned, and NVLink between a host's GPUs.

        The defaults are an H100 SXM host, the hardware of the 1 T weight-sync records (Perplexity's, miles'):
        8 x 400 Gbit/s (ConnectX-7), 400 GB/s per host. NVLink 4 gives a GPU 18 links, 450 GB/s in each
        direction (900 GB/s both ways); the cost model prices a device's intra-host link in each direction on
        its own, so its rate is one direction's, 3,600 Gbit/s (7,200 would count both directions twice).
        Memory: HBM3's 3.35 TB/s; compute: 67 TFLOP/s of float32 (the kernels' arithmetic, not the tensor
        cores'). Figures are the vendor's nominal ones, as the floor arithmetic of the records uses
        (bytes / 50 GB/s per NIC); measured rates reach 88-97 % of the NIC and 84 % of NVLink.
        """
        return cls(nic_gbps=nic_gbps, nics_per_host=nics, intra_host_gbps=nvlink_gbps,
                   memory_gb_per_s=memory_gb_per_s, device_gflops=device_gflops)

    def nic_bytes_per_s(self, host: str) -> float:
        """What ``host`` sends (and, at once, receives) a second over the network: its NICs' rates added up."""
        over = dict(self.host_nic_gbps).get(host)
        return (over if over is not None else self.nic_gbps * self.nics_per_host) * 1e9 / 8

    def machine(self, host: str) -> str:
        """The machine ``host`` runs on (`host_machine`; by default a machine of its own, named by the host)."""
        return self._machines.get(host, "host:" + host)

    def apart(self, sender: str, receivers) -> bool:
        """Whether ``sender`` is on another machine than every host of ``receivers``: its streams to them cross
        NICs. False where one of them shares its machine, whose streams are copies through memory."""
        if not self._machines:
            return sender not in receivers
        mine = self.machine(sender)
        return all(self.machine(h) != mine for h in receivers)

    def rail_bytes_per_s(self, host: str) -> float:
        """One of ``host``'s NICs: what one device's traffic gets when it stays on its own rail."""
        return self.nic_bytes_per_s(host) / self.nics_per_host

    def intra_bytes_per_s(self, host: str) -> float:
        return dict(self.host_intra_gbps).get(host, self.intra_host_gbps) * 1e9 / 8

    def memory_bytes_per_s(self, host: str) -> float:
        """How fast one device of ``host`` reads plus writes its own memory."""
        return dict(self.host_memory_gb_per_s).get(host, self.memory_gb_per_s) * 1e9

    def flops_per_s(self, host: str) -> float:
        """How many floating-point operations one device of ``host`` runs a second."""
        return dict(self.host_device_gflops).get(host, self.device_gflops) * 1e9

    def to_json(self) -> dict:
        # ``nics_per_host`` is written only where a host has more than one, so that every topology of one NIC a
        # host reads, writes and hashes (into plan ids) as it did before it existed.
        rails = {"nics_per_host": self.nics_per_host} if self.nics_per_host != 1 else {}
        # likewise ``host_machine``, only where hosts share a machine
        machines = {"host_machine": dict(self.host_machine)} if self.host_machine else {}
        return {
            "nic_gbps": self.nic_gbps,
            "intra_host_gbps": self.intra_host_gbps,
            "host_nic_gbps": dict(self.host_nic_gbps),
            "host_intra_gbps": dict(self.host_intra_gbps),
            "memory_gb_per_s": self.memory_gb_per_s,
            "host_memory_gb_per_s": dict(self.host_memory_gb_per_s),
            "device_gflops": self.device_gflops,
            "host_device_gflops": dict(self.host_device_gflops),
            **rails,
            **machines,
        }

    @classmethod
    def from_json(cls, data) -> "Topology":
        need(data, "object", "topology JSON", InvalidTopologyError)
        for key in ("host_nic_gbps", "host_intra_gbps", "host_memory_gb_per_s", "host_device_gflops", "host_machine"):
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
            nics_per_host=data.get("nics_per_host", 1),
            host_machine=data.get("host_machine", {}),
        )

    def __str__(self) -> str:
        extra = f", {len(self.host_nic_gbps)} NIC overrides" if self.host_nic_gbps else ""
        nic = f"{self.nics_per_host} x {self.nic_gbps:g}" if self.nics_per_host != 1 else f"{self.nic_gbps:g}"
        return f"Topology(NIC {nic} Gbit/s, intra-host {self.intra_host_gbps:g} Gbit/s{extra})"
