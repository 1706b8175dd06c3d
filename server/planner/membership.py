"""The planner's view of the agents' process group: members, generations, and each job's transport.

Agents that registered with ``--transport collective`` or ``auto`` (and have
torch) are the members, in host order; a member's rank is its index. Whenever
the members change, a member registers again (a new process), or a member
reports its group broken (a collective call failed, which closes gloo's pairs),
the group is re-formed under the next generation. Agents learn the wanted
generation from their heartbeat replies, form it through the planner's store,
and report the generation they joined; the group is *up* when every member
joined the current generation.

A job's transport is chosen once, from the modes of its hosts:

============================ ===============================================
hosts' modes                 transport
============================ ===============================================
all ``grpc``                 gRPC
any ``collective``           collective; error if the group is not up with
                             every host in time, or if a host is ``grpc``
all ``auto`` (or with grpc)  collective if the group is up with every host,
                             else gRPC
============================ ===============================================

This module knows no torch: the store itself lives in `reshard.server.planner.rendezvous`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.server.common.contract import BACKENDS, TRANSPORT_MODES, GroupView
from reshard.server.planner.registry import Registry

__all__ = ["GroupCoordinator"]

log = logging.getLogger(__name__)

class GroupCoordinator:
    def __init__(self, registry: Registry, store_port: int, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.store_port = store_port
        self._clock = clock
        self._cond = threading.Condition()
        self._modes: dict[str, str] = {}
        self._backends: dict[str, str] = {}
        self._generation = 0
        self._members: tuple[str, ...] = ()
        self._joined: set[str] = set()
        self._seq = 0

    # -- membership ---------------------------------------------------------------------

    def register(self, host: str, transport: str, backend: str) -> GroupView:
        transport = transport or "grpc"
        backend = backend or "gloo"
        if transport not in TRANSPORT_MODES:
            raise InvalidArgumentError(f"host {host} registers transport {transport!r}; choose one of {list(TRANSPORT_MODES)}")
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"host {host} registers backend {backend!r}; choose one of {list(BACKENDS)}")
        if transport == "collective" and not self.store_port:
            raise FailedPreconditionError(
                f"host {host} asks for the collective transport, but this planner hosts no rendezvous store "
                f"(torch is not installed where it runs: pip install reshard[torch]); run the agent with --transport grpc"
            )
        if transport == "auto" and not self.store_port:
            transport = "grpc"  # no rendezvous here: auto means gRPC
        with self._cond:
            others = {self._backends[h] for h in self._members if h != host}
            if transport != "grpc" and others and backend not in others:
                raise FailedPreconditionError(
                    f"host {host} asks for backend {backend}, but the process group's members use {sorted(others)}; "
                    f"one group has one backend: start every agent with the same --device"
                )
            self._modes[host] = transport
            self._backends[host] = backend
            if host in self._members:
                self._reform(f"the agent of member {host} registered again")
            self._sync_locked()
            return self._view_locked()

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
        self._joined = set()
        log.info("process group generation %d: %s; members %s", self._generation, why, list(self._members))
        self._cond.notify_all()

    def _sync_locked(self) -> None:
        want = tuple(sorted(h for h, mode in self._modes.items() if mode != "grpc"
                            and (rec := self.registry.get(h)) is not None and self.registry.is_up(rec)))
        if want != self._members:
            self._members = want
            if want or self._generation:
                self._reform("members changed")

    def _view_locked(self) -> GroupView:
        backend = self._backends[self._members[0]] if self._members else "gloo"
        return GroupView(self.store_port, self._generation if self._members else 0, self._members, backend)

    def up_locked(self) -> bool:
        return bool(self._members) and self._joined >= set(self._members)

    # -- what the dashboard and the SDK read ------------------------------------------------

    def mode(self, host: str) -> str:
        with self._cond:
            return self._modes.get(host, "grpc")

    def in_group(self, host: str) -> bool:
        with self._cond:
            self._sync_locked()
            return host in self._members and host in self._joined

    def view(self) -> GroupView:
        with self._cond:
            self._sync_locked()
            return self._view_locked()

    # -- jobs ---------------------------------------------------------------------------------

    def choose(self, hosts: Iterable[str], wait_s: float) -> tuple[str, int, int]:
        """(transport, generation, job number) for a job over ``hosts``; see the module table."""
        hosts = sorted(set(hosts))
        modes = {h: self.mode(h) for h in hosts}
        strict = sorted(h for h, m in modes.items() if m == "collective")
        plain = sorted(h for h, m in modes.items() if m == "grpc")
        if strict and plain:
            raise FailedPreconditionError(
                f"hosts {strict} run --transport collective but hosts {plain} run --transport grpc; a job's hosts "
                f"must share a transport: restart one side with --transport auto"
            )
        if plain or not hosts:
            return "grpc", 0, 0
        deadline = self._clock() + (wait_s if strict else 0.0)
        with self._cond:
            while True:
                self._sync_locked()
                if self.up_locked() and set(hosts) <= set(self._members):
                    self._seq += 1
                    return "collective", self._generation, self._seq
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            if not strict:
                return "grpc", 0, 0
            missing = sorted(set(hosts) - set(self._members))
            waiting = sorted(set(self._members) - self._joined)
            raise FailedPreconditionError(
                f"hosts {strict} run --transport collective, but the process group (generation {self._generation}, "
                f"members {list(self._members)}) did not come up with hosts {hosts} within {wait_s:g}s: "
                + (f"hosts {missing} are not members (down, or registered with --transport grpc)" if missing
                   else f"hosts {waiting} have not joined")
                + "; check those agents' logs, or restart them with --transport auto to fall back to gRPC"
            )
