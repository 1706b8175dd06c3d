"""A job's staged destination tiles: every box a stream delivers is checked to lie inside its device's tile, and
where it lies is remembered for the program's later runs (a weight sync delivers the same boxes every step)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding, TensorDecl
from reshard.proto.errors import InvalidArgumentError
from reshard.server.agent.staging import StagedTiles, tile_plan


def test_every_new_box_is_checked_and_only_those_inside_are_remembered():
    mesh = Mesh.from_hosts({"x": 2}, ["h0"], 2)
    decl = TensorDecl("t", (4, 6), "float32", None, Sharding(mesh, ("x", None)))  # made by the program: no src
    plan = tile_plan(decl, decl.dst.tiles(decl.shape))
    inside, outside = ((2, 3), (1, 6)), ((1, 3), (0, 6))
    for run in range(2):  # the second run finds the first one's place
        staged = StagedTiles(f"job{run}", decl, "t", "owner", None, 0, np.zeros, False, plan, [], reserve=False)
        staged.write("h0/1", inside, np.full((1, 5), run + 1, np.float32))
        with pytest.raises(InvalidArgumentError, match=r"is not inside device h0/1's destination tile of 't'"):
            staged.write("h0/1", outside, np.ones((2, 6), np.float32))
        with pytest.raises(InvalidArgumentError, match="is not inside"):
            staged.mark("h0/1", outside)
        assert staged.short() == {"h0/0": 12, "h0/1": 12 - 5}
        want = np.zeros((2, 6), np.float32)
        want[0, 1:] = run + 1
        assert np.array_equal(staged.buffers["h0/1"], want)
    assert list(plan.places) == [("h0/1", inside)]
