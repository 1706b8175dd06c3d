"""The NIXL transport's plumbing outside the transport itself: which jobs the planner runs on nixl and why, the
metadata it keeps and hands to each job's hosts, the peers an agent adds, and UCX's environment from --listen."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Sharding
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError
from reshard.server.agent.service import NixlPeers
from reshard.server.agent.ucx import interface_of, ucx_environment
from reshard.server.common.config import AgentConfig
from reshard.server.planner.catalog import Catalog, TensorRecord
from reshard.server.planner.jobs import JobRunner, Preparation
from reshard.server.planner.membership import GroupCoordinator
from reshard.server.planner.registry import MAX_NIXL_METADATA_BYTES, Registry
from reshard.server.planner.state import StateStore

from .test_jobs import DST, SHAPE, SRC, RuntimeCalls
from .test_runtime import HOSTS, Hosts


def _coordinator(store_port: int = 1234):
    registry = Registry(heartbeat_timeout_s=60.0)
    group = GroupCoordinator(registry, store_port=store_port)

    def register(host: str, transport: str, metadata: bytes = b""):
        return group.register(host, transport, "gloo", admit=lambda: registry.register(
            host, 2, f"{host}:1", 10.0, secret=bytes(16), nixl_metadata=metadata))

    return group, register, registry


# -- the planner: which transport a job runs on, and why -----------------------------------------------------


def test_a_job_whose_hosts_all_run_nixl_runs_on_nixl_and_says_why():
    group, register, _ = _coordinator()
    register("a", "nixl", b"meta-a")
    register("b", "nixl", b"meta-b")
    assert group.choose(["b", "a"], 0.0) == ("nixl", 0, 0, "hosts ['a', 'b'] run --transport nixl, and every host "
                                                           "of the job has NIXL")
    # nixl agents need no process group: they are not its members
    assert group.view().members == () and group.mode("a") == "nixl"


@pytest.mark.parametrize("other", ["grpc", "auto", "collective"])
def test_a_nixl_host_and_one_without_nixl_share_no_job_and_the_error_names_both(other):
    group, register, _ = _coordinator()
    register("a", "nixl", b"meta-a")
    register("b", other)
    with pytest.raises(FailedPreconditionError, match=(
            rf"hosts \['a'\] run --transport nixl but hosts \['b'\] have no NIXL \(they run --transport {other}\); "
            rf"a job's hosts must share a transport: start those with --transport nixl "
            rf"\(pip install 'reshard\[nixl\]'\), or the others with another transport")):
        group.choose(["a", "b"], 0.0)
    assert group.choose(["a"], 0.0).transport == "nixl"  # a job on the nixl host alone still runs


def test_auto_hosts_that_all_registered_nixl_metadata_run_nixl_and_without_it_keep_the_old_rules():
    group, register, _ = _coordinator()
    register("a", "auto", b"meta-a")
    register("b", "auto", b"meta-b")
    register("c", "auto")
    assert group.choose(["a", "b"], 0.0) == ("nixl", 0, 0, "every host of the job runs --transport auto and has "
                                                           "NIXL")
    # c has no NIXL and the group is not up: gRPC, saying so
    choice = group.choose(["a", "c"], 0.0)
    assert choice.transport == "grpc" and choice.reason.startswith("the process group (generation ")
    assert choice.reason.endswith("is not up with hosts ['a', 'c']")
    register("d", "grpc")
    assert group.choose(["a", "d"], 0.0) == ("grpc", 0, 0, "hosts ['d'] run gRPC only")


def test_the_registry_keeps_each_agents_nixl_metadata_and_refuses_what_no_agent_sends():
    _, register, registry = _coordinator()
    register("a", "nixl", b"\x00meta-a\xff")
    assert registry.get("a").nixl_metadata == b"\x00meta-a\xff"
    assert "meta" not in repr(registry.get("a"))  # bytes of no use in a log line
    with pytest.raises(InvalidArgumentError, match=rf"host b registers {MAX_NIXL_METADATA_BYTES + 1} bytes of NIXL "
                                                   rf"metadata; the planner takes at most {MAX_NIXL_METADATA_BYTES}"):
        register("b", "nixl", bytes(MAX_NIXL_METADATA_BYTES + 1))


class _PreparationsSeen(RuntimeCalls):
    """Runs the job on the hosts' in-memory runtimes, recording each host's `Preparation`."""

    def __init__(self, hosts: Hosts):
        super().__init__(hosts)
        self.preparations: dict[str, Preparation] = {}

        self.carried: set[str] = set()  # hosts whose Execute carried their Preparation

    def prepare(self, host, address, prep: Preparation, timeout):
        self.preparations[host] = prep
        super().prepare(host, address, prep, timeout)

    def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
        if prepare is not None:
            self.carried.add(host)
        return super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)


def test_a_nixl_job_hands_every_host_the_metadata_its_peers_registered_and_records_nixl():
    hosts = Hosts()
    try:
        registry = Registry(heartbeat_timeout_s=60.0)
        group = GroupCoordinator(registry, store_port=0)
        metadata = {h: f"nixl-of-{h}".encode() for h in HOSTS}
        for h in HOSTS:
            group.register(h, "nixl", "gloo", admit=lambda h=h: registry.register(
                h, 2, h, 10.0, secret=bytes(16), nixl_metadata=metadata[h]))
        catalog = Catalog()
        a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
        catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1))
        hosts.put_tensor("t", a, SRC)
        calls = _PreparationsSeen(hosts)
        runner = JobRunner(registry, catalog, StateStore(None), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                           max_concurrent=2, group=group)
        dst = Sharding(DST.mesh, (None, "y"))
        job = runner.submit("t", dst, "auto")
        assert job.done_event.wait(30) and job.state == "succeeded", job.error
        assert job.transport == "nixl" and set(job.transports) <= {"nixl", "local"} and "nixl" in job.transports
        assert job.transport_reason == f"hosts {sorted(HOSTS)} run --transport nixl, and every host of the job has NIXL"
        assert set(calls.preparations) == set(HOSTS)
        for prep in calls.preparations.values():
            assert prep.transport == "nixl" and prep.nixl_peers == metadata
        # each host prepares inside its own Execute, in no order across hosts: no Prepare round before the run (a
        # post that comes before its poster is introduced waits for it: tests/unit/test_nixl_introduction.py)
        assert calls.carried == set(HOSTS) and calls.count("prepare") == {h: 1 for h in HOSTS}
        assert job.to_json()["transport_reason"] == job.transport_reason
        assert np.array_equal(hosts.get("t", dst, SHAPE), a)
    finally:
        hosts.close()


# -- the agent: the peers it adds ----------------------------------------------------------------------------


class _PeerBook:
    """Stands in for `NixlTransport`'s peer calls: the peers it holds now, and every call in order."""

    def __init__(self):
        self.peers: dict[str, bytes] = {}
        self.calls: list[tuple[str, str]] = []

    def add_peer(self, host: str, metadata: bytes) -> None:
        self.calls.append(("add", host))
        self.peers[host] = metadata

    def drop_peer(self, host: str) -> None:
        self.calls.append(("drop", host))
        self.peers.pop(host, None)


def test_an_agent_adds_the_peers_a_prepare_names_but_itself_replaces_new_metadata_and_drops_all_on_register():
    book = _PeerBook()
    peers = NixlPeers("a", book)
    peers.introduce("job1", {"a": b"mine", "b": b"b1", "c": b"c1"})
    assert book.peers == {"b": b"b1", "c": b"c1"}
    peers.introduce("job2", {"b": b"b2"})  # b's agent restarted: its new metadata replaces the old
    assert book.peers == {"b": b"b2", "c": b"c1"}
    peers.forget_all("it registers again")
    assert book.peers == {} and book.calls[-2:] == [("drop", "b"), ("drop", "c")]
    peers.forget_all("again")  # nothing left to drop
    assert book.calls[-1] == ("drop", "c")
    with pytest.raises(InvalidArgumentError, match=r"the Prepare of job 'job3' names host 'd' as a nixl peer without "
                                                   r"its NIXL metadata"):
        peers.introduce("job3", {"d": b""})


def test_an_agent_without_nixl_refuses_a_nixl_job_naming_the_flag():
    with pytest.raises(FailedPreconditionError, match=r"job 'job1' runs on the nixl transport, but the agent of "
                                                      r"host a has none; start it with --transport nixl"):
        NixlPeers("a", None).introduce("job1", {"b": b"b1"})


def test_the_agent_takes_nixl_and_its_options_and_refuses_a_backend_that_is_no_name():
    config = AgentConfig("a", 1, "127.0.0.1:1", transport="nixl", nixl_backend="UCX", nixl_tcp_only=True)
    assert config.transport == "nixl" and config.nixl_tcp_only
    with pytest.raises(ValueError, match=r"nixl_backend 'UCX; rm' is not a NIXL backend plugin's name, such as UCX"):
        AgentConfig("a", 1, "127.0.0.1:1", transport="nixl", nixl_backend="UCX; rm")


def test_nixl_chunks_are_about_3_ms_on_the_nic_down_to_1_mib_and_the_collective_ones_down_to_2_mib():
    """A nixl chain hop learns of a chunk two WRITEs late, so its chunks may go smaller than gloo's, down to where
    each chunk's CPU starts to cost link time on shared cores (bench/paper.py, `AgentConfig.nixl_chunk`)."""
    MiB = 1 << 20
    for gbps, collective, nixl in [(1, 2, 1), (2, 2, 1), (10, 4, 4), (40, 16, 16), (400, 16, 16)]:
        config = AgentConfig("a", 1, "127.0.0.1:1", nic_gbps=gbps)
        assert (config.collective_chunk, config.nixl_chunk) == (collective * MiB, int(nixl * MiB)), gbps
    config = AgentConfig("a", 1, "127.0.0.1:1", nic_gbps=1, collective_chunk_bytes=3 * MiB)  # --collective-chunk-mib
    assert config.collective_chunk == config.nixl_chunk == 3 * MiB


# -- UCX's environment ---------------------------------------------------------------------------------------


def test_ucx_is_bound_to_the_loopback_interface_of_a_loopback_agent_and_to_tcp_only_when_asked():
    lo = interface_of("127.0.0.1")
    assert lo is not None and interface_of("127.0.0.9") == lo and interface_of("localhost") == lo
    assert ucx_environment("127.0.0.1:0", environ={}) == ({"UCX_NET_DEVICES": lo}, f"UCX_NET_DEVICES={lo}")
    env, said = ucx_environment("127.0.0.1:7000", tcp_only=True, environ={})
    assert env == {"UCX_NET_DEVICES": lo, "UCX_TLS": "tcp"} and said == f"UCX_NET_DEVICES={lo}; UCX_TLS=tcp"


def test_ucx_variables_the_operator_set_are_kept():
    env, said = ucx_environment("127.0.0.1:0", tcp_only=True, environ={"UCX_NET_DEVICES": "eth7", "UCX_TLS": "rc"})
    assert env == {} and said == "UCX_NET_DEVICES=eth7 (as set); UCX_TLS=rc (as set)"


def test_a_wildcard_listen_binds_ucx_to_the_advertised_address_or_says_it_cannot():
    lo = interface_of("127.0.0.1")
    assert ucx_environment("0.0.0.0:0", advertise="127.0.0.1:7000", environ={})[0] == {"UCX_NET_DEVICES": lo}
    env, said = ucx_environment("0.0.0.0:0", environ={})
    assert env == {}
    assert said == ("UCX may use every network interface: no interface of this machine holds the listen address "
                    "'0.0.0.0:0'; set UCX_NET_DEVICES to the one NIXL traffic should take")
    # an address no interface here holds (TEST-NET-3)
    assert ucx_environment("203.0.113.7:0", environ={})[0] == {}


def test_a_prepare_ticket_signs_the_nixl_peers_it_introduces():
    """UCX authenticates nobody: an agent adds only the NIXL peers the planner signed for the job, so a Prepare
    whose metadata was swapped or extended in flight is refused."""
    from reshard.proto.errors import PermissionDeniedError
    from reshard.server.common.tickets import TicketCheck, new_secret, prepare_fields, sign

    secret = new_secret()
    peers = {"host0": b"meta-0", "host1": b"meta-1"}
    args = ("job", "sha", "w", 1, 2, "nixl", 0, 0, {"host0": "a0", "host1": "a1"}, None)
    ticket = sign(secret, "prepare", *prepare_fields(*args, peers))
    check = TicketCheck("host1", secret)
    check.check(ticket, "prepare", *prepare_fields(*args, dict(peers)), what="Prepare")
    for forged in ({**peers, "host1": b"attacker"}, {**peers, "evil": b"meta"}, {"host0": b"meta-0"}):
        with pytest.raises(PermissionDeniedError):
            check.check(ticket, "prepare", *prepare_fields(*args, forged), what="Prepare")
