"""The planner's registry: which agents serve which hosts and devices, and which are up.

An agent is up while its heartbeats keep arriving; one silent for longer than
``heartbeat_timeout_s`` is down until it registers or heartbeats again. A host
name stays bound to the registration secret of the agent that registered it
while that agent is up: another registrant is refused, and heartbeats must
prove the secret (`reshard.server.common.tickets`).
"""

from __future__ import annotations

import dataclasses
import hmac
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from reshard.mesh import Mesh, host_of
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError, PermissionDeniedError
from reshard.server.common.auth import is_loopback_listen
from reshard.server.common.contract import check_host_name
from reshard.server.common.tickets import sign
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
    secret: bytes = field(default=b"", repr=False)  # the agent's registration secret: keys its tickets
    memory_limit_bytes: int = 0  # the most shard bytes the agent holds (0: not reported)
    memory_used_bytes: int = 0  # as of its last heartbeat
    device_gflops: float = 0.0  # one device's compute and memory rates, as registered (0: not known)
    memory_gb_per_s: float = 0.0
    # The agent's NIXL metadata as it registered it, handed to the other hosts of its nixl jobs; b"": no NIXL.
    nixl_metadata: bytes = field(default=b"", repr=False)

    @property
    def devices(self) -> list[str]:
        return [f"{self.host}/{i}" for i in range(self.num_devices)]


MIN_SECRET_BYTES = 16
MAX_NIXL_METADATA_BYTES = 1 << 20  # a NIXL agent's metadata is a few KiB: its name, backend and connection info


def _rate(value: float) -> float:
    """A reported rate, or 0 (not known: the cost model's default) when it is not a sane positive number."""
    return float(value) if 0 < value < 1e9 else 0.0
MAX_DEVICES_PER_HOST = 4096


class Registry:
    def __init__(self, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._agents: dict[str, AgentRecord] = {}
        self._generation = 0  # bumped by every registration: a registered sync's checks of devices and memory hold
        self._topology: tuple[int, Topology] | None = None  # (generation, `topology` then)

    @property
    def generation(self) -> int:
        """How many registrations the planner took: equal, no agent's devices, address or memory limit changed."""
        return self._generation

    def check(self, host: str, secret: bytes) -> AgentRecord | None:
        """Whether an agent with ``secret`` may register ``host``; returns the record it replaces, if any."""
        check_host_name(host)
        if len(secret) < MIN_SECRET_BYTES:
            raise InvalidArgumentError(f"host {host} registers a secret of {len(secret)} bytes; agents make one of "
                                       f"at least {MIN_SECRET_BYTES} random bytes at start")
        with self._lock:
            return self._check_locked(host, secret)

    def _check_locked(self, host: str, secret: bytes) -> AgentRecord | None:
        prev = self._agents.get(host)
        if prev is not None and not hmac.compare_digest(prev.secret, secret) and self.is_up(prev):
            raise PermissionDeniedError(
                f"host name {host!r} is registered by another live agent (at {prev.address}, last heard "
                f"{self.age(prev):.1f}s ago); a new agent may take it once that one is marked down "
                f"({self.heartbeat_timeout_s:g}s without a heartbeat)")
        return prev

    def register(self, host: str, num_devices: int, address: str, nic_gbps: float, device: str = "cpu",
                 gpu_uuid: str = "", secret: bytes = b"", memory_limit_bytes: int = 0,
                 device_gflops: float = 0.0, memory_gb_per_s: float = 0.0,
                 nixl_metadata: bytes = b"") -> AgentRecord:
        self.check(host, secret)
        if len(nixl_metadata) > MAX_NIXL_METADATA_BYTES:
            raise InvalidArgumentError(f"host {host} registers {len(nixl_metadata)} bytes of NIXL metadata; the "
                                       f"planner takes at most {MAX_NIXL_METADATA_BYTES}")
        if not 0 < num_devices <= MAX_DEVICES_PER_HOST:
            raise InvalidArgumentError(f"host {host} registers {num_devices} devices; a host has 1 to "
                                       f"{MAX_DEVICES_PER_HOST}")
        if not address or len(address) > 300 or not address.isprintable():
            raise InvalidArgumentError(f"host {host} registers the address {address[:80]!r}; agents must say where "
                                       f"peers reach them, as host:port")
        rec = AgentRecord(host, address, num_devices, nic_gbps if 0 < nic_gbps < 1e6 else 10.0, self._clock(),
                          device or "cpu", gpu_uuid, secret, max(0, memory_limit_bytes),
                          device_gflops=_rate(device_gflops), memory_gb_per_s=_rate(memory_gb_per_s),
                          nixl_metadata=bytes(nixl_metadata))
        with self._lock:
            self._check_locked(host, secret)  # again, with the write: two registrants of a free name race here
            self._agents[host] = rec
            self._generation += 1
        return rec

    def heartbeat(self, host: str, address: str, proof: str = "", memory_used_bytes: int = 0) -> bool:
        """Record a heartbeat; False when the host is unknown or moved (it must register again).

        ``proof`` is the heartbeat's HMAC under the host's registration secret: a heartbeat without it
        is refused, so no one but the agent keeps a host up.
        """
        with self._lock:
            rec = self._agents.get(host)
            if rec is None or rec.address != address:
                return False
            if not hmac.compare_digest(proof.encode("ascii", "replace"),
                                       sign(rec.secret, "heartbeat", host, address).encode()):
                raise PermissionDeniedError(f"heartbeat for host {host!r} does not prove its registration secret")
            self._agents[host] = dataclasses.replace(rec, last_seen=self._clock(),
                                                     memory_used_bytes=max(0, memory_used_bytes))
            return True

    def alive(self, host: str, address: str) -> None:
        """Count a report on a call the planner made to ``host``'s agent at ``address`` (a job's Execute stream:
        its progress, or that it still loads the job) as a heartbeat: an agent whose cores a job keeps busy may miss
        its heartbeat calls' deadline while it answers the planner's own call, and its host must not leave the
        process group meanwhile. Nothing where the host moved or is unknown."""
        with self._lock:
            rec = self._agents.get(host)
            if rec is not None and rec.address == address:
                self._agents[host] = dataclasses.replace(rec, last_seen=max(rec.last_seen, self._clock()))

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

    def secret(self, host: str) -> bytes:
        """The registration secret of ``host``'s agent, which keys the tickets of calls to it."""
        rec = self.get(host)
        if rec is None:
            raise FailedPreconditionError(f"no agent serves host {host!r}")
        return rec.secret

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
        """The cost model's view of the agents: each host's NIC and, where its agent measured them, its
        devices' compute and memory rates (the others get the defaults). Worked out once per `generation`: only a
        registration changes what it reads, and a job asks for it twice before its hosts start (0.4 ms each time
        for the emulated weight sync's 8 agents, most of it parsing their addresses)."""
        with self._lock:
            generation, known = self._generation, self._topology
        if known is not None and known[0] == generation:
            return known[1]
        topology = self._topology_of(self.agents())
        with self._lock:
            if self._generation == generation:
                self._topology = (generation, topology)
        return topology

    @staticmethod
    def _topology_of(agents: list[AgentRecord]) -> Topology:
        # Agents listening at one address are one machine's (`Topology.host_machine`); only such hosts are named
        machines = {r.host: _machine(r.address) for r in agents}
        at = Counter(machines.values())
        return Topology(host_nic_gbps={r.host: r.nic_gbps for r in agents},
                        host_device_gflops={r.host: r.device_gflops for r in agents if r.device_gflops},
                        host_memory_gb_per_s={r.host: r.memory_gb_per_s for r in agents if r.memory_gb_per_s},
                        host_machine={h: m for h, m in machines.items() if at[m] > 1})


def _machine(address: str) -> str:
    """The machine an agent listening at ``address`` (host:port, [v6]:port) runs on: its host part, every loopback
    address the one machine the planner runs on."""
    return "loopback" if is_loopback_listen(address) else address.rsplit(":", 1)[0].strip("[]")
