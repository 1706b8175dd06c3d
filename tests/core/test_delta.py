"""The delta encoding of a box between two versions (`reshard.delta`): bit-exact round trips, the smallest kind,
the bytes a sparse delta spends per changed element, the wire layout and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard.delta
from reshard.delta import (
    BITMAP,
    FULL,
    HEADER_NBYTES,
    KINDS,
    SPARSE,
    Delta,
    DeltaError,
    apply,
    apply_into,
    encode,
    encode_into,
    estimate,
    hasher,
    sparse_header,
)
from reshard.dtypes import holder_name

# How numpy holds each dtype the tests draw: bfloat16 and float8 as their bits (`reshard.dtypes.BITS_DTYPES`).
DTYPES = [np.dtype(holder_name(name)) for name in ("bfloat16", "float8_e4m3fn", "float32", "int64")]
PATTERNS = ("none", "one", "random 1%", "a row", "everything", "first and last", "random")


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def codec(request, monkeypatch):
    """Every test on both paths: the compiled sparse passes (`reshard._delta_kernel`, which pip builds where a C
    compiler is present, as on every machine `make test` runs on) and numpy's, which serves everywhere else. A delta
    `encode` is told the kind of is numpy's either way, so the round trip below compares the two byte for byte."""
    if request.param == "numpy":
        monkeypatch.setattr(reshard.delta, "_kernel", None)
    elif reshard.delta._kernel is None:
        pytest.fail("reshard._delta_kernel is not built: pip compiles it at install time where gcc or cc is on the "
                    "PATH (pip install -e . again, and see the build log for the compiler's error)")
    return request.param


def _flip(units: np.ndarray, mask: np.ndarray, rng: np.random.Generator) -> None:
    """Changes the bits of every masked element (XOR with a nonzero word), so each masked element differs."""
    info = np.iinfo(units.dtype)
    units[mask] ^= rng.integers(1, int(info.max), size=int(np.count_nonzero(mask)), dtype=units.dtype,
                                endpoint=True)


def _mask(pattern: str, shape: tuple, rng: np.random.Generator, fraction: float) -> np.ndarray:
    n = int(np.prod(shape))
    mask = np.zeros(n, dtype=bool)
    if pattern == "one" and n:
        mask[rng.integers(n)] = True
    elif pattern == "random 1%":
        mask = rng.random(n) < 0.01
    elif pattern == "a row" and n:
        rows = mask.reshape(shape[0], -1) if len(shape) > 1 else mask.reshape(1, -1)
        rows[rng.integers(rows.shape[0])] = True
    elif pattern == "everything":
        mask[:] = True
    elif pattern == "first and last" and n:
        mask[[0, -1]] = True
    elif pattern == "random":
        mask = rng.random(n) < fraction
    return mask


@st.composite
def versions(draw):
    """(old, new) of one box: a shape (empty, one element, odd sizes), a dtype, and a change pattern."""
    shape = draw(st.one_of(st.sampled_from([(), (0,), (1,), (4, 0, 3), (1, 1), (7,), (129,), (3, 5, 7)]),
                           st.tuples(st.integers(1, 5000)), st.tuples(st.integers(1, 80), st.integers(1, 80)),
                           st.tuples(st.integers(1, 17), st.integers(1, 17), st.integers(1, 17))))
    dtype = draw(st.sampled_from(DTYPES))
    pattern = draw(st.sampled_from(PATTERNS))
    fraction = draw(st.floats(0, 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    new = old.copy()
    unsigned = np.dtype(f"uint{8 * dtype.itemsize}")
    _flip(new.reshape(-1).view(unsigned), _mask(pattern, shape, rng, fraction), rng)
    return old, new, pattern


def _varint_nbytes(gap: int) -> int:
    return max(1, (gap.bit_length() + 6) // 7)


def _sizes_by_hand(old: np.ndarray, new: np.ndarray) -> dict:
    """Each kind's payload bytes, worked out element by element in Python, apart from the module's arithmetic."""
    size = old.dtype.itemsize
    old_b, new_b = old.tobytes(), new.tobytes()
    changed = [i for i in range(old.size) if old_b[i * size:(i + 1) * size] != new_b[i * size:(i + 1) * size]]
    gaps = [b - a - 1 for a, b in zip([-1] + changed, changed)]
    return {FULL: old.size * size, BITMAP: (old.size + 7) // 8 + len(changed) * size,
            SPARSE: sum(_varint_nbytes(g) for g in gaps) + len(changed) * size}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions())
def test_apply_rebuilds_new_byte_for_byte_with_the_smallest_kind(case):
    old, new, pattern = case
    before = old.tobytes()
    delta = encode(old, new)
    got = apply(old, Delta.from_bytes(delta.to_bytes()))
    assert got.shape == new.shape and got.dtype == new.dtype and got.tobytes() == new.tobytes()
    assert old.tobytes() == before, "old must stay as it was: it is read until the new version commits"
    forced = {kind: encode(old, new, kind) for kind in KINDS}
    for kind, one in forced.items():
        assert apply(old, one).tobytes() == new.tobytes(), kind
        assert one.num_changed == delta.num_changed
    by_hand = _sizes_by_hand(old, new)
    assert {kind: len(one.payload) for kind, one in forced.items()} == by_hand
    assert delta.nbytes == HEADER_NBYTES + min(by_hand.values()) == min(one.nbytes for one in forced.values())
    assert delta == forced[delta.kind]
    if pattern == "none":
        assert delta.num_changed == 0 and delta.nbytes == HEADER_NBYTES
    if pattern == "everything" and old.size:
        assert delta.kind == FULL and delta.num_changed == old.size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_apply_writes_into_the_buffer_it_is_given_and_never_into_old(dtype, kind):
    rng = np.random.default_rng(1)
    old = rng.integers(0, 100, size=(33, 17)).astype(dtype)
    new = old.copy()
    new[5] += 1
    new[0, 0] += 1
    out = np.full_like(old, 3)
    got = apply(old, encode(old, new, kind), out=out)
    assert got is out and out.tobytes() == new.tobytes()
    assert old.tobytes() != new.tobytes()


def test_bits_not_numbers_decide_what_changed():
    """-0.0 equals 0.0 and NaN equals nothing as numbers; a delta sees their bits."""
    nan_a = np.array([0x7FC00001], dtype=np.uint32).view(np.float32)[0]
    nan_b = np.array([0x7FC00002], dtype=np.uint32).view(np.float32)[0]
    old = np.array([0.0, nan_a, nan_a, 1.0], dtype=np.float32)
    new = np.array([-0.0, nan_a, nan_b, 1.0], dtype=np.float32)
    delta = encode(old, new)
    assert delta.num_changed == 2  # the sign of zero and the NaN's payload; the same NaN bits did not change
    assert apply(old, delta).tobytes() == new.tobytes()
    assert encode(old, old.copy()).num_changed == 0


def test_items_wider_than_eight_bytes_compare_by_all_their_bytes():
    old = np.zeros(20, dtype=np.complex128)
    new = old.copy()
    new[4] = 1j  # only the second 8-byte half differs
    delta = encode(old, new)
    assert (delta.kind, delta.num_changed, delta.itemsize) == (SPARSE, 1, 16)
    assert apply(old, delta).tobytes() == new.tobytes()


def _random_changes(n: int, rate: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, size=n, dtype=np.uint16)  # bfloat16 bits
    new = old.copy()
    _flip(new, rng.random(n) < rate, rng)
    return old, new


@pytest.mark.parametrize("rate", [0.01, 0.02, 0.04])
def test_a_sparse_delta_spends_well_under_3_bytes_a_changed_element_on_its_index(rate):
    """An int32 index and a bf16 value are 6 bytes a changed element; varint gaps make the index a byte or so.

    The value's own 2 bytes come on top; at 1% random changes the positions alone carry about 8 bits of entropy a
    change, so nothing that sends the raw values spends under 3 bytes in all there. The issue's goal is the total:
    at most 10% of the full bytes.
    """
    n = 1 << 20
    old, new = _random_changes(n, rate, seed=int(rate * 1000))
    delta = encode(old, new)
    k = delta.num_changed
    index_nbytes = len(delta.payload) - 2 * k
    assert delta.kind == SPARSE
    assert index_nbytes / k < 1.3, f"{index_nbytes / k:.3f} index bytes a changed element at {rate:.0%}"
    assert delta.nbytes <= 0.10 * delta.full_nbytes
    assert apply(old, delta).tobytes() == new.tobytes()


@pytest.mark.parametrize("rate", [0.0, 0.001, 0.01, 0.02, 0.04, 0.12, 0.3, 0.9, 0.95, 1.0])
def test_the_estimate_from_a_change_count_matches_what_random_changes_encode_to(rate):
    n = 1 << 18
    old, new = _random_changes(n, rate, seed=7)
    delta = encode(old, new)
    guess = estimate(n, 2, delta.num_changed)
    assert guess.kind == delta.kind
    assert abs(guess.nbytes - delta.nbytes) <= 0.01 * delta.nbytes + 8


def test_the_estimate_of_a_clustered_change_is_an_upper_bound():
    old = np.zeros((64, 1024), dtype=np.uint16)
    new = old.copy()
    new[10] = 1
    assert encode(old, new).nbytes <= estimate(old.size, 2, 1024).nbytes


def test_gaps_of_three_and_four_varint_bytes_round_trip():
    old = np.zeros(3_000_000, dtype=np.uint8)
    new = old.copy()
    new[[0, 20_000, 2_500_000, old.size - 1]] = 1  # gaps 0, 19,999 (3 bytes), 2,479,999 (4 bytes) and 499,998 (3)
    delta = encode(old, new)
    assert (delta.kind, len(delta.payload)) == (SPARSE, 1 + 3 + 4 + 3 + 4)
    assert apply(old, delta).tobytes() == new.tobytes()


def test_a_delta_prints_its_kind_counts_and_wire_bytes_and_never_its_payload():
    old = np.zeros(1000, dtype=np.uint16)
    new = old.copy()
    new[[3, 500]] = 7
    delta = encode(old, new)
    assert str(delta) == "sparse delta: 2 of 1,000 elements of 2 B changed, 31 B on the wire (1.6% of full)"
    assert repr(delta) == "Delta(kind='sparse', num_elements=1000, itemsize=2, num_changed=2)"
    assert delta.nbytes == len(delta.to_bytes()) == HEADER_NBYTES + 2 + 2 * 2 + 1  # gaps 3 and 496 (2 bytes)


def test_the_wire_layout_is_a_header_then_the_payload():
    old = np.zeros(10, dtype=np.uint16)
    new = old.copy()
    new[[1, 2]] = [0x1234, 0xABCD]
    data = encode(old, new, SPARSE).to_bytes()
    assert data == (b"RSDL" + bytes([1, 1]) + (2).to_bytes(2, "little") + (10).to_bytes(8, "little")
                    + (2).to_bytes(8, "little") + bytes([1, 0]) + bytes.fromhex("3412cdab"))
    assert Delta.from_bytes(memoryview(bytearray(data))) == Delta.from_bytes(data)


def _delta_bytes() -> bytes:
    old = np.zeros(300, dtype=np.uint16)
    new = old.copy()
    new[[0, 299]] = 1
    return encode(old, new, SPARSE).to_bytes()


@pytest.mark.parametrize("data,message", [
    (b"RSDL", r"a delta starts with a 24-byte header; got 4 bytes in all"),
    (b"JUNK" + _delta_bytes()[4:], r"a delta starts with the magic b'RSDL'; got b'JUNK': these bytes are not a delta"),
    (_delta_bytes()[:4] + b"\x02" + _delta_bytes()[5:],
     r"this reshard reads delta layout version 1; got version 2: the sender runs another reshard release"),
    (_delta_bytes()[:5] + b"\x09" + _delta_bytes()[6:],
     r"a delta's kind code must be one of \[1, 2, 3\] \(1 sparse, 2 bitmap, 3 full\); got 9"),
    (_delta_bytes()[:-3], r"a sparse delta of 2 changed elements of 2 B carries at least 6 payload bytes"),
])
def test_bytes_that_are_not_a_whole_delta_are_refused_saying_why(data, message):
    with pytest.raises(DeltaError, match=message):
        Delta.from_bytes(data)


def test_a_corrupted_index_is_refused_not_applied():
    old = np.zeros(300, dtype=np.uint16)
    good = Delta.from_bytes(_delta_bytes())  # gaps 0 and 298 (0xAA 0x02), then two values
    assert good.payload[:3] == bytes([0x00, 0xAA, 0x02])
    past_the_end = Delta(SPARSE, 300, 2, 2, bytes([0x00, 0xAB, 0x02]) + good.payload[3:])
    with pytest.raises(DeltaError, match=r"its gaps reach past the end: the message is corrupted"):
        apply(old, past_the_end)
    one_byte_gaps = Delta(SPARSE, 10, 2, 1, bytes([10, 0, 0]))
    with pytest.raises(DeltaError, match=r"its gaps reach past the end: the message is corrupted"):
        apply(np.zeros(10, dtype=np.uint16), one_byte_gaps)
    unfinished = Delta(SPARSE, 300, 2, 2, bytes([0x00, 0xAA, 0x82]) + good.payload[3:])
    with pytest.raises(DeltaError, match=r"one varint per changed element \(2\); its 3 bytes hold 1 and end midway"):
        apply(old, unfinished)
    bitmap = encode(old, old + np.uint16(1) * (np.arange(300) < 2), BITMAP)
    flipped = Delta(BITMAP, 300, 2, 2, bytes([0x07]) + bitmap.payload[1:])
    with pytest.raises(DeltaError, match=r"marks as many elements as it carries values \(2\); it marks 3"):
        apply(old, flipped)


def test_arrays_a_delta_cannot_be_taken_between_are_refused_with_the_way_out():
    a = np.zeros((4, 6), dtype=np.float32)
    with pytest.raises(DeltaError, match=r"of one shape and dtype; got old \(4, 6\) float32 and new \(4, 6\) int32"):
        encode(a, a.astype(np.int32))
    with pytest.raises(DeltaError, match=r"new must be C-contiguous; got strides \(4, 24\) for shape \(6, 4\) "
                                         r"\(copy it with np.ascontiguousarray\)"):
        encode(a.T.copy(), a.T)
    with pytest.raises(DeltaError, match=r"old is a list \(convert with np.asarray\)"):
        encode([1.0], np.ones(1))
    with pytest.raises(DeltaError, match=r"old has dtype object \(use a numeric dtype\)"):
        encode(np.array([None]), np.array([None]))
    with pytest.raises(DeltaError, match=r"kind must be one of \['full', 'bitmap', 'sparse'\], or None for the "
                                         r"smallest; got 'rle'"):
        encode(a, a, "rle")


def test_apply_refuses_an_old_or_out_that_does_not_fit_and_an_out_over_old():
    old = np.zeros(8, dtype=np.uint16)
    delta = encode(old, old + np.uint16(1))
    with pytest.raises(DeltaError, match=r"applies to the box it was taken from: 8 elements of 2 B; got old \(9,\) "
                                         r"uint16 \(9 elements of 2 B\)"):
        apply(np.zeros(9, dtype=np.uint16), delta)
    with pytest.raises(DeltaError, match=r"out must be an array of old's shape and dtype \(8,\) uint16; got \(8,\) "
                                         r"int16"):
        apply(old, delta, out=np.zeros(8, dtype=np.int16))
    with pytest.raises(DeltaError, match=r"out must not overlap old, which stays readable until the new version "
                                         r"commits"):
        apply(old, delta, out=old)
    frozen = np.zeros(8, dtype=np.uint16)
    frozen.flags.writeable = False
    with pytest.raises(DeltaError, match=r"out must be writeable"):
        apply(old, delta, out=frozen)
    assert not old.any()


@pytest.mark.parametrize("fields,message", [
    (("rle", 4, 2, 0, b""), r"kind must be one of \['full', 'bitmap', 'sparse'\]; got 'rle'"),
    ((FULL, 4, 2, 5, b"\0" * 8), r"cannot change more elements than its box holds; got 5 changed of 4"),
    ((FULL, 4, 2, 4, b"\0" * 7), r"a full delta of 4 changed of 4 elements of 2 B carries 8 payload bytes; got 7"),
    ((BITMAP, 9, 1, 1, b"\0" * 2), r"a bitmap delta of 1 changed of 9 elements of 1 B carries 3 payload bytes"),
    ((FULL, -1, 2, 0, b""), r"num_elements must be a non-negative integer; got -1"),
    ((FULL, 1, 0, 0, b""), r"itemsize must be 1 to 65535 bytes; got 0"),
    ((FULL, 1, 1, 0, bytearray(1)), r"payload must be bytes; got bytearray \(convert with bytes\(...\)\)"),
])
def test_a_delta_value_is_checked_whole_when_made(fields, message):
    with pytest.raises(DeltaError, match=message):
        Delta(*fields)


def test_estimate_refuses_counts_that_cannot_be():
    assert estimate(0, 2, 0).nbytes == HEADER_NBYTES
    with pytest.raises(DeltaError, match=r"num_changed must be at most num_elements \(10\); got 11"):
        estimate(10, 2, 11)
    with pytest.raises(DeltaError, match=r"itemsize must be a non-negative integer; got 2.0"):
        estimate(10, 2.0, 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions())
def test_the_byte_level_calls_write_what_to_bytes_writes_and_rebuild_new(case):
    """`encode_into` and `apply_into`, a frame's per-segment calls: the same bytes as `encode(...).to_bytes()`, into
    the frame's room, and the same rebuilt box, on packed bytes."""
    old, new, _ = case
    size = old.dtype.itemsize
    old_b, new_b = old.reshape(-1).view(np.uint8), new.reshape(-1).view(np.uint8)
    room = np.full(HEADER_NBYTES + old.nbytes + 64, 0xEE, dtype=np.uint8)
    length = encode_into(old_b, new_b, size, room)
    assert room[:length].tobytes() == encode(old, new).to_bytes()
    out = np.empty_like(old_b)
    apply_into(old_b, room[:length], out, size)
    assert out.tobytes() == new.tobytes()
    running = hasher()  # the kernel's running XXH3-64, fed as apply_into writes: None on the numpy path
    if running is not None:
        running.update(old_b[:3])
        apply_into(old_b, room[:length], np.empty_like(old_b), size, running)
        assert running.intdigest() == xxhash.xxh3_64_intdigest(old_b[:3].tobytes() + new.tobytes())


def test_apply_into_refuses_a_malformed_sparse_delta_saying_why():
    old = np.zeros(300, dtype=np.uint16).view(np.uint8)
    good = _delta_bytes()  # gaps 0 and 298, then two values
    bad = bytearray(good)
    bad[HEADER_NBYTES + 1] = 0xAB  # the second gap runs past the box
    with pytest.raises(DeltaError, match=r"its gaps reach past the end: the message is corrupted"):
        apply_into(old, np.frombuffer(bytes(bad), dtype=np.uint8), np.empty_like(old), 2)
    with pytest.raises(DeltaError, match=r"a delta applies to the box it was taken from"):
        apply_into(old[:500], np.frombuffer(good, dtype=np.uint8), np.empty(500, dtype=np.uint8), 2)
    out = np.empty_like(old)
    apply_into(old, np.frombuffer(good, dtype=np.uint8), out, 2)
    assert np.count_nonzero(out.view(np.uint16)) == 2
    assert sparse_header(np.frombuffer(good, dtype=np.uint8)) == (300, 2)
    assert sparse_header(np.frombuffer(b"RSDL", dtype=np.uint8)) is None


@st.composite
def regions(draw):
    """Two versions of a tile and one region of both (a box of a sender's tile, strided where it cuts columns),
    with changes at a random rate: what a frame's sender diffs in place."""
    shape = tuple(draw(st.integers(1, 60)) for _ in range(draw(st.integers(1, 3))))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)
    new = old.copy()
    unsigned = np.dtype(f"uint{8 * dtype.itemsize}")
    _flip(new.reshape(-1).view(unsigned), _mask("random", shape, rng, draw(st.sampled_from([0.0, 0.01, 0.05, 0.2]))),
          rng)
    index = tuple(slice(draw(st.integers(0, n - 1)), draw(st.integers(1, n)) if n > 1 else 1, draw(st.sampled_from(
        [1, 2, 2]))) for n in shape)
    return old[index], new[index]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions(), st.sampled_from(["both in place", "old packed", "new packed"]))
def test_encode_into_reads_strided_regions_where_they_lie(codec, case, which):
    """A region of a tile (strided where it cuts the inner dimension), old or new or both in place: the frame bytes
    are those of the packed box's delta."""
    old, new = case
    packed = [np.ascontiguousarray(a) for a in (old, new)]
    if which == "old packed":
        old = packed[0].reshape(-1).view(np.uint8)
    elif which == "new packed":
        new = packed[1].reshape(-1).view(np.uint8)
    room = np.empty(HEADER_NBYTES + packed[0].nbytes + 64, dtype=np.uint8)
    length = encode_into(old, new, packed[0].dtype.itemsize, room)
    assert room[:length].tobytes() == encode(*packed).to_bytes()
