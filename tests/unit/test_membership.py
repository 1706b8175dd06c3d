"""The planner's process-group coordinator: agents heartbeat fast while a generation forms, and only then; without
a rendezvous store, agents that want a group are told why they cannot have one."""

from __future__ import annotations

import pytest

from reshard.proto.errors import FailedPreconditionError
from reshard.server.planner.membership import FORMING_BEAT_S, FORMING_BEATS_PER_S, FORMING_FAST_S, GroupCoordinator
from reshard.server.planner.registry import Registry

INTERVAL_S = 1.0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _coordinator(store_port: int = 1234, **kw):
    clock = _Clock()
    registry = Registry(heartbeat_timeout_s=5.0, clock=clock)
    group = GroupCoordinator(registry, store_port=store_port, clock=clock, **kw)

    def register(host: str, transport: str = "collective", backend: str = "gloo", gpu_uuid: str = ""):
        def admit():
            register.admitted.append(host)
            registry.register(host, 1, f"{host}:1", 10.0, secret=bytes(16))

        return group.register(host, transport, backend, gpu_uuid, admit=admit)

    register.admitted = []  # the hosts the registry admitted, in order
    return group, register, clock


def test_agents_beat_fast_while_a_generation_forms_and_at_their_interval_once_it_is_up():
    group, register, _ = _coordinator()
    assert group.next_beat(INTERVAL_S) == INTERVAL_S  # no group at all
    register("a")
    register("b")
    gen = group.view().generation
    assert group.next_beat(INTERVAL_S) == FORMING_BEAT_S
    group.heartbeat("a", gen, 0)
    assert group.next_beat(INTERVAL_S) == FORMING_BEAT_S  # b has not joined yet
    group.heartbeat("b", gen, 0)
    assert group.next_beat(INTERVAL_S) == INTERVAL_S
    # a member reports the generation broken: the next one forms, fast again
    group.heartbeat("a", 0, gen)
    assert group.view().generation == gen + 1 and group.next_beat(INTERVAL_S) == FORMING_BEAT_S
    # a configured interval shorter than the fast beat is kept
    assert group.next_beat(FORMING_BEAT_S / 2) == FORMING_BEAT_S / 2


def test_a_generation_that_never_forms_stops_the_fast_beat_after_a_while():
    group, register, clock = _coordinator()
    register("a")
    register("b")
    clock.now += FORMING_FAST_S - 0.5
    assert group.next_beat(INTERVAL_S) == FORMING_BEAT_S
    clock.now += 1.0
    assert group.next_beat(INTERVAL_S) == INTERVAL_S


def test_grpc_only_agents_beat_at_their_interval():
    group, register, _ = _coordinator()
    register("a", "grpc")
    register("b", "grpc")
    assert group.next_beat(INTERVAL_S) == INTERVAL_S


def test_a_large_group_forming_beats_no_faster_in_all_than_the_planner_takes():
    group, register, _ = _coordinator()
    hosts = [f"h{i}" for i in range(100)]
    for h in hosts:
        register(h)
    beat = group.next_beat(INTERVAL_S)
    assert beat == len(hosts) / FORMING_BEATS_PER_S > FORMING_BEAT_S  # 100 members: 200 beats a second in all
    for h in hosts + [f"g{i}" for i in range(400)]:
        register(h)
    assert group.next_beat(INTERVAL_S) == INTERVAL_S  # 500 members: their usual interval is slower already


def test_without_a_store_auto_agents_run_grpc_and_collective_ones_are_refused_both_told_why():
    group, register, _ = _coordinator(store_port=0, no_store="it runs with --no-rendezvous")
    register("a", "auto")
    assert group.mode("a") == "grpc"
    assert group.reason("a") == "this planner hosts no rendezvous store (it runs with --no-rendezvous)"
    with pytest.raises(FailedPreconditionError, match=r"host b asks for the collective transport, but this planner "
                                                      r"hosts no rendezvous store \(it runs with --no-rendezvous\); "
                                                      r"run the agent with --transport grpc"):
        register("b", "collective")
    assert group.next_beat(INTERVAL_S) == INTERVAL_S


def test_a_report_on_the_planners_own_call_keeps_a_host_up_as_a_heartbeat_does_but_not_from_another_address():
    # An agent whose cores a job keeps busy misses its heartbeat calls' deadline while its Execute stream reports
    # (progress, or that it still loads the job): the host stays up, so the process group is not re-formed under
    # the job (`Registry.alive`)
    clock = _Clock()
    registry = Registry(heartbeat_timeout_s=5.0, clock=clock)
    registry.register("h0", 1, "h0:1", 10.0, secret=bytes(16))
    clock.now = 4.0
    registry.alive("h0", "h0:1")
    clock.now = 8.0  # 8 s after its last heartbeat, 4 s after the report
    assert registry.is_up(registry.get("h0"))
    registry.alive("h0", "elsewhere:1")  # not the registered agent's address: nothing
    registry.alive("nobody", "h0:1")
    clock.now = 9.5
    assert not registry.is_up(registry.get("h0")) and registry.get("nobody") is None


def test_a_second_agent_on_a_members_gpu_is_refused_or_runs_grpc_and_a_host_that_registers_again_keeps_its_gpu():
    """NCCL takes one rank per GPU: a collective agent on a GPU a member holds is refused before the registry admits
    it, naming both hosts and the way out; an auto one runs gRPC, told why. (End to end, an agent refused at
    registration exits 2: tests/integration/test_no_rendezvous.py; this rule on real agents: test_devices.py's slow
    pass.)"""
    group, nccl_register, _ = _coordinator()
    admitted = nccl_register.admitted

    def register(host, transport, gpu):
        return nccl_register(host, transport, "nccl", gpu)

    register("g0", "collective", "GPU-1")
    with pytest.raises(FailedPreconditionError, match=r"hosts g0 and g1 are both on GPU GPU-1, but a process group "
                                                      r"takes one member per GPU \(NCCL\) and host g0 is a member: "
                                                      r"give each agent its own GPU \(--device cuda:N\); or start "
                                                      r"host g1 with --transport auto \(it then runs gRPC\) or grpc"):
        register("g1", "collective", "GPU-1")
    assert admitted == ["g0"] and group.mode("g0") == "collective"
    register("g2", "auto", "GPU-1")
    assert group.mode("g2") == "grpc" and "hosts g0 and g2 are both on GPU GPU-1" in group.reason("g2")
    register("g3", "collective", "GPU-2")  # a GPU of its own
    register("g0", "collective", "GPU-1")  # its own GPU again: no conflict with itself
    assert admitted == ["g0", "g2", "g3", "g0"] and group.mode("g3") == group.mode("g0") == "collective"


def test_the_topology_names_the_machine_of_hosts_whose_agents_share_an_address():
    # Agents at one address (every loopback address one machine) move bytes between them through its memory: the
    # cost model's planner keeps chains there (`Topology.apart`); a host alone at its address is not named.
    registry = Registry(heartbeat_timeout_s=5.0, clock=_Clock())
    for host, address in (("a", "127.0.0.1:7001"), ("b", "127.0.0.2:7002"), ("c", "[::1]:7003"),
                          ("d", "10.0.0.5:7001"), ("e", "10.0.0.5:7002"), ("f", "10.0.0.6:7001")):
        registry.register(host, 1, address, 1.0, secret=bytes(16))
    topology = registry.topology()
    assert dict(topology.host_machine) == {"a": "loopback", "b": "loopback", "c": "loopback", "d": "10.0.0.5",
                                           "e": "10.0.0.5"}
    assert not topology.apart("a", ["c"]) and not topology.apart("d", ["e", "f"]) and topology.apart("f", ["a", "d"])


def test_the_topology_is_worked_out_again_only_after_a_registration():
    # a job asks for it twice before its hosts start: kept per registry generation, and a new agent, address or
    # NIC rate is in the next one asked for
    registry = Registry(heartbeat_timeout_s=5.0, clock=_Clock())
    registry.register("a", 1, "127.0.0.1:7001", 1.0, secret=bytes(16))
    first = registry.topology()
    registry.alive("a", "127.0.0.1:7001")  # a report from the agent changes nothing the topology reads
    assert registry.topology() is first
    registry.register("a", 1, "10.0.0.5:7001", 25.0, secret=bytes(16))  # the same agent, moved
    registry.register("b", 1, "10.0.0.5:7002", 1.0, secret=bytes(16))
    second = registry.topology()
    assert second is not first and registry.topology() is second
    assert dict(second.host_nic_gbps) == {"a": 25.0, "b": 1.0}
    assert dict(second.host_machine) == {"a": "10.0.0.5", "b": "10.0.0.5"}
