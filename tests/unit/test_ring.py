"""The ring reduce: pipelined across rounds when every member has a host of its own, round by round when some
share one; parts many pieces long (more than a stream keeps in flight), exact sums, the ring's bytes; and
bfloat16 (held as uint16 bits) added as numbers, not bits."""

from contextlib import contextmanager

import numpy as np
import pytest

from reshard import Mesh, Sharding, reshard_program
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.errors import ReshardError
from reshard.program import DST, SRC, Program, Step, TensorDecl, TileRef
from reshard.server.transport.streams import Piece
from tests.unit.test_runtime import HOSTS, Hosts, hosts, gloo  # noqa: F401 - fixtures


@pytest.mark.parametrize("result", ["replicate", "shard"])
@pytest.mark.parametrize("group", [("host0/0", "host1/0", "host2/0"),  # a host each: pipelined
                                   ("host0/0", "host0/1", "host1/0", "host2/0")])  # two share host0
def test_a_ring_of_long_parts_sums_exactly_and_sends_the_ring_s_bytes(hosts, group, result):  # noqa: F811
    shape = (96, 257)  # a part is 17 or more pieces of 4 KiB: more than a stream keeps in flight
    full = tuple((0, n) for n in shape)
    mesh = Mesh({"x": len(group)}, list(group))
    dst = Sharding(mesh, ("x", None) if result == "shard" else (None, None))
    rng = np.random.default_rng(3)
    addends = {d: rng.integers(-1000, 1000, shape, dtype=np.int64) for d in group}
    hosts.put("r", {d: (a, full) for d, a in addends.items()})
    step = Step.reduce(0, "sum", group, TileRef("tensor", SRC, full), TileRef("tensor", DST, full), result=result,
                       dim=0 if result == "shard" else None)
    program = Program((TensorDecl("tensor", shape, "int64", Sharding(mesh, (None, None)), dst),), (step,)).validate()
    job, runs = hosts.start(program.dumps(), "r")
    hosts.finish(job, runs)
    assert np.array_equal(hosts.get("r", dst, shape), sum(addends.values()))
    n, tile = len(group), 96 * 257 * 8
    rounds = 2 * (n - 1) if result == "replicate" else n - 1
    for host in ("host1", "host2"):  # one member each: a part (tile / n) to the next member every round
        sent = sum(hosts.runtimes[host].traffic(job).bytes_out.values())
        assert sent == rounds * tile // n


def test_a_bfloat16_partial_sum_is_the_rounded_sum_of_its_addends():
    hosts = Hosts()  # noqa: F811 - its own, on four hosts
    try:
        mesh = Mesh.from_hosts({"x": len(HOSTS)}, list(HOSTS), 1)
        shape = (6, 5)
        rng = np.random.default_rng(7)
        addends = {f"{h}/0": float32_to_bfloat16(rng.normal(size=shape).astype(np.float32)) for h in HOSTS}
        hosts.put("g", {d: (a, ((0, 6), (0, 5))) for d, a in addends.items()})
        text = reshard_program(shape, "bfloat16", Sharding(mesh, (None, None), partial=("x",)),
                               Sharding(mesh, ("x", None))).validate().dumps()
        job, runs = hosts.start(text, "g")
        hosts.finish(job, runs)
        got = bfloat16_to_float32(hosts.get("g", Sharding(mesh, ("x", None)), shape))
        exact = sum(bfloat16_to_float32(a) for a in addends.values())
        # each fold rounds to bfloat16 (8 bits of mantissa): within a few units in the last place of the sum
        assert np.allclose(got, exact, rtol=2 ** -6, atol=2 ** -6)
        assert not np.allclose(got, 0) and np.abs(got).max() < 20  # bits added as integers give 1e38s
    finally:
        hosts.close()


def _flip_first_byte(items):
    """The message's pieces with one bit of its first byte flipped, received as if off the wire."""
    flipped = False
    for item in items:
        if not flipped and isinstance(item, Piece):
            data = bytearray(memoryview(item.data).cast("B"))
            data[0] ^= 1
            item, flipped = item._replace(data=bytes(data), wire=None, landed=None), True
        yield item


def test_a_gathered_part_that_changed_at_a_forwarding_member_fails_the_job_at_the_chain_end():
    """Members that pass a gathered part on as it came leave its digest to the last one (the origin's digest
    travels with it): a bit that flips at a forwarding member, in what it keeps and what it sends on, fails the
    job, and no member commits."""
    group = ("host0/0", "host1/0", "host2/0")  # a host each: the pipelined ring, 4 rounds, round 2 forwarded

    def corrupting(host, transport):
        if host == "host1":
            incoming = transport.incoming

            @contextmanager
            def flipping(s, key, peer, part, place):
                with incoming(s, key, peer, part, place) as items:
                    yield _flip_first_byte(items) if key.hop // len(group) == 2 else items

            transport.incoming = flipping
        return transport

    hosts = Hosts(hosts=("host0", "host1", "host2"), wrap=corrupting)  # noqa: F811 - its own
    try:
        shape, full = (96, 257), ((0, 96), (0, 257))
        mesh = Mesh({"x": 3}, list(group))
        rng = np.random.default_rng(5)
        hosts.put("c", {d: (rng.integers(-1000, 1000, shape, dtype=np.int64), full) for d in group})
        text = reshard_program(shape, "int64", Sharding(mesh, (None, None), partial=("x",)),
                               Sharding(mesh, (None, None))).validate().dumps()
        job, runs = hosts.start(text, "c")
        with pytest.raises(ReshardError):
            hosts.finish(job, runs)
        failures = [str(r.failed) for r in runs.values() if r.failed is not None]
        assert any("XXH3-64" in f and "reduce step" in f for f in failures), failures
        assert all(store.find("c", 2, d) is None for store in hosts.stores.values() for d in group)
    finally:
        hosts.close()


def test_a_transport_keeps_its_ring_scratch_for_the_next_reduce():
    """The ring's scratch comes from the transport's `Recycler` (the shard store's kind, whose own tests are in
    test_recycler.py): the second reduce of a size takes the array the first one gave back."""
    hosts = Hosts(hosts=("host0", "host1", "host2"))  # noqa: F811 - its own
    try:
        group = ("host0/0", "host1/0", "host2/0")
        mesh, shape, full = Mesh({"x": 3}, list(group)), (3000, 40), ((0, 3000), (0, 40))  # parts of 320 kB
        text = reshard_program(shape, "int64", Sharding(mesh, (None, None), partial=("x",)),
                               Sharding(mesh, (None, None))).validate().dumps()
        for k in (1, 2):  # two reduces of the same size, one after the other
            hosts.put(f"s{k}", {d: (np.full(shape, k, np.int64), full) for d in group})
            job, runs = hosts.start(text, f"s{k}")
            hosts.finish(job, runs)
            assert np.array_equal(hosts.get(f"s{k}", Sharding(mesh, (None, None)), shape), np.full(shape, 3 * k))
            scratch = hosts.transports["host1"].scratch
            assert scratch.nbytes == 1000 * 40 * 8  # one part, back for the next reduce
            assert scratch.reused == k - 1  # the second reduce took the first one's
    finally:
        hosts.close()
