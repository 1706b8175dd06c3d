"""The ring reduce on bfloat16 (held as uint16 bits): it adds numbers, not bits."""

import numpy as np

from reshard import Mesh, Sharding, reshard_program
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from tests.unit.test_runtime import HOSTS, Hosts


def test_a_bfloat16_partial_sum_is_the_rounded_sum_of_its_addends():
    hosts = Hosts()
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
