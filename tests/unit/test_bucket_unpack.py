"""A bucket's bytes reach its members' destination tiles as they arrive (`buckets._Unpack`): each member as soon as
the receiving device has all of its bytes, not once the whole bucket is in; pieces that come out of order wait for
the bytes before them, and the bucket's buffer goes back once, after its last member."""

from __future__ import annotations

import numpy as np

from reshard import box as boxes
from reshard.many import plan_many
from reshard.mesh import host_of
from reshard.proto.layout import np_dtype
from reshard.server.agent.buckets import bucket_moves
from reshard.server.agent.staging import StagedTiles, tile_plan
from tests.core.test_many import _state_dict

HOST = "i0"


def _zeros(shape, dtype: str) -> np.ndarray:
    return np.zeros(shape, np_dtype(dtype))


def _bytes(n: int) -> np.ndarray:
    return np.empty(n, np.uint8)


def _bucket_and_tiles():
    """The largest bucket host i0 receives, and i0's staged tiles of every tensor in it (zeros to start)."""
    program = plan_many(_state_dict(num_layers=3))
    bucket = max(bucket_moves(program, HOST).values(), key=lambda b: len(b.members))
    assert len(bucket.members) >= 8
    device = next(r for r in bucket.step.transfer.receivers if host_of(r) == HOST)
    staged = {}
    for name in set(bucket.tensors):
        decl = program.tensor(name)
        tiles = {d: t for d, t in decl.dst.tiles(decl.shape).items() if host_of(d) == HOST}
        staged[name] = StagedTiles("job", decl, name, "owner", None, 0, _zeros, False, tile_plan(decl, tiles), [],
                                   reserve=False)
    return bucket, device, staged


def _member_bytes(staged, device, part) -> np.ndarray:
    tensor, box, lo, hi, _, _ = part
    tiles = staged[tensor]
    tile = tiles.tiles[device]
    where = tuple(slice(b[0] - t[0], b[1] - t[0]) for b, t in zip(box, tile))
    return np.ascontiguousarray(tiles.buffers[device][where]).view(np.uint8).reshape(-1)


def _unpacked(staged, device, bucket, data) -> list[bool]:
    """Per member: whether its bytes of ``data`` are in its tile."""
    return [np.array_equal(_member_bytes(staged, device, p), data[p[2]:p[3]]) for p in bucket.parts]


def _deliver(order: list[int]):
    """Deliver the largest bucket to i0 in 4 pieces, in ``order``; per piece delivered, which members were in their
    tiles after it, and when the buffer went back."""
    bucket, device, staged = _bucket_and_tiles()
    rng = np.random.default_rng(7)
    data = rng.integers(1, 255, bucket.nbytes, dtype=np.uint8)  # no zero byte: a member still missing reads zeros
    given: list[int] = []
    sink = bucket.sink(lambda tensor, box: staged[tensor], _bytes, lambda buf: given.append(len(seen)))
    cuts = np.linspace(0, bucket.nbytes, 5).astype(int)
    pieces = [(int(lo), int(hi)) for lo, hi in zip(cuts[:-1], cuts[1:])]
    seen = []
    for k in order:
        lo, hi = pieces[k]
        sink.write(device, ((lo, hi),), data[lo:hi])
        seen.append(_unpacked(staged, device, bucket, data))
    return bucket, pieces, seen, given, staged, device


def test_each_member_is_in_its_tile_as_soon_as_its_bytes_have_arrived():
    bucket, pieces, seen, given, staged, device = _deliver([0, 1, 2, 3])
    for k, state in enumerate(seen):
        arrived = pieces[k][1]
        assert state == [p[3] <= arrived for p in bucket.parts], f"after piece {k}"
    assert any(seen[0]) and not all(seen[2])  # members went in before the last piece, and not all of them at once
    assert given == [3]  # the buffer went back once, as the last piece came (three before it)
    counted: dict[str, int] = {}
    for tensor, box, *_ in bucket.parts:
        counted[tensor] = counted.get(tensor, 0) + boxes.volume(box)
    for name, tiles in staged.items():  # every element of the members' boxes counted, once
        assert boxes.volume(tiles.tiles[device]) - tiles.missing[device] == counted[name]


def test_a_piece_out_of_order_waits_for_the_bytes_before_it():
    bucket, pieces, seen, given, _, _ = _deliver([1, 0, 3, 2])
    assert seen[0] == [p[3] <= 0 for p in bucket.parts]  # piece 1 alone completes no member after piece 0's bytes
    assert seen[1] == [p[3] <= pieces[1][1] for p in bucket.parts]  # piece 0 lets every member up to piece 1's end in
    assert seen[2] == seen[1]
    assert all(seen[3])
    assert given == [3]


def test_members_that_land_in_place_are_counted_as_their_bytes_arrive():
    bucket, device, staged = _bucket_and_tiles()
    sink = bucket.sink(lambda tensor, box: staged[tensor], _bytes, lambda buf: None, scatter=True)
    # the transport lands the bucket where `place` says: here one buffer (its members are all too small to land in
    # place), marked piece by piece as a transport that lands in place marks them
    _, region = sink.place([device], ((0, bucket.nbytes),))
    data = np.random.default_rng(3).integers(1, 255, bucket.nbytes, dtype=np.uint8)
    half = bucket.nbytes // 2
    region[:half] = data[:half]
    sink.mark(device, ((0, half),))
    done = [p[3] <= half for p in bucket.parts]
    assert _unpacked(staged, device, bucket, data) == done
    region[half:] = data[half:]
    sink.mark(device, ((half, bucket.nbytes),))
    assert all(_unpacked(staged, device, bucket, data))
