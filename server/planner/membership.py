"""The planner's view of the agents' process group: members, generations, and each job's transport.

Agents that registered with ``--transport collective`` or ``auto`` (and have
torch) are the members, in host order (``nixl`` agents are not: their jobs need no
group); a member's rank is its index. Whenever the members change, a member
registers again (a new process), or a member reports its group broken (a
collective call failed, which closes gloo's pairs),
the group is re-formed under the next generation. Agents learn the wanted
generation from their heartbeat replies, form it through the planner's store,
and report the generation they joined; the group is *up* when every member
joined the current generation.

A generation names one group formed through one store, so a number is never announced twice: the planner saves
each generation in its state before announcing it (``--state``), and a restarted planner numbers on above the
last it saved. Agents still in a group of the dead planner (its store is gone) then see a new generation and
form it, instead of reporting the old one joined and running the next job on a group whose store is closed.

Two members on one GPU (agents report their GPU's uuid) would make NCCL fail
every job ("Duplicate GPU detected"), and one group has one backend. An agent
that would break either rule is refused at registration when it asks for
``collective`` (the error names both hosts and the GPU) and registered as
``grpc`` when it asks for ``auto``, with the reason, which ``ListAgents`` shows;
so is an ``auto`` agent that found NCCL unusable itself. Every check runs before
the registry admits the agent, so a refused agent never shows as up.

A job's transport is chosen once, from the modes of its hosts and whether each registered NIXL metadata (an
agent with ``--transport nixl`` does; one with ``auto`` does not start NIXL today, so the third row waits for
agents that do), and the job records it with the reason:

============================ ===============================================
hosts' modes                 transport
============================ ===============================================
any ``nixl``                 nixl; error if a host has no NIXL (it runs
                             ``grpc``, ``collective``, or ``auto`` without)
all ``grpc``                 gRPC
all ``auto``, every one      nixl
with NIXL metadata
any ``collective``           collective; error if the group is not up with
                             every host in time, or if a host is ``grpc``
all ``auto``                 collective if the group is up with every host,
                             else gRPC
``auto`` and ``grpc``        gRPC (an ``auto`` agent registered as ``grpc``
                             says why in ``reason``)
============================ ===============================================

This module knows no torch: the store itself lives in `reshard.server.planner.rendezvous`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.server.common.contract import BACKENDS, TRANSPORT_MODES, GroupView
from reshard.server.planner.registry import Registry

__all__ = ["GroupCoordinator", "Choice"]

log = logging.getLogger(__name__)

# While a generation forms, agents heartbeat this often, so that every member learns of it (and of the next one,
# as agents register one after another) within a fraction of a second instead of a beat or two; for this long at
# most, so that a member that never joins does not keep the rest beating fast; and never more often than this many
# beats a second in all, so that a large cluster forming does not flood the planner.
FORMING_BEAT_S = 0.1
FORMING_FAST_S = 10.0
FORMING_BEATS_PER_S = 200.0
GROUP_MODES = ("collective", "auto")  # the modes whose agents are the process group's members
# Why a planner hosts no rendezvous store (`GroupCoordinator.no_store`), unless it was started without one.
NO_TORCH = "torch is not installed where it runs: pip install 'reshard[torch]'"


class Choice(NamedTuple):
    """A job's transport, why, and (collective) the group generation it runs on and its number there."""

    transport: str
    generation: int
    seq: int
    reason: str


class GroupCoordinator:
    def __init__(self, registry: Registry, store_port: int, clock: Callable[[], float] = time.monotonic,
                 no_store: str = NO_TORCH, generation: int = 0, saved: Callable[[int], None] = lambda generation: None):
        """``generation`` is the last one a planner before this one announced (from its state); ``saved(n)`` makes
        generation ``n`` durable and returns before any agent hears of it."""
        self.registry = registry
        self.store_port = store_port
        self.no_store = no_store  # why there is no rendezvous store, when store_port is 0
        self._clock = clock
        self._cond = threading.Condition()
        self._modes: dict[str, str] = {}
        self._backends: dict[str, str] = {}
        self._gpus: dict[str, str] = {}  # host -> uuid of the GPU its shards live on ("" for cpu)
        self._reasons: dict[str, str] = {}  # host -> why it runs gRPC although it asked for auto
        self._generation = generation
        self._save_generation = saved
        self._members: tuple[str, ...] = ()
        self._joined: set[str] = set()
        self._seq = 0
        self._reformed_at = 0.0

    def store_failed(self, why: str) -> None:
        """The rendezvous store did not start (``why``): from now on agents register as if there were none."""
        with self._cond:
            self.store_port, self.no_store = 0, why

    # -- membership ---------------------------------------------------------------------

    def register(self, host: str, transport: str, backend: str, gpu_uuid: str = "", reason: str = "",
                 admit: Callable[[], object] = lambda: None) -> GroupView:
        """Record how ``host`` takes part in the group; ``admit()`` (the registry's entry) runs after every check.

        ``reason`` says why an agent that asked for ``auto`` registers ``grpc``.
        """
        transport = transport or "grpc"
        backend = backend or "gloo"
        if transport not in TRANSPORT_MODES:
            raise InvalidArgumentError(f"host {host} registers transport {transport!r}; choose one of {list(TRANSPORT_MODES)}")
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"host {host} registers backend {backend!r}; choose one of {list(BACKENDS)}")
        if transport == "collective" and not self.store_port:
            raise FailedPreconditionError(
                f"host {host} asks for the collective transport, but this planner hosts no rendezvous store "
                f"({self.no_store}); run the agent with --transport grpc"
            )
        if transport == "auto" and not self.store_port:
            transport, reason = "grpc", f"this planner hosts no rendezvous store ({self.no_store})"
        with self._cond:
            self._sync_locked()
            conflict = self._conflict_locked(host, backend, gpu_uuid) if transport in GROUP_MODES else ""
            if conflict and transport == "collective":
                raise FailedPreconditionError(
                    f"{conflict}; or start host {host} with --transport auto (it then runs gRPC) or grpc")
            if conflict:
                transport, reason = "grpc", conflict
            admit()
            self._modes[host] = transport
            self._backends[host] = backend
            self._gpus[host] = gpu_uuid
            self._reasons[host] = reason if transport == "grpc" else ""
            if host in self._members:
                self._reform(f"the agent of member {host} registered again")
            self._sync_locked()
            return self._view_locked()

    def _conflict_locked(self, host: str, backend: str, gpu_uuid: str) -> str:
        """Why ``host`` cannot be a member next to the current members, or ""."""
        others = {h: self._backends[h] for h in self._members if h != host}
        if others and backend not in others.values():
            return (f"host {host} asks for backend {backend}, but the process group's members use "
                    f"{sorted(set(others.values()))}; one group has one backend: start every agent with the same "
                    f"kind of --device")
        same = [h for h in others if gpu_uuid and self._gpus.get(h) == gpu_uuid]
        if same:
            return (f"hosts {same[0]} and {host} are both on GPU {gpu_uuid}, but a process group takes one "
                    f"member per GPU (NCCL) and host {same[0]} is a member: give each agent its own GPU "
                    f"(--device cuda:N)")
        return ""

    def heartbeat(self, host: str, joined: int, broken: int) -> GroupView:
        with self._cond:
            self._sync_locked()
            if broken and broken == self._generation and host in self._members:
                self._reform(f"host {host} reported generation {broken} broken")
            elif joined and joined == self._generation and host in self._members and host not in self._joined:
                self._joined.add(host)
                if self.up_locked():
                    log.info("process group generation %d is up: %s", self._generation, list(self._members))
                self._cond.notify_all()
            return self._view_locked()

    def reform(self, why: str) -> None:
        """Start a new generation (a collective job failed: its group's pairs may be closed)."""
        with self._cond:
            if self._members:
                self._reform(why)

    def _reform(self, why: str) -> None:
        self._generation += 1
        self._save_generation(self._generation)
        self._joined = set()
        self._reformed_at = self._clock()
        log.info("process group generation %d: %s; members %s", self._generation, why, list(self._members))
        self._cond.notify_all()

    def _sync_locked(self) -> None:
        up = sorted(h for h, mode in self._modes.items() if mode in GROUP_MODES
                    and (rec := self.registry.get(h)) is not None and self.registry.is_up(rec))
        # A member that was down while another agent took its GPU stays out when it comes back.
        taken: set[str] = set()
        kept = []
        for h in sorted(up, key=lambda h: (h not in self._members, h)):
            gpu = self._gpus.get(h, "")
            if gpu not in taken:
                kept.append(h)
                taken.update([gpu] if gpu else [])
        want = tuple(sorted(kept))
        if want != self._members:
            self._members = want
            if want or self._generation:
                self._reform("members changed")

    def _view_locked(self) -> GroupView:
        backend = self._backends[self._members[0]] if self._members else "gloo"
        return GroupView(self.store_port, self._generation if self._members else 0, self._members, backend)

    def up_locked(self) -> bool:
        return bool(self._members) and self._joined >= set(self._members)

    def next_beat(self, interval_s: float) -> float:
        """When an agent should heartbeat next: ``interval_s``, or sooner while a generation forms (`FORMING_BEAT_S`,
        slowed to keep the members' beats together under `FORMING_BEATS_PER_S`)."""
        with self._cond:
            forming = (self._members and not self.up_locked()
                       and self._clock() - self._reformed_at < FORMING_FAST_S)
            fast = max(FORMING_BEAT_S, len(self._members) / FORMING_BEATS_PER_S)
        return min(interval_s, fast) if forming else interval_s

    # -- what the dashboard and the SDK read ------------------------------------------------

    def mode(self, host: str) -> str:
        with self._cond:
            return self._modes.get(host, "grpc")

    def reason(self, host: str) -> str:
        """Why ``host`` runs gRPC only although it asked for ``auto``; "" when it did not or does not."""
        with self._cond:
            return self._reasons.get(host, "")

    def in_group(self, host: str) -> bool:
        with self._cond:
            self._sync_locked()
            return host in self._members and host in self._joined

    def view(self) -> GroupView:
        with self._cond:
            self._sync_locked()
            return self._view_locked()

    # -- jobs ---------------------------------------------------------------------------------

    def has_nixl(self, host: str) -> bool:
        """Whether ``host``'s agent registered NIXL metadata (its jobs may run on nixl)."""
        rec = self.registry.get(host)
        return rec is not None and bool(rec.nixl_metadata)

    def choose(self, hosts: Iterable[str], wait_s: float) -> Choice:
        """The transport of a job over ``hosts`` and why, with its group generation and job number; see the
        module table."""
        hosts = sorted(set(hosts))
        modes = {h: self.mode(h) for h in hosts}
        nixl = sorted(h for h, m in modes.items() if m == "nixl")
        without = sorted(h for h in hosts if not self.has_nixl(h))
        if nixl and without:
            raise FailedPreconditionError(
                f"hosts {nixl} run --transport nixl but hosts {without} have no NIXL (they run --transport "
                f"{'/'.join(sorted({modes[h] for h in without}))}); a job's hosts must share a transport: start "
                f"those with --transport nixl (pip install 'reshard[nixl]'), or the others with another transport")
        if nixl:
            return Choice("nixl", 0, 0, f"hosts {nixl} run --transport nixl, and every host of the job has NIXL")
        strict = sorted(h for h, m in modes.items() if m == "collective")
        plain = sorted(h for h, m in modes.items() if m == "grpc")
        if strict and plain:
            raise FailedPreconditionError(
                f"hosts {strict} run --transport collective but hosts {plain} run --transport grpc; a job's hosts "
                f"must share a transport: restart one side with --transport auto"
            )
        if not hosts:
            return Choice("grpc", 0, 0, "the job has no host")
        if plain:
            why = [f"{h}: {self.reason(h)}" for h in plain if self.reason(h)]
            return Choice("grpc", 0, 0, f"hosts {plain} run gRPC only" + (f" ({'; '.join(why)})" if why else ""))
        if not without:
            return Choice("nixl", 0, 0, "every host of the job runs --transport auto and has NIXL")
        deadline = self._clock() + (wait_s if strict else 0.0)
        with self._cond:
            while True:
                self._sync_locked()
                if self.up_locked() and set(hosts) <= set(self._members):
                    self._seq += 1
                    return Choice("collective", self._generation, self._seq,
                                  f"the process group (generation {self._generation}) is up with every host of the "
                                  f"job" + (f", and hosts {strict} run --transport collective" if strict else ""))
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            if not strict:
                missing = sorted(set(hosts) - set(self._members)) or sorted(set(hosts) - self._joined)
                return Choice("grpc", 0, 0, f"the process group (generation {self._generation}) is not up with "
                                            f"hosts {missing}")
            missing = sorted(set(hosts) - set(self._members))
            waiting = sorted(set(self._members) - self._joined)
            raise FailedPreconditionError(
                f"hosts {strict} run --transport collective, but the process group (generation {self._generation}, "
                f"members {list(self._members)}) did not come up with hosts {hosts} within {wait_s:g}s: "
                + (f"hosts {missing} are not members (down, or registered with --transport grpc)" if missing
                   else f"hosts {waiting} have not joined")
                + "; check those agents' logs, or restart them with --transport auto to fall back to gRPC"
            )
