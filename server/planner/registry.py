"""The planner's registry: which agents serve which hosts and devices, and which are up.

An agent is up while its heartbeats keep arriving; one silent for longer than
``heartbeat_timeout_s`` is down until it registers or heartbeats again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from reshard.mesh import Mesh, host_of
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.topology import Topology

__all__ = ["AgentRecord", "Registry"]


@dataclass(frozen=True)
class AgentRecord:
    host: str
    address: str
    num_devices: int
    nic_gbps: float
    last_seen: float
    device: str = "cpu"  # where the agent keeps its shards: cpu or cuda:N
    gpu_uuid: str = ""  # that GPU's uuid, "" for cpu

    @property
    def devices(self) -> list[str]:
        return [f"{self.host}/{i}" for i in range(self.num_devices)]


class Registry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._agents: dict[str, AgentRecord] = {}

    def register(self, host: str, num_devices: int, address: str, nic_gbps: float, device: str = "cpu",
                 gpu_uuid: str = "") -> AgentRecord:
        if not host or "/" in host:
            raise InvalidArgumentError(f"host name {host!r} must be non-empty and contain no '/'")
        if num_devices <= 0:
            raise InvalidArgumentError(f"host {host} registers {num_devices} devices; it needs at least one")
        if not address:
            raise InvalidArgumentError(f"host {host} registers no address; agents must say where peers reach them")
        rec = AgentRecord(host, address, num_devices, nic_gbps if nic_gbps > 0 else 10.0, self._clock(),
                          device or "cpu", gpu_uuid)
        with self._lock:
            self._agents[host] = rec
        return rec

    def heartbeat(self, host: str, address: str) -> bool:
        """Record a heartbeat; False when the host is unknown or moved (it must register again)."""
        with self._lock:
            rec = self._agents.get(host)
            if rec is None or rec.address != address:
                return False
            self._agents[host] = dataclasses.replace(rec, last_seen=self._clock())
            return True

    def age(self, rec: AgentRecord) -> float:
        return self._clock() - rec.last_seen

    def is_up(self, rec: AgentRecord) -> bool:
        return self.age(rec) <= self.heartbeat_timeout_s

    def agents(self) -> list[AgentRecord]:
        with self._lock:
            return sorted(self._agents.values(), key=lambda r: r.host)

    def get(self, host: str) -> AgentRecord | None:
        with self._lock:
            return self._agents.get(host)

    def require_up(self, host: str) -> AgentRecord:
        rec = self.get(host)
        if rec is None:
            raise FailedPreconditionError(
                f"no agent serves host {host!r}; registered hosts are {[r.host for r in self.agents()]}"
            )
        if not self.is_up(rec):
            raise FailedPreconditionError(
                f"host {host!r} is down: its agent at {rec.address} sent no heartbeat for {self.age(rec):.1f}s "
                f"(agents are down after {self.heartbeat_timeout_s:g}s); restart it or use a mesh without it"
            )
        return rec

    def check_mesh(self, mesh: Mesh) -> None:
        """Every device of ``mesh`` is registered, and its host is up."""
        for dev in mesh.require_devices():
            host = host_of(dev)
            rec = self.get(host)
            index = dev.rpartition("/")[2]
            if rec is None or not index.isdigit() or int(index) >= rec.num_devices:
                known = [d for r in self.agents() for d in r.devices]
                shown = known[:8] + (["..."] if len(known) > 8 else [])
                raise InvalidArgumentError(
                    f"unknown device {dev!r}: no registered agent has it; registered devices are {shown}"
                )
        for host in mesh.hosts:
            self.require_up(host)

    def up_devices(self) -> list[str]:
        return [d for r in self.agents() if self.is_up(r) for d in r.devices]

    def topology(self) -> Topology:
        return Topology(host_nic_gbps={r.host: r.nic_gbps for r in self.agents()})
