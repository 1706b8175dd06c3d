"""What a registered sync relies on between its runs: the catalog's and the registry's counters move exactly when
its checks could read something else; the reads a Prepare carries are signed as columns, in their order; and a
planner without --state writes nothing a restart alone would read."""

from __future__ import annotations

from dataclasses import replace

import pytest

from reshard import Mesh, Sharding
from reshard.server.common.tickets import prepare_fields, reads_digest
from reshard.server.planner.catalog import Catalog, TensorRecord, bumped
from reshard.server.planner.registry import Registry
from reshard.server.planner.state import StateStore

MESH = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)
ROWS, COLS = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))


def test_the_catalog_counts_changes_to_names_shapes_dtypes_and_lost_devices_not_new_versions():
    cat = Catalog()
    w = TensorRecord("w", (4, 4), "float32", ROWS, 1)
    cat.add(w)
    start = cat.declared
    # a new version in another sharding, as a weight sync makes every step: not counted
    moved = bumped(w, COLS, 2)
    cat.swap(w, moved)
    cat.commit([(None, replace(moved, version=3, sharding=ROWS))])
    assert cat.declared == start
    # a new name, lost devices, a delete: each counted
    cat.add(TensorRecord("b", (2,), "float32", ROWS, 1))
    assert cat.declared == start + 1
    assert cat.reconcile("a", set()) and cat.declared == start + 2
    assert cat.reconcile("a", {("w", 3), ("b", 1)}) and cat.declared == start + 3
    assert cat.reconcile("a", {("w", 3), ("b", 1)}) == [] and cat.declared == start + 3
    cat.delete("b")
    assert cat.declared == start + 4


def test_the_registry_counts_registrations():
    reg = Registry(heartbeat_timeout_s=10.0)
    before = reg.generation
    reg.register("a", 1, "a:1", 10.0, secret=bytes(16))
    reg.register("b", 1, "b:1", 10.0, secret=bytes(16))
    assert reg.generation == before + 2


def test_a_claim_numbers_on_from_the_highest_version_held_current_claimed_or_kept():
    cat = Catalog()
    cat.add(TensorRecord("a", (2,), "float32", ROWS, 4))
    cat.add(TensorRecord("b", (2,), "float32", ROWS, 7))
    cat.add(TensorRecord("c", (2,), "float32", ROWS, 1))
    assert cat.claim(["a", "b"]) == {"a": 5, "b": 8}
    # claimed and still in flight: the next claim numbers above it
    assert cat.claim(["a"]) == {"a": 6}
    cat.unclaim(["a", "b"])
    assert cat.claim(["a", "b"]) == {"a": 5, "b": 8}
    cat.unclaim(["a", "b"])
    # deleted while a pin holds its version: a new tensor of the name numbers on from the kept one
    pin = cat.pin(["c"], None)
    cat.delete("c")
    assert cat.claim(["c"]) == {"c": 2}
    cat.release_pin(pin.id)


def test_a_prepares_reads_are_signed_as_columns_in_their_order():
    reads = {"x": ("x", 3), "y@0": ("y", 5)}
    args = ("job", "sha", "x", 1, 2, "grpc", 0, 0, {"a": "a:1"})
    columns = reads_digest(["x", "y@0"], ["x", "y"], [3, 5])
    assert prepare_fields(*args, reads) == prepare_fields(*args, signed_reads=columns)
    assert prepare_fields(*args, reads)[-1] == "reads:" + columns
    # another order, name or version signs another digest
    assert columns != reads_digest(["y@0", "x"], ["y", "x"], [5, 3])
    assert columns != reads_digest(["x", "y@0"], ["x", "z"], [3, 5])
    assert columns != reads_digest(["x", "y@0"], ["x", "y"], [3, 6])
    # no reads, no field
    assert len(prepare_fields(*args, {})) == len(prepare_fields(*args)) == 9


def test_a_store_without_a_path_keeps_the_plans_and_counters_only(tmp_path):
    rec = TensorRecord("w", (4, 4), "float32", ROWS, 1)
    for path, durable in ((None, False), (str(tmp_path / "state.db"), True)):
        store = StateStore(path)
        assert store.durable is durable
        store.save_tensors([("w", rec.json_text())])
        store.save_held_versions([("w", 1, rec.json_text())])
        store.save_job("j", 1.0, "{}")
        store.save_delta_bases([("w", "{}")])
        store.save_plan("p", "{\"plan\": 1}")
        store.save_counter("c", 7)
        assert store.plan("p") == "{\"plan\": 1}" and store.counter("c") == 7
        kept = (store.tensors(), store.held_versions(), store.jobs(), store.delta_bases())
        assert kept == (([rec.to_json()], [rec.to_json()], [{}], [{}]) if durable else ([], [], [], []))
        store.close()


@pytest.mark.parametrize("missing", ["w", "v"])
def test_a_snapshot_names_the_tensor_it_lacks(missing):
    cat = Catalog()
    cat.add(TensorRecord("u", (2,), "float32", ROWS, 1))
    cat.add(TensorRecord({"w": "v", "v": "w"}[missing], (2,), "float32", ROWS, 1))
    with pytest.raises(Exception, match=f"no tensor named '{missing}'"):
        cat.snapshot(["u", "v", "w"])
    assert [r.name for r in cat.current_named(["u"])] == ["u"]
