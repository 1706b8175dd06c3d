"""`digest_views` (reshard.proto.layout): XXH3-64 of arrays' bytes in C order read where they lie, by the compiled
kernel (`reshard._delta_kernel.digest`) or, where it is not built, by packing each first: both must give exactly what
xxhash gives the packed, joined bytes, since a delta frame's sender digests strided regions this way and its
receiver checks them against a digest of packed bytes."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.proto import layout
from reshard.proto.layout import digest_views


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(layout, "_kernel", None)
    elif layout._kernel is None:
        pytest.fail("reshard._delta_kernel is not built: pip compiles it at install time where gcc or cc is on the "
                    "PATH (pip install -e . again, and see the build log for the compiler's error)")
    return request.param


@st.composite
def regions(draw):
    """A tile (1 to 3 dimensions, one of four itemsizes) and a region of it: any start, stop and step per
    dimension, negative steps and empty ones included."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 40)) for _ in range(ndim))
    dtype = draw(st.sampled_from([np.uint8, np.uint16, np.float32, np.int64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tile = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    tile = tile.reshape(shape)
    index = tuple(slice(draw(st.integers(0, n)), draw(st.integers(0, n)), draw(st.sampled_from([1, 1, 2, -1])))
                  for n in shape)
    return tile, tile[index]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regions())
def test_a_region_digests_as_its_packed_bytes(path, case):
    tile, view = case
    assert digest_views(view) == xxhash.xxh3_64_intdigest(np.ascontiguousarray(view).tobytes())
    joined = np.ascontiguousarray(view).tobytes() + tile.tobytes() + np.ascontiguousarray(view[..., :1]).tobytes()
    assert digest_views(view, tile, view[..., :1]) == xxhash.xxh3_64_intdigest(joined)


def test_no_views_and_empty_views_digest_as_no_bytes(path):
    empty = xxhash.xxh3_64_intdigest(b"")
    assert digest_views() == empty
    assert digest_views(np.zeros((3, 0), np.uint16), np.zeros(0, np.uint8)) == empty
    assert digest_views(np.array(7, np.int64)) == xxhash.xxh3_64_intdigest(np.array(7, np.int64).tobytes())
