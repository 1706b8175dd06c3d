"""A group of uploads shared by the ranks of one publish (`Uploads.begin_group` with a key), in memory: every rank
joins it by the key with the same declarations, or is refused naming the first difference; it is complete, and
committed by exactly one caller, only when every device of every tensor is in; and when it expires, the callers that
wait learn which devices never came."""

import pytest

from reshard import Mesh, Sharding
from reshard.proto.errors import InvalidArgumentError, NotFoundError
from reshard.server.planner.catalog import Catalog, Uploads

MESH = Mesh({"x": 2}, ["h0/0", "h1/0"])
ROWS = Sharding(MESH, ("x", None))
WHOLE = Sharding(Mesh({"r": 1}, ["h0/0"]), (None,))
TENSORS = [("w", (5, 3), "float32", ROWS, "torch"), ("b", (3,), "float32", WHOLE, "torch")]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ranks_join_one_group_by_its_key_and_only_the_last_device_in_commits():
    uploads = Uploads(Catalog(), timeout_s=60.0)
    group, ups = uploads.begin_group(TENSORS, step=4, key="k1")
    again, same = uploads.begin_group(TENSORS, step=4, key="k1")
    assert (again, same) == (group, ups) and all(u.per_shard for u in ups)
    w, b = ups
    _, commit, missing = uploads.mark_group(group, [(w.id, ["h0/0"]), (b.id, ["h0/0"])])
    assert (commit, missing) == (False, ["h1/0"])
    assert uploads.outcome(group) is None  # still open
    _, commit, missing = uploads.mark_group(group, [(w.id, ["h1/0"])])
    assert (commit, missing) == (True, [])
    assert uploads.mark_group(group, [])[1] is False  # only one caller commits
    uploads.close_group(group)
    assert uploads.outcome(group, wait_s=0.0) == ""  # committed, as a waiting rank learns
    assert uploads.is_shared(group)
    other, _ = uploads.begin_group(TENSORS, step=5, key="k1")  # the key is free once its group ended
    assert other != group


@pytest.mark.parametrize("change, message", [
    (lambda t: t[:1], r"upload group k2 was opened with 2 tensors and this caller declares 1: tensor 1 is nothing "
                      r"here but 'b' in the group; every rank of a publish declares the same tensors, in the same "
                      r"order, with the same step"),
    (lambda t: t[::-1], r"tensor 0 is 'b' here but 'w' in the group"),
    (lambda t: [t[0], ("b", (4,), "float32", WHOLE, "torch")],
     r"upload group k2: tensor 'b' is declared with shape \(4,\) here but \(3,\) in the group"),
])
def test_a_rank_declaring_other_tensors_is_refused_naming_the_first_difference(change, message):
    uploads = Uploads(Catalog(), timeout_s=60.0)
    uploads.begin_group(TENSORS, step=1, key="k2")
    with pytest.raises(InvalidArgumentError, match=message):
        uploads.begin_group(change(TENSORS), step=1, key="k2")
    with pytest.raises(InvalidArgumentError, match=r"tensor 'w' is declared with step 2 here but 1 in the group"):
        uploads.begin_group(TENSORS, step=2, key="k2")


def test_a_group_a_rank_left_expires_and_the_waiting_ranks_learn_which_devices_never_came():
    clock = _Clock()
    uploads = Uploads(Catalog(), timeout_s=3.0, clock=clock)
    group, (w, b) = uploads.begin_group(TENSORS, key="k3")
    uploads.mark_group(group, [(w.id, ["h0/0"]), (b.id, ["h0/0"])])
    with pytest.raises(InvalidArgumentError, match=r"upload 12345678 is not one of group .{8}'s 2 uploads"):
        uploads.mark_group(group, [("12345678" * 4, ["h0/0"])])
    clock.now = 2.0
    assert uploads.expired() == []
    clock.now = 5.5
    assert {u.id for u in uploads.expired()} == {w.id, b.id}
    assert uploads.outcome(group) == (
        f"upload group {group[:8]} of 2 tensors expired after 3s without activity, before devices ['h1/0'] handed "
        f"over their shards (did a rank die midway?); nothing of it was committed: publish again from every rank")
    with pytest.raises(NotFoundError, match="no upload group"):
        uploads.mark_group(group, [(w.id, ["h1/0"])])
    uploads.begin_group(TENSORS, key="k3")  # the names are free again
