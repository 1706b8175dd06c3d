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


class _Recording:
    """`AgentCalls` that only record: these tests are of the planner's checks, which come before any agent's part."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name):
        return lambda host, *args, **kw: self.calls.append((name, host))


def test_a_quantizing_sync_is_checked_again_only_where_its_tensors_dtypes_differ_from_its_last_check(monkeypatch):
    import json

    from reshard.server.common.config import PlannerConfig
    from reshard.server.planner.control import Planner

    planner = Planner(PlannerConfig(heartbeat_timeout_s=600), _Recording())
    try:
        for h in ("a", "b"):
            planner.register(h, 1, f"{h}:1", 10.0, secret=f"{h}-secret-0123456789".encode())
        shape, src = (256, 256), ROWS
        planner.catalog.add(TensorRecord("w", shape, "bfloat16", src, 1))
        checks = []
        check = planner._check_sync
        monkeypatch.setattr(planner, "_check_sync", lambda sync: checks.append(sync.id) or check(sync))

        def publish() -> None:  # the trainer's next step, in its own dtype and layout
            version = planner.catalog.next_version("w")
            planner.catalog.commit([(None, TensorRecord("w", shape, "bfloat16", src, version))])

        def run() -> object:
            job = planner.sync(sync.id)
            assert job.done_event.wait(30) and job.state == "succeeded", job.error
            return job

        sync = planner.register_sync([("w", json.dumps(COLS.to_json()))], "auto", None, [("w", "w_scale", None)],
                                     dtypes={"w": "float8_e4m3fn"})
        assert len(checks) == 1
        first = run()
        assert planner.catalog.get("w").dtype == "float8_e4m3fn" and planner.catalog.contains("w_scale")
        publish()
        run()  # its scale is a new name since the check: checked again
        assert len(checks) == 2
        for _ in range(2):  # each step: fp8 committed, bf16 published again: the dtypes it was checked with
            publish()
            job = run()
            assert len(checks) == 2 and job.ran.id == first.ran.id
        assert planner.catalog.get("w").dtype == "float8_e4m3fn"
        # run again before the trainer publishes: the weight is fp8 already, so the request is checked again, and
        # the job moves it as it is
        job = run()
        assert len(checks) == 3 and job.dtypes == {} and job.ran.id != first.ran.id
    finally:
        planner.close()


def test_a_brief_job_info_leaves_out_what_grows_with_the_job():
    from reshard.server.planner.jobs import Job
    from reshard.server.planner.service import job_info

    names = [f"t{i}" for i in range(1000)]
    job = Job("j" * 32, names[0], None, "auto", state="running", kind="reshard_many", inputs=names,
              versions=dict.fromkeys(names, 2), transports=["grpc"] * 5000,
              deltas={n: {"mode": "full", "why": "", "bytes": 1, "full_bytes": 1, "expected": 1} for n in names})
    job.progress = {"a": [5, 10]}
    whole, brief = job_info(job), job_info(job, brief=True)
    columns = whole.columns
    assert len(columns.names.split("\n")) == len(columns.versions) == len(columns.delta_modes) == 1000
    assert len(columns.transports) == 5000 and list(columns.texts) == ["full", "", "grpc"]
    assert not (brief.HasField("columns") or brief.inputs or brief.versions or brief.deltas or brief.transports)
    assert not (whole.inputs or whole.versions or whole.deltas or whole.transports)  # in the columns only
    assert (brief.id, brief.state, brief.tensor, list(brief.progress)) == (whole.id, whole.state, whole.tensor,
                                                                          list(whole.progress))
    assert len(brief.SerializeToString()) < len(whole.SerializeToString()) // 50
    assert job.inputs == names and len(job.transports) == 5000  # the job itself keeps them


def test_a_whole_job_info_carries_versions_deltas_and_transports_in_columns_the_client_reads_back():
    """A finished state-dict job's reply in columns (`job_columns`, `client._per_tensor`): the same versions,
    delta report and transports as one message per tensor gave, in 0.8 of the 3.6 ms (501 tensors) and 0.5 of the
    1.6 s (139,583) that building, sending and reading those took."""
    from reshard.client.client import _result
    from reshard.proto import reshard_pb2 as pb
    from reshard.server.planner.jobs import Job
    from reshard.server.planner.service import job_info

    report = {"w": ("delta", "base v1 -> v2; change rate unknown: trying a delta", 10, 40),
              "w.scale": ("full", "the block scales of 'w', made on the way as it is quantized", 4, 4),
              "b": ("full", "no base pair held (the tensor's first sync, or its pair expired)", 8, 8)}
    job = Job("j" * 32, "w", None, "auto", state="succeeded", kind="reshard_many", inputs=["w", "b", "read.only"],
              versions={"w": 2, "b": 5, "w.scale": 2, "made": 1}, transports=["nixl", "local", "nixl"],
              deltas={n: {"mode": m, "why": y, "bytes": b, "full_bytes": f, "expected": b}
                      for n, (m, y, b, f) in report.items()})
    got = _result(pb.JobInfo.FromString(job_info(job).SerializeToString()))
    assert got.versions == {"w": 2, "b": 5, "w.scale": 2, "made": 1}
    assert got.deltas == {n: {"mode": m, "why": y, "bytes": b, "full_bytes": f} for n, (m, y, b, f) in report.items()}
    assert got.transports == ("nixl", "local", "nixl")
    empty = _result(pb.JobInfo.FromString(job_info(Job("k" * 32, "t", None, "auto")).SerializeToString()))
    assert (empty.versions, empty.deltas, empty.transports) == ({}, {}, ())
    old = pb.JobInfo(id="j", versions={"w": 2}, transports=["grpc"],  # a planner from before the columns
                     deltas=[pb.TensorDelta(name="w", mode="full", why="delta off", bytes=1, full_bytes=1)])
    assert (_result(old).versions, _result(old).transports) == ({"w": 2}, ("grpc",))
    assert _result(old).deltas == {"w": {"mode": "full", "why": "delta off", "bytes": 1, "full_bytes": 1}}


def test_a_running_job_s_reply_reads_what_its_runner_adds_meanwhile_once():
    """A job's reply is built while its runner still adds to it (its transports as each host reports, its delta
    report on a thread of its own): each column comes from one reading, not from several that see more each time
    (a reshard's reply failed INTERNAL with KeyError 'nixl' as its transport came in while the reply was built)."""
    from reshard.server.planner.jobs import Job
    from reshard.server.planner.service import job_info

    class Growing(list):  # the runner appends a transport each time the reply reads them
        def __iter__(self):
            items = list(super().__iter__())
            self.append("nixl")
            return iter(items)

    class Reporting(dict):  # the delta report adds a tensor each time the reply reads it
        def values(self):
            got = list(super().values())
            self[f"t{len(self)}"] = {"mode": "full", "why": "late", "bytes": 1, "full_bytes": 1, "expected": 1}
            return got

    job = Job("r" * 32, "w", None, "auto", state="running", kind="reshard", inputs=["w"], versions={"w": 3},
              transports=Growing(["local"]),
              deltas=Reporting(w={"mode": "full", "why": "first", "bytes": 2, "full_bytes": 2, "expected": 2}))
    columns = job_info(job).columns
    names = columns.names.split("\n")
    assert len(names) == len(columns.versions) and len(columns.delta_modes) == len(columns.delta_whys)
    assert all(0 <= i < len(columns.texts) for i in [*columns.transports, *columns.delta_modes, *columns.delta_whys])
    assert [columns.texts[i] for i in columns.transports][0] == "local"
