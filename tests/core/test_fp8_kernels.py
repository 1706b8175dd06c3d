"""The fp8 kernels (`fp8_quantize`, `fp8_scales`): the DeepSeek / Kimi serving format, bit for bit.

A reference quantizer written here with plain numpy, block by block and value by value (the nearest of the 127
finite float8_e4m3fn values, found in a table), must give the agents' kernels' bits over generated shapes (short
last blocks included), zeros, subnormals, infinities and NaNs; numpy and torch tiles alike. The shape rules are the
core's.
"""

from __future__ import annotations

import math
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.kernels import KERNELS, KernelShapeError
from reshard.server.agent import kernels as agent_kernels
from reshard.server.agent.kernels import KERNELS as AGENT_KERNELS

# The finite float8_e4m3fn values in code order 0..0x7E (0x7F is NaN): e4m3 with bias 7, subnormals below 2**-6.
E4M3 = np.array([(c & 7) / 8 * 2.0**-6 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
                 for c in range(0x7F)])


def _encode(q: float, x: float) -> int:
    """The e4m3fn code of ``q`` (the scaled value of ``x``): nearest, ties to the even code, saturating."""
    if math.isnan(x):
        return 0x7F | (0x80 if math.copysign(1.0, x) < 0 else 0)
    a = min(abs(q), 448.0)
    hi = int(np.searchsorted(E4M3, a))
    if hi == 0 or E4M3[hi] == a:
        code = hi
    else:
        lo = hi - 1
        below, above = a - E4M3[lo], E4M3[hi] - a
        code = lo if below < above or (below == above and lo % 2 == 0) else hi
    return code | (0x80 if math.copysign(1.0, q) < 0 else 0)


def reference(x32: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(fp8 codes as uint8, float32 scales) of a float32 matrix, one block at a time, and in a block one value at a
    time: `_encode` once for each distinct pair of bits (scaled value, value), whose code every element with those
    bits gets (a block of bf16 weights holds a few thousand distinct values, not 16,384)."""
    m, n = x32.shape
    bm, bn = -(-m // block), -(-n // block)
    scales = np.empty((bm, bn), dtype=np.float32)
    codes = np.empty((m, n), dtype=np.uint8)
    for i in range(bm):
        for j in range(bn):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            blk = x32[rows, cols]
            finite = np.abs(blk[np.isfinite(blk)])
            amax = np.float32(finite.max()) if finite.size else np.float32(0)
            s = np.float32(amax / np.float32(448))
            scales[i, j] = s if s != 0 else np.float32(1)
            with np.errstate(invalid="ignore"):
                q = blk / scales[i, j]
            pairs = (np.asarray(q, dtype=np.float32).view(np.uint32).astype(np.uint64) << np.uint64(32)) \
                | blk.view(np.uint32)
            distinct, which = np.unique(pairs.reshape(-1), return_inverse=True)
            qs = (distinct >> np.uint64(32)).astype(np.uint32).view(np.float32)
            xs = (distinct & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
            found = np.array([_encode(float(a), float(b)) for a, b in zip(qs, xs)], dtype=np.uint8)
            codes[rows, cols] = found[which].reshape(blk.shape)
    return codes, scales


def _run(name: str, x, block: int | None = None, out=None, scales=None):
    params = {} if block is None else {"block": str(block)}
    inputs = [x] if scales is None else [x, scales]
    shape = KERNELS[name].output_shape(tuple(tuple(a.shape) for a in inputs), params)
    codes = name.startswith("fp8_quantize")
    if out is None:
        out = np.full(shape, 0xAB if codes else np.nan, dtype=np.uint8 if codes else np.float32)
    AGENT_KERNELS[name](inputs, out, params)
    return out


@st.composite
def matrices(draw):
    """bfloat16 bits of a matrix of values over a drawn range of magnitudes, with zeros, subnormals and
    non-finite values mixed in, and a block that often leaves the last blocks short."""
    block = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 128]))
    m = draw(st.integers(0, 3 * block + 2 if block < 128 else 300))
    n = draw(st.integers(0, 3 * block + 2 if block < 128 else 200))
    seed = draw(st.integers(0, 2**32 - 1))
    low, span = draw(st.integers(-140, 100)), draw(st.integers(0, 40))
    special = draw(st.sampled_from([0.0, 0.02, 0.3]))
    rng = np.random.default_rng(seed)
    x = rng.choice([-1.0, 1.0], (m, n)) * rng.uniform(1, 2, (m, n)) * 2.0 ** rng.integers(low, low + span + 1, (m, n))
    odd = rng.random((m, n)) < special
    x[odd] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-40, -3e-39], odd.sum())
    with np.errstate(over="ignore"):
        return float32_to_bfloat16(x.astype(np.float32)), block


@pytest.fixture(params=["numpy", "torch"])
def cast(request, monkeypatch):
    """The CPU cast a host tile's quantize takes: numpy's passes, or torch's cast where torch is installed."""
    if request.param == "torch":
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(agent_kernels, "_cast_torch", lambda: torch)
    else:
        monkeypatch.setattr(agent_kernels, "_cast_torch", lambda: None)
    return request.param


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(matrices())
def test_the_kernels_give_the_reference_quantizers_bits(cast, case):
    # the fixture's patch is the same for every example
    bits, block = case
    codes, scales = reference(bfloat16_to_float32(bits), block)
    np.testing.assert_array_equal(_run("fp8_quantize", bits, block), codes)
    got = _run("fp8_scales", bits, block)
    np.testing.assert_array_equal(got.view(np.uint32), scales.view(np.uint32))
    assert (got > 0).all() and np.isfinite(got).all()
    # a sender that made the scales hands them to the quantize: the same bits
    np.testing.assert_array_equal(_run("fp8_quantize_scaled", bits, block, scales=got), codes)


@settings(max_examples=40, deadline=None)
@given(matrices())
def test_the_torch_path_gives_the_same_bits(case):
    torch = pytest.importorskip("torch")
    bits, block = case
    x = torch.from_numpy(bits.astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    codes, scales = reference(bfloat16_to_float32(bits), block)
    q = torch.empty(codes.shape, dtype=torch.float8_e4m3fn)
    _run("fp8_quantize", x, block, q)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), codes)
    s = torch.empty(scales.shape, dtype=torch.float32)
    _run("fp8_scales", x, block, s)
    np.testing.assert_array_equal(s.numpy().view(np.uint32), scales.view(np.uint32))
    q2 = torch.empty(codes.shape, dtype=torch.float8_e4m3fn)
    _run("fp8_quantize_scaled", x, block, q2, scales=s)
    np.testing.assert_array_equal(q2.view(torch.uint8).numpy(), codes)


def test_the_reference_agrees_with_ml_dtypes_where_both_define_the_cast():
    # ml_dtypes rounds to nearest even as well, but turns what lies beyond 448 into NaN: compare inside the range.
    values = np.concatenate([E4M3, (E4M3[1:] + E4M3[:-1]) / 2, np.linspace(0, 448, 5001), [2.0**-10, 2.0**-9.5]])
    values = np.concatenate([values, -values]).astype(np.float32)
    want = np.array([_encode(float(v), float(v)) for v in values], dtype=np.uint8)
    np.testing.assert_array_equal(values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), want)


def test_a_256_by_300_bfloat16_weight_in_blocks_of_128():
    rng = np.random.default_rng(3)
    bits = float32_to_bfloat16((rng.standard_normal((256, 300)) * 0.02).astype(np.float32))
    codes, scales = reference(bfloat16_to_float32(bits), 128)
    assert scales.shape == (2, 3)  # the last column of blocks is 44 wide
    np.testing.assert_array_equal(_run("fp8_quantize", bits), codes)
    np.testing.assert_array_equal(_run("fp8_scales", bits), scales)
    # each block's largest magnitude lands on 448 (0x7E), and the values dequantize to within e4m3's step
    assert ((codes & 0x7F) == 0x7E).sum() >= 6
    per_element = np.repeat(np.repeat(scales, 128, 0), 128, 1)[:, :300]
    back = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * per_element
    x = bfloat16_to_float32(bits)
    assert np.all(np.abs(back - x) <= np.abs(x) / 16 + scales.max() * 2.0**-9)


@pytest.mark.parametrize("band_bytes", [None, 1])
@pytest.mark.parametrize("block", [1, 16, 100, 128])
def test_block_scales_from_bfloat16_bits_equal_those_of_the_widened_values(block, band_bytes, monkeypatch):
    # every one of the 65,536 bfloat16 bit patterns (zeros, subnormals, infinities, NaNs of both signs), in order and
    # shuffled, so blocks mix them; 100 leaves short blocks at the edges. In bands of one block's rows too, where
    # the ordered patterns' bands mostly hold no infinity or NaN and skip their masking
    if band_bytes is not None:
        monkeypatch.setattr(agent_kernels, "_BAND_BYTES", band_bytes)
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    shuffled = np.random.default_rng(5).permutation(every.reshape(-1)).reshape(256, 256)
    for bits in (every, shuffled, shuffled[:130, :201]):
        want = agent_kernels.fp8_block_scales(bfloat16_to_float32(bits), block)
        np.testing.assert_array_equal(agent_kernels.bf16_block_scales(bits, block).view(np.uint32),
                                      want.view(np.uint32))


@pytest.fixture(params=["cast", "checked"])
def band_check(request, monkeypatch):
    """How a band reaches its cast: straight, where torch's cast saturates and keeps a NaN's sign as the reference
    does (`_band_cast_saturates`: the pinned torch's), or through the pass that finds NaNs and clamps, which a cast
    unlike the reference's takes."""
    if request.param == "checked":
        monkeypatch.setattr(agent_kernels, "_band_cast_saturates", lambda torch: False)
    return request.param


def test_the_pinned_torchs_cast_skips_the_bands_check_and_a_cast_unlike_the_references_is_caught(monkeypatch):
    torch = pytest.importorskip("torch")
    assert agent_kernels._band_cast_saturates(torch)
    # a cast that made NaN of what is past 448, as some builds do: its code for 464 is 0x7F, not the reference's
    cases = list(agent_kernels._CAST_CASES)
    cases[0] = (cases[0][0], cases[0][1], 0x7F)
    monkeypatch.setattr(agent_kernels, "_CAST_CASES", tuple(cases))
    agent_kernels._band_cast_saturates.cache_clear()
    try:
        assert not agent_kernels._band_cast_saturates(torch)
    finally:
        agent_kernels._band_cast_saturates.cache_clear()  # the next caller checks the real cases again


def test_every_bfloat16_value_quantized_in_bands_gives_the_references_bits(monkeypatch, band_check):
    # the 65,536 bfloat16 bit patterns (zeros, subnormals, infinities and NaNs of both signs), shuffled so every block
    # mixes them, quantized by their own scales, then by scales a third of those (each block's largest past 448)
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(agent_kernels, "_cast_torch", lambda: torch)
    monkeypatch.setattr(agent_kernels, "_BAND_BYTES", 1)  # a band of one block's rows: 16 bands here
    bits = np.random.default_rng(6).permutation(np.arange(2**16, dtype=np.uint32).astype(np.uint16)).reshape(256, 256)
    x32 = bfloat16_to_float32(bits)
    codes, scales = reference(x32, 16)
    np.testing.assert_array_equal(_run("fp8_quantize", bits, 16), codes)
    smaller = scales / np.float32(3)
    full = np.repeat(np.repeat(smaller, 16, axis=0), 16, axis=1)
    with np.errstate(invalid="ignore"):
        quotients = (x32 / full).reshape(-1)
    want = np.array([_encode(float(q), float(v)) for q, v in zip(quotients, x32.reshape(-1))],
                    dtype=np.uint8).reshape(x32.shape)
    assert (want & 0x7F == 0x7E).sum() > 100 and (want & 0x7F == 0x7F).sum() > 100  # saturated codes and NaNs
    np.testing.assert_array_equal(_run("fp8_quantize_scaled", bits, 16, scales=smaller), want)


@pytest.mark.parametrize("nan_in_band", [None, 0, 3])
def test_a_tile_quantized_band_by_band_gives_the_references_bits(monkeypatch, nan_in_band, band_check):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(agent_kernels, "_cast_torch", lambda: torch)
    monkeypatch.setattr(agent_kernels, "_BAND_BYTES", 1)  # a band of one block's rows: 4 bands here
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4 * 16, 48)) * 0.02).astype(np.float32)
    x[5, 7] = 1e6  # saturates
    if nan_in_band is not None:  # a NaN in the first or the last band: the general path redoes the whole tile
        x[nan_in_band * 16 + 3, 9] = -np.nan
    bits = float32_to_bfloat16(x)
    codes, scales = reference(bfloat16_to_float32(bits), 16)
    np.testing.assert_array_equal(_run("fp8_quantize", bits, 16), codes)
    np.testing.assert_array_equal(_run("fp8_quantize_scaled", bits, 16, scales=scales), codes)


def test_bands_scaled_past_448_saturate_whether_or_not_they_are_clamped(monkeypatch, band_check):
    """Scales a sender did not make from this tile put its values past 448: a band that reaches no further than
    rounds to 448 skips the clamp, a band beyond it is clamped, and both give the reference's saturated codes."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(agent_kernels, "_cast_torch", lambda: torch)
    monkeypatch.setattr(agent_kernels, "_BAND_BYTES", 1)  # a band of one block's rows: 4 bands here
    rng = np.random.default_rng(12)
    bits = float32_to_bfloat16((rng.standard_normal((4 * 16, 48)) * 0.02).astype(np.float32))
    x32 = bfloat16_to_float32(bits)
    _, scales = reference(x32, 16)
    scales[0] *= np.float32(448 / 455)  # band 0 reaches about 455: under 464, so it casts to 448 unclamped
    scales[1] /= np.float32(3)  # band 1 reaches about 1344: clamped
    scales[2] *= np.float32(448 / 463.5)  # band 2 reaches just under the midpoint: clamped all the same
    full = np.repeat(np.repeat(scales, 16, axis=0), 16, axis=1)
    want = np.array([_encode(float(q), float(v)) for q, v in zip((x32 / full).reshape(-1), x32.reshape(-1))],
                    dtype=np.uint8).reshape(x32.shape)
    assert (want & 0x7F == 0x7E).sum() > 16  # saturated codes in bands 0, 1 and 2
    np.testing.assert_array_equal(_run("fp8_quantize_scaled", bits, 16, scales=scales), want)


def test_a_float32_tile_of_bfloat16_values_gets_its_bits_scales_and_codes():
    bits = float32_to_bfloat16((np.random.default_rng(8).standard_normal((200, 260)) * 0.02).astype(np.float32))
    x32 = bfloat16_to_float32(bits)  # the same values as a float32 tile: the float32 route and the general path
    for name in ("fp8_scales", "fp8_quantize"):
        np.testing.assert_array_equal(_run(name, x32, 128), _run(name, bits, 128))


def test_zeros_nans_and_infinities_as_documented():
    x = np.array([[0.0, -0.0, np.nan, -np.nan], [np.inf, -np.inf, 2.0, -1.0]], dtype=np.float32)
    bits = float32_to_bfloat16(x)
    # the block's scale comes from its finite values (2.0), so 2.0 is 448 and -1.0 is -224; inf saturates
    assert _run("fp8_scales", bits, 4).tolist() == [[np.float32(2.0 / np.float32(448))]]
    assert _run("fp8_quantize", bits, 4).tolist() == [[0x00, 0x80, 0x7F, 0xFF], [0x7E, 0xFE, 0x7E, 0xF6]]
    # a block of nothing but zeros and non-finite values (the first of 2 x 2) has scale 1
    assert _run("fp8_scales", bits, 2).tolist() == [[1.0, np.float32(2.0 / np.float32(448))]]
    assert _run("fp8_quantize", bits, 2)[1, :2].tolist() == [0x7E, 0xFE]


def test_the_shape_rules_and_their_refusals():
    rule = KERNELS["fp8_scales"].output_shape
    assert rule(((300, 129),), {}) == (3, 2)
    assert rule(((0, 5),), {"block": "4"}) == (0, 2)
    assert KERNELS["fp8_quantize"].output_shape(((300, 129),), {}) == (300, 129)
    assert KERNELS["fp8_quantize"].output_dtype == "float8_e4m3fn"
    assert KERNELS["fp8_scales"].output_dtype == "float32"
    with pytest.raises(KernelShapeError, match=r"^fp8_quantize quantizes 2-D tiles in square blocks, .* got a tile "
                                               r"of shape \(7168,\)\. Leave 1-D tensors"):
        KERNELS["fp8_quantize"].output_shape(((7168,),), {})
    with pytest.raises(KernelShapeError, match=r"^fp8_scales parameter block='0' is not a whole number of elements "
                                               r"from 1 to 65536; the serving format's blocks are 128$"):
        rule(((8, 8),), {"block": "0"})
    with pytest.raises(KernelShapeError, match=r"^fp8_scales takes parameters \['block'\]; got unknown \['scale'\]"):
        rule(((8, 8),), {"scale": "1"})
    scaled = KERNELS["fp8_quantize_scaled"].output_shape
    assert scaled(((300, 129), (3, 2)), {}) == (300, 129)
    assert scaled(((8, 8), (2, 2)), {"block": "4"}) == (8, 8)
    assert KERNELS["fp8_quantize_scaled"].output_dtype == "float8_e4m3fn"
    assert not KERNELS["fp8_quantize_scaled"].takes(1)
    with pytest.raises(KernelShapeError, match=r"^fp8_quantize_scaled divides x \(300, 129\) by one scale per 128 x "
                                               r"128 block, so its scales are \(3, 2\) \(fp8_scales of x\); got "
                                               r"\(2, 2\)$"):
        scaled(((300, 129), (2, 2)), {})


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 300), st.sampled_from([0.0, 0.05, 0.5]))
def test_torchs_cpu_cast_gives_the_numpy_passes_bits(seed, n, special):
    # Every float32 exponent from subnormal to past 448, values on the e4m3fn ties and past its range, and the
    # specials: the two casts agree bit for bit, and NaNs take the input's sign bit, not the quotient's.
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    x = rng.choice([-1.0, 1.0], n) * rng.uniform(1, 2, n) * 2.0 ** rng.integers(-30, 12, n)
    ties = rng.random(n) < 0.2
    x[ties] = rng.choice([-1.0, 1.0], ties.sum()) * (E4M3[rng.integers(0, 0x7E, ties.sum())] +
                                                      E4M3[rng.integers(1, 0x7F, ties.sum())]) / 2
    odd = rng.random(n) < special
    x[odd] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448.0, 464.0, -465.0, 2.0**-10], odd.sum())
    values = x.astype(np.float32)
    # the input the values were divided from (by positive scales): its signs are theirs, but a NaN's may differ
    signs = np.where(np.isnan(values) & (rng.random(n) < 0.5), -values, values)
    want = agent_kernels._e4m3_numpy(values.copy(), signs)
    np.testing.assert_array_equal(agent_kernels._e4m3_torch(values.copy(), signs, torch), want)


def test_a_host_tiles_quantize_takes_torchs_cast_where_torch_is_installed():
    # An agent on gRPC or nixl has not loaded torch; its first quantize loads it (where installed), so its casts run
    # at torch's speed, and the kernels' module alone does not load it (a light install's agent, or one never asked
    # to quantize, never pays the import). In a fresh process: this one has torch loaded by other tests.
    pytest.importorskip("torch")
    script = ("import sys, numpy as np\n"
              "from reshard.server.agent.kernels import KERNELS\n"
              "assert 'torch' not in sys.modules, 'the kernels module loaded torch'\n"
              "out = np.zeros((128, 128), dtype=np.uint8)\n"
              "KERNELS['fp8_quantize']([np.ones((128, 128), dtype=np.uint16)], out, {'block': '128'})\n"
              "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
