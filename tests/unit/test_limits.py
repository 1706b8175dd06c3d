"""Bounded resources and lost shards, unit by unit: the agent's store against its memory limit, and the
planner's refusals (memory, plan size, lost tiles) over a fake `AgentCalls` that records every call."""

from __future__ import annotations

import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.proto.errors import AlreadyExistsError, DataLossError, FailedPreconditionError, ResourceExhaustedError
from reshard.server.agent.store import _ENDED_KEPT, ShardStore
from reshard.server.common.config import PlannerConfig
from reshard.server.common.sizes import format_size, parse_size
from reshard.server.planner.catalog import TensorRecord
from reshard.server.planner.control import Planner

MiB = 2**20


def _tile(store: ShardStore, nbytes: int):
    return store.adopt(np.zeros(nbytes, np.uint8), ((0, nbytes),), "uint8")


def test_the_store_refuses_before_allocating_and_names_the_sizes():
    store = ShardStore(limit_bytes=4 * MiB, host="h0")
    store.reserve("up1", {"h0/0": 3 * MiB}, "PutShard of 'a'")
    store.stage("up1", "h0/0", _tile(store, 3 * MiB))  # staging turns the reservation into staged bytes
    assert store.used_bytes() == 3 * MiB
    with pytest.raises(ResourceExhaustedError) as refused:
        store.reserve("up2", {"h0/1": 2 * MiB}, "PutShard of 'b' for device h0/1")
    assert str(refused.value) == (
        "PutShard of 'b' for device h0/1 needs 2.0 MiB (2,097,152 bytes), but the agent of host h0 holds 3.0 MiB "
        "(3,145,728 bytes) of its memory limit of 4.0 MiB (4,194,304 bytes): 1.0 MiB (1,048,576 bytes) are free; "
        "free memory (delete tensors) or start the agent with a larger --memory-limit")
    assert store.used_bytes() == 3 * MiB and store.staged("up2", "h0/1") is None
    with pytest.raises(ResourceExhaustedError, match=r"needs 5\.0 MiB .* more than the whole limit"):
        store.reserve("up2", {"h0/1": 5 * MiB}, "x")
    # A second PutShard for the same device replaces the staged buffer, so only the difference counts.
    store.reserve("up1", {"h0/0": 4 * MiB}, "retry")
    store.commit("up1", "a", 1, ["h0/0"])
    assert store.used_bytes() == 3 * MiB  # the retry's reservation ended with the commit
    store.release("a", 1)
    assert store.used_bytes() == 0


def test_the_store_counts_what_it_holds_as_versions_come_and_go():
    store = ShardStore(host="h0")
    for name, version, devices in (("a", 1, ["h0/0", "h0/1"]), ("a", 2, ["h0/0"]), ("b", 1, ["h0/1"])):
        owner = f"{name}{version}"
        for d in devices:
            store.stage(owner, d, _tile(store, MiB))
        store.commit(owner, name, version, devices)
    assert store.held() == [("a", 1), ("a", 2), ("b", 1)] and store.nbytes() == store.used_bytes() == 4 * MiB
    store.stage("again", "h0/0", _tile(store, 2 * MiB))  # a committed version is never written over (a replay)
    with pytest.raises(AlreadyExistsError, match=r"cannot commit 'a' v2 for devices \['h0/0'\]: host h0 holds that "
                                                 r"version already, .* transaction again is dropped"):
        store.commit("again", "a", 2, ["h0/0"])
    assert store.nbytes() == store.used_bytes() == 4 * MiB and store.get("a", 2, "h0/0").nbytes == MiB
    assert store.ended("again") and store.staged("again", "h0/0") is None
    assert store.release("a", 1) == 2 and store.release("a", 1) == 0  # every device's shard, once
    assert store.held() == [("a", 2), ("b", 1)] and store.nbytes() == 2 * MiB
    assert store.find("a", 1, "h0/0") is None and store.find("b", 1, "h0/1") is not None
    store.release("a", 2)
    store.release("b", 1)
    assert store.held() == [] and store.nbytes() == store.used_bytes() == 0


def test_a_job_s_tensors_commit_on_an_agent_all_or_none_and_release_together():
    """`commit_many` (an agent's part of a reshard_many's commit) checks every tensor's staged tiles before it
    makes any visible; `release_many` drops a state dict's old versions in one call."""
    store = ShardStore(host="h0")
    for name in ("w", "b"):
        store.stage(f"job/{name}", "h0/0", _tile(store, MiB))
    with pytest.raises(FailedPreconditionError, match=r"cannot commit 'b' v2: transaction job/b holds no shard for "
                                                      r"devices \['h0/1'\]"):
        store.commit_many([("job/w", "w", 2, ["h0/0"]), ("job/b", "b", 2, ["h0/0", "h0/1"])])
    assert store.held() == [] and store.used_bytes() == 2 * MiB  # nothing visible, both still staged
    store.commit_many([("job/w", "w", 2, ["h0/0"]), ("job/b", "b", 2, ["h0/0"])])
    assert store.held() == [("b", 2), ("w", 2)] and store.nbytes() == store.used_bytes() == 2 * MiB
    assert store.ended("job/w") and store.ended("job/b")
    assert store.release_many([("w", 2), ("b", 2), ("w", 1)]) == 2  # a version it never held counts none
    assert store.held() == [] and store.used_bytes() == 0


def test_a_commit_of_many_owners_keeps_the_store_s_books_as_one_commit_each_would():
    """`commit_many` of a state dict takes each owner in a few steps (a 501-tensor commit: 3.3 -> 1.8 ms): the same
    held versions, bytes, committers and ended owners as commits one by one, the newest `_ENDED_KEPT` remembered; an
    entry of no devices ends its owner and holds nothing; a version committed in the same call is refused."""
    many, single = ShardStore(host="h0"), ShardStore(host="h0")
    entries = [(f"job/t{i}", f"t{i}", 2, ["h0/0", "h0/1"] if i % 2 else ["h0/0"]) for i in range(_ENDED_KEPT + 3)]
    for store in (many, single):
        for owner, _, _, devices in entries:
            for d in devices:
                store.stage(owner, d, _tile(store, 64))
        store.stage("job/extra", "h0/1", _tile(store, 64))  # staged, committed for no device: dropped with its end
    many.commit_many([*entries, ("job/extra", "x", 2, [])], by="job")
    for entry in [*entries, ("job/extra", "x", 2, [])]:
        single.commit_many([entry], by="job")
    assert many.held() == single.held() and len(many.held()) == len(entries)
    assert many.nbytes() == single.nbytes() == 64 * (len(entries) + len(entries) // 2) == many.used_bytes()
    def books(store: ShardStore) -> tuple:
        return (list(store._committed), store._devices, store._committer, list(store._staged), store._staged_bytes,
                store._committed_bytes, list(store._ended))  # the ended owners in their order too

    assert books(many) == books(single)
    assert many.ended("job/extra") and many.ended(entries[-1][0]) and not many.ended(entries[0][0])
    many.stage("job2/a", "h0/0", _tile(many, 64))
    many.stage("job2/b", "h0/0", _tile(many, 64))
    with pytest.raises(AlreadyExistsError, match=r"cannot commit 'a' v1 for devices \['h0/0'\]: host h0 holds that "
                                                 r"version already"):
        many.commit_many([("job2/a", "a", 1, ["h0/0"]), ("job2/b", "a", 1, ["h0/0"])])
    assert many.ended("job2/b") and not many.ended("job2/a") and many.find("a", 1, "h0/0") is None


def test_one_stream_per_device_and_nothing_staged_for_an_ended_transaction():
    """Concurrent streams of one upload's device each reserved its own bytes under one key, so together they went
    over the limit; a ticket replayed after its upload ended, or a stream its abort overtook, staged an orphan."""
    store = ShardStore(limit_bytes=8 * MiB, host="h0")
    with store.reserving("up1", "h0/0", 6 * MiB, "PutShard of 'a'"):
        with pytest.raises(FailedPreconditionError, match=r"already being staged on host h0; one stream per device"):
            store.reserve("up1", {"h0/0": 6 * MiB}, "PutShard of 'a'")
        assert store.used_bytes() == 6 * MiB
        store.stage("up1", "h0/0", _tile(store, 6 * MiB))
    store.commit("up1", "a", 1, ["h0/0"])
    for late in (lambda: store.reserve("up1", {"h0/0": MiB}, "PutShard of 'a'"),
                 lambda: store.stage("up1", "h0/0", _tile(store, MiB))):
        with pytest.raises(FailedPreconditionError, match=r"transaction up1 has already ended"):
            late()
    store.abort("up2")  # an abort that overtook its upload's stream
    with pytest.raises(FailedPreconditionError, match=r"transaction up2 has already ended"):
        store.stage("up2", "h0/0", _tile(store, MiB))
    assert store.used_bytes() == 6 * MiB and store.ended("up1") and store.ended("up2") and not store.ended("up3")


def test_a_failed_put_and_an_aborted_job_free_their_reservations():
    store = ShardStore(limit_bytes=4 * MiB, host="h0")
    with pytest.raises(ValueError, match="stream cut"):
        with store.reserving("up", "h0/0", 4 * MiB, "PutShard"):
            assert store.used_bytes() == 4 * MiB
            raise ValueError("stream cut")
    assert store.used_bytes() == 0
    store.reserve("job", {"h0/0": MiB, "h0/1": MiB}, "job's destination tiles")
    store.stage("job", "h0/0", _tile(store, MiB))
    assert store.used_bytes() == 2 * MiB
    store.abort("job")
    assert store.used_bytes() == 0
    ShardStore().reserve("any", {"d": 2**80}, "no limit")  # 0: unlimited (unit tests' stores)


def test_tiles_staged_into_room_held_together_count_once():
    """A job's tiles of several tensors hold their room under one reservation and are staged a few at a time (a nixl
    receiver's, `Run.stage_for`): each staged buffer takes its bytes out of that reservation, so the store counts
    every tile once all along, and refuses a stranger only what is truly taken."""
    store = ShardStore(limit_bytes=4 * MiB, host="h0")
    store.reserve("job/", {"h0/0": 2 * MiB, "h0/1": MiB}, "job's destination tiles of 3 tensors")
    store.stage_many([("job/a", "h0/0", _tile(store, MiB))], reserved_by="job/")
    assert store.used_bytes() == 3 * MiB
    store.stage_many([("job/b", "h0/0", _tile(store, MiB)), ("job/b", "h0/1", _tile(store, MiB // 2))],
                     reserved_by="job/")
    assert store.used_bytes() == 3 * MiB  # the room of the rest of h0/1's tile is still held
    with pytest.raises(ResourceExhaustedError):
        store.reserve("up", {"h0/2": MiB + 1}, "PutShard")
    store.abort("job/")  # the last tile is not coming (the job failed): its room is free
    assert store.used_bytes() == 2 * MiB + MiB // 2
    store.reserve("up", {"h0/2": MiB + MiB // 2}, "PutShard")


def test_the_staged_total_follows_thousands_of_uploads_as_they_commit_and_abort():
    """A put_many stages thousands of shards on one agent; each reservation checks the limit against a running total
    (recounting every staged shard per reservation made such a put quadratic)."""
    store = ShardStore(limit_bytes=3000 * 100, host="h0")
    for i in range(3000):
        with store.reserving(f"u{i}", "h0/0", 100, "PutShard"):
            store.stage(f"u{i}", "h0/0", _tile(store, 100))
    assert store.used_bytes() == 3000 * 100
    with pytest.raises(ResourceExhaustedError, match="are free|whole limit"):
        store.reserve("one-more", {"h0/0": 1}, "PutShard")
    store.reserve("u0", {"h0/0": 50}, "a retry replaces its staged buffer")
    assert store.used_bytes() == 2999 * 100 + 50
    for i in range(1000):
        store.commit(f"u{i}", f"t{i}", 1, ["h0/0"])
    for i in range(1000, 2000):
        store.abort(f"u{i}")
    assert store.used_bytes() == store.nbytes() + 1000 * 100 == 2000 * 100


@pytest.mark.parametrize("text, nbytes", [("1048576", MiB), ("512MiB", 512 * MiB), ("4GiB", 4 << 30),
                                          ("4Gi", 4 << 30), ("4G", 4 * 10**9), ("1.5KiB", 1536), ("64mb", 64 * 10**6)])
def test_sizes_read_as_people_write_them(text, nbytes):
    assert parse_size(text) == nbytes


def test_sizes_print_in_binary_units_and_bad_ones_name_the_forms():
    assert [format_size(n) for n in (0, 17, 1536, 4 << 30, 2**82)] == ["0 B", "17 B", "1.5 KiB", "4.0 GiB",
                                                                        "4194304.0 EiB"]
    with pytest.raises(ValueError, match=r"size '4XB' is not a byte count like 1048576, 512MiB, 4GiB or 4G"):
        parse_size("4XB")


class RecordingCalls:
    """`AgentCalls` that only record: the refusals under test come before any agent is called."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name):
        return lambda host, *args, **kw: self.calls.append((name, host))


HOSTS = ["h0", "h1"]


def _planner(tmp_path, heartbeat_timeout_s: float) -> Planner:
    p = Planner(PlannerConfig(heartbeat_timeout_s=heartbeat_timeout_s, max_plan_tasks=1000,
                              state_path=str(tmp_path / "state.db")), RecordingCalls())
    for h in HOSTS:
        p.register(h, 2, f"{h}:1", 10.0, secret=f"{h}-first-secret-0123".encode(), memory_limit_bytes=64 * MiB)
    return p


@pytest.fixture()
def planner(tmp_path):
    """Agents down 0.05 s after they registered (no heartbeats come here): a test sleeps past it to restart one."""
    p = _planner(tmp_path, 0.05)
    yield p
    p.close()


@pytest.fixture()
def planner_up(tmp_path):
    """Agents up for the whole test: one that plans for long on a loaded machine must not find them down first."""
    p = _planner(tmp_path, 60.0)
    yield p
    p.close()


def _json(sharding: Sharding) -> str:
    import json

    return json.dumps(sharding.to_json())


MESH = Mesh.from_hosts({"x": 4}, HOSTS, 2)


def test_the_planner_refuses_tiles_over_an_agents_limit_before_calling_it(planner):
    huge = Sharding(MESH, ("x", None))
    with pytest.raises(ResourceExhaustedError) as refused:
        planner.begin_upload("huge", (2**40, 2**40), "float32", _json(huge), "numpy")
    assert str(refused.value) == (
        "tensor 'huge' of shape (1099511627776, 1099511627776) float32 on P('x', None) on (x=4) would give host h0's "
        "device h0/1 a tile of 1048576.0 EiB (1,208,925,819,614,629,174,706,176 bytes), more than its agent's memory "
        "limit of 64.0 MiB (67,108,864 bytes); shard it over more devices or hosts, or start that agent with a larger "
        "--memory-limit")
    with pytest.raises(ResourceExhaustedError, match=r"host h0's 2 devices 80\.0 MiB \(83,886,080 bytes\) together"):
        planner.begin_upload("wide", (4 * 10 * MiB,), "float32", _json(Sharding(MESH, ("x",))), "numpy")
    assert planner.agents.calls == [] and planner.tensors() == []


def test_the_planner_refuses_a_plan_over_its_size_limit_naming_count_limit_and_flag(planner):
    big = Mesh.from_hosts({"x": 4096}, [f"n{i}" for i in range(512)], 8)
    with pytest.raises(ResourceExhaustedError) as refused:
        planner.dry_plan("", (4096 * 4, 64), "float32", _json(Sharding(big, ("x", None))),
                         _json(Sharding(big, (None, None))), "auto")
    assert str(refused.value) == (
        "planning a tensor of shape (16384, 64) from P('x', None) on (x=4096) to P(None, None) on (x=4096) would make "
        "too large a plan: 4,096 unit tasks where the limit is 1,000; 16,777,216 deliveries where the limit is 1,000; "
        "16,777,216 route steps where the limit is 256,000 (reshard planner --max-plan-tasks 1,000 bounds unit "
        "tasks and deliveries, and route steps at 256 times that); reshard over fewer devices, in steps (within hosts "
        "first), or raise the limit")
    # 32 tiles, each on 2 of 64 hosts, to all of 16 others: few tasks and deliveries, but auto weighs a chain over
    # 16 hosts, a search that grows with their cube, from each of 2 senders for each task (past 16 hosts, chains
    # are routed in linear time: see reshard.plan_size.route_search).
    wide = Mesh.from_hosts({"r": 2, "x": 32}, [f"a{i}" for i in range(64)], 1)
    sixteen = Mesh.from_hosts({"y": 16}, [f"b{i}" for i in range(16)], 1)
    gather = (_json(Sharding(wide, ("x",))), _json(Sharding(sixteen, (None,))))
    with pytest.raises(ResourceExhaustedError, match=r"too large a plan: 262,144 route steps where the limit is "
                                                     r"256,000 .*; use strategy broadcast or send_recv"):
        planner.dry_plan("", (32,), "float32", *gather, "auto")
    assert planner.dry_plan("", (32,), "float32", *gather, "broadcast").strategy == "broadcast"
    small = Sharding(MESH, ("x", None))
    assert planner.dry_plan("", (8, 8), "float32", _json(small), _json(Sharding(MESH, (None, "x"))), "auto")


def test_a_reshard_many_over_the_size_limit_is_refused_whole_naming_counts_limit_and_flag(planner_up):
    """70 tensors of 16 unit tasks each, each of its own layout: each alone is within --max-plan-tasks 1,000,
    together they are not. 70 of one layout are planned once (`plan_many`): 16."""
    src, dst = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))
    names = [f"t{i}" for i in range(70)]
    for i, name in enumerate(names):
        planner_up.catalog.add(TensorRecord(name, (8, 8 + 4 * i), "float32", src, 1))
    with pytest.raises(ResourceExhaustedError) as refused:
        planner_up.reshard_many([(name, _json(dst)) for name in names], "auto", None, [])
    assert str(refused.value) == (
        "reshard_many of 70 tensors would make too large a program: 1,120 unit tasks where the limit is 1,000; "
        "1,120 deliveries where the limit is 1,000 (reshard planner --max-plan-tasks 1,000, summed over the "
        "distinct layouts); move the tensors in several reshard_many jobs, or raise the limit")
    assert all(planner_up.catalog.get(name).version == 1 for name in names)
    alike = [f"u{i}" for i in range(70)]
    for name in alike:
        planner_up.catalog.add(TensorRecord(name, (8, 8), "float32", src, 1))
    job = planner_up.reshard_many([(name, _json(dst)) for name in alike], "auto", None, [])
    assert job.kind == "reshard_many"  # taken as one job


def test_a_restarted_host_marks_its_shards_lost(planner):
    shape = (8, 4)
    one_copy = TensorRecord("one_copy", shape, "float32", Sharding(MESH, ("x", None)), 1)
    two_copies = TensorRecord("two_copies", shape, "float32", Sharding(Mesh.from_hosts({"r": 2, "x": 2}, HOSTS, 2),
                                                                         (None, "x")), 1)
    for rec in (one_copy, two_copies):
        planner.catalog.add(rec)
    time.sleep(0.1)  # h1's agent is marked down; a new process registers the name with a new secret
    planner.register("h1", 2, "h1:2", 10.0, secret=b"h1-second-secret-0123")

    rec, locations = planner.tensor("one_copy")
    assert rec.lost == {"h1/0", "h1/1"} and [t.lost for t in locations] == [False, False, True, True]
    assert rec.lost_tiles() == {((4, 6), (0, 4)): ["h1/0"], ((6, 8), (0, 4)): ["h1/1"]}
    with pytest.raises(DataLossError, match=r"cannot reshard 'one_copy' v1: 2 of its tiles lost every copy when the "
                                            r"agents of hosts \['h1'\] restarted \(tile \[4:6, 0:4\] held by "
                                            r"\['h1/0'\]; tile \[6:8, 0:4\] held by \['h1/1'\]\)"):
        planner.reshard("one_copy", _json(Sharding(MESH, (None, "x"))), "auto")

    rec, _ = planner.tensor("two_copies")  # each tile is also held on h0
    assert rec.lost == {"h1/0", "h1/1"} and rec.lost_tiles() == {}
    with pytest.raises(FailedPreconditionError, match=r"every tile still has a copy, so get\(\) reads it"):
        planner.reshard("two_copies", _json(Sharding(MESH, (None, "x"))), "auto")
    assert [d["lost"] for d in planner.store.tensors()] == [["h1/0", "h1/1"]] * 2  # persisted

    planner.delete("one_copy")
    assert [r.name for r in planner.tensors()] == ["two_copies"]


def test_a_repeated_compute_request_reuses_its_program_and_another_layout_plans_anew(planner):
    from reshard.server.planner.catalog import TensorRecord

    spread, whole = Sharding(MESH, ("x", None)), Sharding(MESH, (None, None))
    planner.catalog.add(TensorRecord("a", (8, 4), "float32", spread, 1))
    planner.catalog.add(TensorRecord("b", (8, 4), "float32", spread, 1))
    first, _ = planner.plan_compute("add", ["a", "b"], "c", "", "auto", {})
    again, _ = planner.plan_compute("add", ["a", "b"], "c", "", "auto", {})
    assert again is first  # planned once
    assert planner.plan_compute("sub", ["a", "b"], "c", "", "auto", {})[0] is not first  # another op
    assert planner.plan_compute("add", ["b", "a"], "c", "", "auto", {})[0] is not first  # other inputs
    planner.catalog.add(TensorRecord("w", (4, 4), "float32", whole, 1))
    mm = planner.plan_compute("einsum", ["a", "w"], "y", "", "auto", {"equation": "ij,jk->ik"})[0]
    other = planner.plan_compute("einsum", ["a", "w"], "y", "", "auto", {"equation": "ij,kj->ik"})[0]
    assert other is not mm and planner.plan_compute("einsum", ["a", "w"], "y", "", "auto",
                                                    {"equation": "ij,jk->ik"})[0] is mm
    planner.catalog.commit([(planner.catalog.get("a"), TensorRecord("a", (8, 4), "float32", whole, 2))])
    moved = planner.plan_compute("add", ["a", "b"], "c", "", "auto", {})[0]
    assert moved is not first  # a's layout changed: planned for it
    assert {t.name: t.src for t in moved.tensors}["a"] == whole


def test_a_host_registering_at_a_new_address_has_the_planner_forget_the_old_one(planner):
    time.sleep(0.1)  # past the heartbeat timeout: h0's agent is down, and its name free for a new one
    planner.register("h0", 2, "h0:1", 10.0, secret=b"h0-second-secret-012")
    assert ("forget", "h0:1") not in planner.agents.calls  # same address: the channel serves the new agent
    time.sleep(0.1)
    planner.register("h0", 2, "h0:2", 10.0, secret=b"h0-third-secret-0123")
    assert ("forget", "h0:1") in planner.agents.calls


def test_a_job_s_working_buffers_count_together_against_the_limit_until_the_job_ends():
    """A job's steps make working buffers one at a time (a quantize step's codes, a partial sum): each adds to one
    reservation of the job's, which the limit is checked against, and which ends with the job."""
    store = ShardStore(limit_bytes=3000 * 100 + MiB, host="h0")
    store.stage("up", "h0/0", _tile(store, MiB))
    store.commit("up", "a", 1, ["h0/0"])
    for i in range(3000):
        store.reserve_more("job", "working buffers", 100, f"job's working buffer {i}")
    assert store.used_bytes() == MiB + 3000 * 100
    with pytest.raises(ResourceExhaustedError) as refused:
        store.reserve_more("job", "working buffers", 1, "job's working buffer of 'w' in role 'fp8'")
    assert str(refused.value).startswith("job's working buffer of 'w' in role 'fp8' needs 1 B (1 bytes), but the "
                                         "agent of host h0 holds 1.3 MiB (1,348,576 bytes) of its memory limit")
    assert store.used_bytes() == MiB + 3000 * 100  # the refused one added nothing
    store.abort("job")
    assert store.used_bytes() == MiB
    with pytest.raises(FailedPreconditionError, match=r"transaction job has already ended"):
        store.reserve_more("job", "working buffers", 100, "a late step")
