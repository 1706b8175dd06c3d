"""Replicated reduces as gloo's own all-reduce (`CollectiveTransport.all_reduce`), on a real gloo group formed in
this process: exact results for the ops and dtypes it takes, the ring's bytes, the source left as it was, the
group of the members' hosts claimed and freed through the store; a reduce that finds that group held, whose
members share a host, or that takes a float max, runs the ring of streams instead; two jobs reducing over the
same hosts at once both come out exact."""

import threading

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.program import DST, SRC, Program, Step, TensorDecl, TileRef
from tests.unit.test_runtime import Hosts, gloo  # noqa: F401 - fixture

SHAPE, FULL = (96, 257), ((0, 96), (0, 257))  # 13 pieces of 4 chunks of 4 KiB at int64: several all-reduces
ACROSS = ("host0/0", "host1/0", "host2/0")  # a host each, three of the group's four: a process group of their own


def _held_key(gloo, hosts) -> str:  # noqa: F811
    return f"reshard/g{gloo.generation}/native/{','.join(hosts)}"


def _reduce_program(group, op: str, dtype: str) -> str:
    mesh = Mesh({"x": len(group)}, list(group))
    step = Step.reduce(0, op, group, TileRef("tensor", SRC, FULL), TileRef("tensor", DST, FULL), result="replicate")
    return Program((TensorDecl("tensor", SHAPE, dtype, Sharding(mesh, (None, None)), Sharding(mesh, (None, None))),),
                   (step,)).validate().dumps()


@pytest.fixture()
def native(gloo):  # noqa: F811
    hosts = Hosts(group=gloo, native_reduce=True)
    yield hosts
    hosts.close()


@pytest.mark.parametrize("op,dtype", [("sum", "int64"), ("max", "int64"), ("sum", "float32")])
def test_a_replicated_reduce_over_hosts_of_their_own_runs_as_gloo_s_all_reduce(native, gloo, op, dtype):  # noqa: F811
    rng = np.random.default_rng(7)
    addends = {d: rng.integers(-1000, 1000, SHAPE).astype(dtype) for d in ACROSS}
    native.put("r", {d: (a.copy(), FULL) for d, a in addends.items()})
    job, runs = native.start(_reduce_program(ACROSS, op, dtype), "r")
    native.finish(job, runs)
    fold = np.add if op == "sum" else np.maximum
    want = fold.reduce(list(addends.values()))
    assert np.array_equal(native.get("r", Sharding(Mesh({"x": 3}, list(ACROSS)), (None, None)), SHAPE), want)
    tile = SHAPE[0] * SHAPE[1] * np.dtype(dtype).itemsize
    for dev in ACROSS:
        host = dev.split("/")[0]
        assert native.runtimes[host].traffic(job).native_reduces == 1, host  # what the job's traffic reports
        assert sum(native.runtimes[host].traffic(job).bytes_out.values()) == 2 * 2 * tile // 3  # the ring's share
        assert np.array_equal(native.stores[host].get("r", 1, dev).array, addends[dev])  # the source as it was
    assert native.runtimes["host3"].traffic(job).native_reduces == 0  # not a member
    assert gloo.store.get(_held_key(gloo, ("host0", "host1", "host2"))) == b""  # freed for the next reduce
    assert not gloo.store.check([f"reshard/g{gloo.generation}/native-job/{job}/0/decision"])  # keys deleted


def test_a_reduce_that_finds_its_hosts_group_held_runs_the_ring(native, gloo):  # noqa: F811
    held = _held_key(gloo, ("host0", "host1", "host2"))
    gloo.store.set(held, "another-job/3")  # as a reduce of another job holds it
    try:
        native.put("h", {d: (np.full(SHAPE, k + 1, np.int64), FULL) for k, d in enumerate(ACROSS)})
        job, runs = native.start(_reduce_program(ACROSS, "sum", "int64"), "h")
        native.finish(job, runs)
        assert np.array_equal(native.get("h", Sharding(Mesh({"x": 3}, list(ACROSS)), (None, None)), SHAPE),
                              np.full(SHAPE, 6))
        assert all(native.runtimes[d.split("/")[0]].traffic(job).native_reduces == 0 for d in ACROSS)
        assert gloo.store.get(held) == b"another-job/3"  # the holder's claim untouched
    finally:
        gloo.store.set(held, "")


def test_a_float_max_runs_the_ring_which_keeps_every_nan(native):
    """Gloo's max keeps or drops a NaN by its operands' order; numpy.maximum, the ring's fold, always keeps it."""
    addends = {d: np.zeros(SHAPE, np.float32) for d in ACROSS}
    addends["host1/0"][3, 4] = np.nan
    addends["host2/0"][5, 6] = np.nan
    native.put("m", {d: (a, FULL) for d, a in addends.items()})
    job, runs = native.start(_reduce_program(ACROSS, "max", "float32"), "m")
    native.finish(job, runs)
    got = native.get("m", Sharding(Mesh({"x": 3}, list(ACROSS)), (None, None)), SHAPE)
    assert np.isnan(got[3, 4]) and np.isnan(got[5, 6]) and np.count_nonzero(np.isnan(got)) == 2
    assert all(r.traffic(job).native_reduces == 0 for r in native.runtimes.values())


def test_a_reduce_whose_members_share_a_host_runs_the_ring(native):
    group = ("host0/0", "host0/1", "host1/0", "host2/0")
    native.put("s", {d: (np.full(SHAPE, k, np.int64), FULL) for k, d in enumerate(group)})
    job, runs = native.start(_reduce_program(group, "sum", "int64"), "s")
    native.finish(job, runs)
    assert np.array_equal(native.get("s", Sharding(Mesh({"x": 4}, list(group)), (None, None)), SHAPE),
                          np.full(SHAPE, 6))
    assert all(r.traffic(job).native_reduces == 0 for r in native.runtimes.values())


def test_two_jobs_reducing_over_the_same_hosts_at_once_both_come_out_exact(native, gloo):  # noqa: F811
    """At most one of them holds the hosts' group at a time; the other runs natively after it or as the ring."""
    text = _reduce_program(ACROSS, "sum", "int64")
    for k in (1, 2):
        native.put(f"c{k}", {d: (np.full(SHAPE, k * (i + 1), np.int64), FULL) for i, d in enumerate(ACROSS)})
    started = {}

    def start(k: int) -> None:
        started[k] = native.start(text, f"c{k}")

    threads = [threading.Thread(target=start, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (1, 2):
        native.finish(*started[k])
        assert np.array_equal(native.get(f"c{k}", Sharding(Mesh({"x": 3}, list(ACROSS)), (None, None)), SHAPE),
                              np.full(SHAPE, 6 * k))
    counts = {sum(native.runtimes[d.split("/")[0]].traffic(started[k][0]).native_reduces for k in (1, 2))
              for d in ACROSS}
    assert len(counts) == 1 and counts <= {1, 2}, counts  # every member ran each job the same way
    assert gloo.store.get(_held_key(gloo, ("host0", "host1", "host2"))) == b""
