"""The catalog's versions and pins, in memory: which versions a commit frees, which a pin keeps, how versions are
numbered while jobs and uploads overlap, when a pin expires, and what a restarted planner reads back."""

from __future__ import annotations

import threading

import pytest

from reshard import Mesh, Sharding
from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from reshard.server.planner.catalog import Catalog, TensorRecord, bumped
from reshard.server.planner.state import StateStore

MESH = Mesh.from_hosts({"x": 2}, ["h0"], 2)
ROWS, COLS = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))


def rec(version: int, step=None, name: str = "w", shape=(4, 4), dtype: str = "float32") -> TensorRecord:
    return TensorRecord(name, shape, dtype, ROWS, version, step=step)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_commit_frees_what_it_supersedes_unless_a_pin_holds_it():
    cat = Catalog()
    assert cat.commit([(None, rec(1, step=0))]) == []
    pin = cat.pin(["w"], None)
    assert cat.commit([(None, rec(2, step=1))]) == []  # v1 is pinned: kept
    assert cat.commit([(None, rec(3, step=2))]) == [rec(2, step=1)]  # v2 is not
    assert [(r.version, n) for r, n, _ in cat.versions("w")] == [(1, 1), (3, 0)]
    assert cat.resolve(["w"], pin.id) == [rec(1, step=0)]
    assert cat.resolve(["w"], step=2) == [rec(3, step=2)]
    assert cat.release_pin(pin.id) == [rec(1, step=0)]
    assert cat.release_pin(pin.id) == []  # idempotent
    assert [r.version for r, _, _ in cat.versions("w")] == [3]


def test_a_step_names_the_newest_version_labeled_so_and_an_absent_one_names_the_steps_held():
    cat = Catalog()
    cat.commit([(None, rec(1, step=7))])
    pin = cat.pin(None, step=7)  # every tensor
    moved = bumped(cat.get("w"), COLS)  # a reshard carries the label
    cat.commit([(cat.get("w"), moved)])
    assert (moved.version, moved.step) == (2, 7)
    assert cat.resolve(["w"], step=7) == [moved]
    cat.commit([(None, rec(3))])
    with pytest.raises(NotFoundError, match=r"tensor 'w' holds no version labeled step 8; it holds v1 \(step 7\), "
                                            r"v3 \(unlabeled\)"):
        cat.pin(["w"], step=8)
    with pytest.raises(NotFoundError, match=f"pin {pin.id[:12]} holds no version of 'b'"):
        cat.resolve(["b"], pin.id)
    with pytest.raises(FailedPreconditionError, match=r"names 'w' v1 \(step 7\), but v3 \(unlabeled\) is current"):
        cat.current_named(["w"], pin.id)


def test_a_new_version_keeps_shape_and_dtype():
    cat = Catalog()
    cat.commit([(None, rec(1))])
    with pytest.raises(InvalidArgumentError, match=r"tensor 'w' is float32\[4, 4\] \(v1\), and a new version keeps "
                                                   r"its shape and dtype: this one is int32\[4, 4\]; delete it first"):
        cat.commit([(None, rec(2, dtype="int32"))])


def test_an_upload_committing_beside_a_job_takes_the_version_after_the_jobs_claim():
    cat = Catalog()
    cat.commit([(None, rec(1))])
    assert cat.claim(["w"]) == {"w": 2}  # a job in flight will commit v2 ...
    with cat.publishing(["w"]) as versions:
        assert versions == {"w": 3}  # ... so an upload committing now takes v3
        claimed = []
        job = threading.Thread(target=lambda: claimed.append(cat.claim(["w"])))
        cat.unclaim(["w"])
        job.start()
        job.join(0.2)
        assert job.is_alive()  # a job starting meanwhile waits for the upload's commit
        cat.commit([(None, rec(3))])
    job.join(5)
    assert claimed == [{"w": 4}]


def test_a_deleted_name_keeps_its_pinned_version_and_numbers_on_above_it():
    cat = Catalog()
    cat.commit([(None, rec(1))])
    pin = cat.pin(["w"], None)
    assert cat.remove("w") == (rec(1), False)
    assert cat.resolve(["w"], pin.id) == [rec(1)]
    assert cat.next_version("w") == 2
    cat.commit([(None, rec(2, shape=(8,)))])  # another shape, after the delete
    assert [r.version for r, _, _ in cat.versions("w")] == [1, 2]


def test_an_unused_pin_expires_and_a_read_renews_it():
    clock = Clock()
    cat = Catalog(pin_timeout_s=10.0, clock=clock)
    cat.commit([(None, rec(1))])
    pin = cat.pin(["w"], None)
    cat.commit([(None, rec(2))])
    clock.now = 8.0
    cat.resolve(["w"], pin.id)
    clock.now = 16.0
    assert cat.expired_pins() == ([], [])
    clock.now = 18.5
    assert cat.expired_pins() == ([pin.id], [rec(1)])
    with pytest.raises(NotFoundError, match=r"it expired after 10s without a read \(the planner's --pin-timeout-s\)"):
        cat.resolve(["w"], pin.id)


def test_a_restarted_catalog_reads_back_its_pins_and_the_versions_they_hold(tmp_path):
    store = StateStore(str(tmp_path / "state.db"))
    cat = Catalog(store)
    for v in (1, 2, 3):
        r = rec(v, step=v * 10)
        cat.commit([(None, r)])
        store.save_tensor(r.name, r.json_text())  # as the planner saves what it commits
        if v == 1:
            pin = cat.pin(["w"], None)
    again = Catalog(StateStore(str(tmp_path / "state.db")))
    again.restore()
    assert [(r.version, r.step, n) for r, n, _ in again.versions("w")] == [(1, 10, 1), (3, 30, 0)]
    assert again.resolve(["w"], pin.id) == [rec(1, step=10)]
    assert again.next_version("w") == 4
    assert again.release_pin(pin.id) == [rec(1, step=10)]
    third = Catalog(StateStore(str(tmp_path / "state.db")))
    third.restore()
    assert [r.version for r, _, _ in third.versions("w")] == [3]
