"""A reshard_many request made again as it was is not checked again while nothing its checks read has changed: the
planner remembers it by its digest (`Planner._repeated`), as a registered sync is remembered by its id."""

from __future__ import annotations

import json

import pytest

from reshard import Mesh, Sharding
from reshard.proto.errors import DataLossError, FailedPreconditionError, NotFoundError
from reshard.server.common.config import PlannerConfig
from reshard.server.planner.catalog import TensorRecord
from reshard.server.planner.control import REPEATS_KEPT, Planner

MESH = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)
ROWS, COLS = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))
SHAPE = (8, 8)


class _Recording:
    """`AgentCalls` that only record: the checks tested come before any agent's part."""

    def __getattr__(self, name):
        return lambda host, *args, **kw: None


@pytest.fixture
def planner(monkeypatch):
    p = Planner(PlannerConfig(heartbeat_timeout_s=600), _Recording())
    for h in ("a", "b"):
        p.register(h, 1, f"{h}:1", 10.0, secret=f"{h}-secret-0123456789".encode())
    p.catalog.add(TensorRecord("w", SHAPE, "float32", ROWS, 1))
    p.checks = []
    check = p._many_job
    monkeypatch.setattr(p, "_many_job", lambda *a: p.checks.append(a[0]) or check(*a))
    yield p
    p.close()


def _publish(p: Planner, name: str = "w") -> int:
    """The trainer's next version of ``name``, in the training layout."""
    version = p.catalog.next_version(name)
    p.catalog.commit([(None, TensorRecord(name, SHAPE, "float32", ROWS, version))])
    return version


def _many(p: Planner, dst: Sharding = COLS, **kw):
    job = p.reshard_many([("w", json.dumps(dst.to_json()))], "auto", None, [], **kw)
    assert job.done_event.wait(30) and job.state == "succeeded", job.error
    return job


def test_a_request_made_again_is_checked_once_and_its_job_moves_the_current_version(planner):
    _many(planner)
    for _ in range(3):  # each step: a new version published, the same request
        version = _publish(planner)
        job = _many(planner)
        assert job.versions == {"w": version + 1}, job.versions  # the job's own version, over the published one
        assert planner.catalog.get("w").sharding == COLS
    assert len(planner.checks) == 1


def test_what_a_check_reads_changing_checks_the_request_again(planner):
    _many(planner)
    _many(planner, ROWS)  # another destination: another request
    assert len(planner.checks) == 2
    planner.catalog.add(TensorRecord("b", (2, 2), "float32", ROWS, 1))  # a new name in the catalog
    _many(planner, ROWS)
    assert len(planner.checks) == 3
    # an agent registers again, restarted: the tiles it held are gone, which the check finds, as the first time
    planner.register("a", 1, "a:2", 10.0, secret=b"a-secret-0123456789")
    for _ in range(2):
        with pytest.raises(DataLossError, match="lost every copy when the agents of hosts \\['a'\\] restarted"):
            planner.reshard_many([("w", json.dumps(ROWS.to_json()))], "auto", None, [])
    assert len(planner.checks) == 5


def test_a_step_is_checked_every_time_and_a_stale_one_refused_at_the_request(planner):
    def publish(step: int) -> None:
        planner.catalog.commit([(None, TensorRecord("w", SHAPE, "float32", ROWS, planner.catalog.next_version("w"),
                                                    step=step))])

    publish(7)
    _many(planner, step=7)
    publish(8)
    with pytest.raises(FailedPreconditionError, match="step 7 names 'w'"):
        planner.reshard_many([("w", json.dumps(COLS.to_json()))], "auto", None, [], step=7)
    _many(planner, step=8)
    assert len(planner.checks) == 3


def test_a_tensor_deleted_since_is_refused_as_the_first_time(planner):
    _many(planner)
    planner.catalog.delete("w")
    for _ in range(2):
        with pytest.raises(NotFoundError, match="'w'"):
            planner.reshard_many([("w", json.dumps(COLS.to_json()))], "auto", None, [])
    assert len(planner.checks) == 3  # a refused request is not remembered


def test_the_planner_remembers_the_last_few_requests(planner):
    meshes = [Mesh.from_hosts({"x": 2}, ["a", "b"], 1)] + [Mesh.from_hosts({"x": 1}, [h], 1) for h in "ab"]
    dsts = [Sharding(m, s) for m in meshes for s in (("x", None), (None, "x"), (None, None))][:REPEATS_KEPT + 1]
    for dst in dsts:
        _many(planner, dst)
    assert len(planner.checks) == len(dsts)
    _many(planner, dsts[-1])  # remembered
    _many(planner, dsts[0])  # the least recently used: forgotten
    assert len(planner.checks) == len(dsts) + 1


def test_a_request_made_again_finds_its_program_as_a_registered_sync_does(planner):
    # Its job keeps its program under the request's digest, by the objects it read (`Job.kept_as`); it is not a
    # registered sync's job (none can be run by that digest), and another request keeps its own
    first = _many(planner)
    assert first.kept_as and first.sync == "" and first.slots is not None
    kept = planner.jobs._sync_programs[first.kept_as]
    assert kept.dsts is first.dsts and kept.hit[0] is first.program
    _publish(planner)
    again = _many(planner)
    assert again.kept_as == first.kept_as and again.dsts is first.dsts and again.program is first.program
    assert list(again.slots) == list(planner.catalog.slots(["w"]))
    other = _many(planner, ROWS)
    assert other.kept_as not in ("", first.kept_as) and other.program is not first.program
    assert _many(planner).kept_as == first.kept_as  # the first request again
