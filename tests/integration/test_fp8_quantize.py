"""bfloat16 to fp8 with 128 x 128 block scales (``c.apply("fp8_quantize", ...)``) through real agents, every transport.

Each device quantizes its own tile; where every tile starts on a block boundary that is the whole tensor's
quantization, bit for bit against the numpy reference quantizer of tests/core/test_fp8_kernels.py. A layout whose
tiles cut blocks is refused before anything runs, naming the tile and the way out.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.proto.errors import InvalidArgumentError
from tests.core.test_fp8_kernels import reference

from .every_device import assert_every_device

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
ACROSS = Mesh.from_hosts({"x": 4}, ["host0", "host1", "host2", "host3"], 1)


def _weight(shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    x[0, :4] = [0.0, -0.0, 3.5, -1e-3]  # a zero, a negative zero and the first block's largest magnitude
    return float32_to_bfloat16(x).view(ml_dtypes.bfloat16)


@pytest.mark.parametrize("sharding", [Sharding(MESH, ("x", None)), Sharding(ACROSS, ("x", None))],
                         ids=["rows-over-hosts-replicated", "rows-over-4-hosts"])
def test_each_device_quantizes_its_tile_into_the_tensors_fp8(client, fresh_name, sharding):
    n = fresh_name
    w = _weight((512, 300), seed=5)  # 300 columns: blocks of 128, 128 and 44
    client.put(f"{n}.w", w, sharding)
    try:
        result = client.apply("fp8_quantize", f"{n}.w", out=f"{n}.q").result(timeout=60)
        assert result.state == "succeeded"
        assert result.network_bytes == 0  # every tile is quantized where it lies
        codes, _ = reference(bfloat16_to_float32(w.view(np.uint16)), 128)
        info = client.info(f"{n}.q")
        assert info.dtype == "float8_e4m3fn" and info.shape == (512, 300) and info.sharding == sharding
        got = client.get(f"{n}.q")
        assert got.dtype == ml_dtypes.float8_e4m3fn and np.array_equal(got.view(np.uint8), codes)
        assert_every_device(client, f"{n}.q", codes.view(ml_dtypes.float8_e4m3fn), sharding)
    finally:
        held = {t.name for t in client.tensors()}
        for name in (f"{n}.w", f"{n}.q"):
            if name in held:
                client.delete(name)


def test_tiles_that_cut_blocks_are_refused_before_anything_runs(client, fresh_name):
    n = fresh_name
    client.put(f"{n}.w", _weight((256, 300), seed=6), Sharding(MESH, ("x", "y")))  # columns cut at 150
    try:
        with pytest.raises(InvalidArgumentError, match=r"fp8_quantize on host0/1: its tile .* does not start on a "
                                                       r"boundary of the 128 x 128 blocks, .* cut at multiples of 128"):
            client.apply("fp8_quantize", f"{n}.w", out=f"{n}.q").result(timeout=60)
        assert f"{n}.q" not in {t.name for t in client.tensors()}
    finally:
        client.delete(f"{n}.w")
