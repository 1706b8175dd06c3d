"""A Prepare carries its reads as columns (`PrepareRequest.read_tensors`, ``read_names``, ``read_versions``): a
state dict's job reads a hundred thousand tensors, and a message per read cost the planner more than a microsecond
each. The agent reads them back in the order sent (which the ticket signs), each tensor its own stored name where
the request names none, and refuses columns of different lengths, naming them."""

from __future__ import annotations

import pytest

from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.server.common.contract import prepare_reads


def test_reads_come_back_in_order_with_their_own_names_where_none_are_given():
    r = pb.PrepareRequest(job="j", read_tensors=["b", "a"], read_versions=[3, 1])
    assert list(prepare_reads(r).items()) == [("b", ("b", 3)), ("a", ("a", 1))]
    r = pb.PrepareRequest(job="j", read_tensors=["x@0", "out"], read_names=["x", "y"], read_versions=[2, 5])
    assert prepare_reads(r) == {"x@0": ("x", 2), "out": ("y", 5)}
    assert prepare_reads(pb.PrepareRequest(job="j")) == {}


@pytest.mark.parametrize("names, versions", [(["x"], [1, 2]), ([], [1]), (["x", "y", "z"], [1, 2])])
def test_columns_of_different_lengths_are_refused_naming_them(names, versions):
    r = pb.PrepareRequest(job="job-1", read_tensors=["a", "b"], read_names=names, read_versions=versions)
    with pytest.raises(InvalidArgumentError, match=rf"Prepare of job 'job-1' reads 2 tensors with {len(names)} "
                                                   rf"stored names and {len(versions)} versions"):
        prepare_reads(r)
