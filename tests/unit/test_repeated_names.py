"""A request that names a tensor twice is refused, naming it, in time linear in the request's size."""

import pytest

from reshard import Mesh, Sharding
from reshard.proto.errors import InvalidArgumentError
from reshard.server.planner.catalog import KINDS, Catalog, Uploads, repeated_names

SHARDING = Sharding(Mesh.from_hosts({"x": 1}, ["h0"], 1), (None,))


def test_repeated_names_lists_each_name_given_twice_or_more_once_sorted():
    assert repeated_names(["b", "a", "c", "b", "a", "b"]) == ["a", "b"]
    assert repeated_names(["a", "b"]) == [] and repeated_names([]) == []


def test_a_ten_thousand_tensor_put_many_names_its_repeated_tensor_and_opens_nothing():
    uploads = Uploads(Catalog(), timeout_s=60.0)
    kind = next(iter(KINDS))
    tensors = [(f"layers.{i}.w", (4,), "float32", SHARDING, kind) for i in range(10_000)]
    with pytest.raises(InvalidArgumentError, match=r"put_many names tensors \['layers.7.w'\] more than once"):
        uploads.begin_group(tensors + [tensors[7]])
    group, ups = uploads.begin_group(tensors)  # nothing was held open by the refused request
    assert len(ups) == 10_000
