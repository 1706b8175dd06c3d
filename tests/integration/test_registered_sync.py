"""A registered sync on real agents: a weight sync's reshard_many checked once (`Client.register_sync`) and run every
step by its id, bit for bit, with the program planned once; what changes under it (a tensor deleted, another source
sharding, an older step asked for) is named, and nothing is lost."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import InvalidArgumentError, JobFailedError, NotFoundError, RegisteredSync
from reshard.client.client import _result
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb

from .test_reshard_many import INFER, TRAIN, _same, _values, state_dict

torch = pytest.importorskip("torch", reason="the state dict is torch tensors (bfloat16, float8)")

TIMEOUT_S = 120


def _next_step(tensors: dict, step: int) -> dict:
    """The state dict a training step later: every weight changed (the scales are the same arrays)."""
    out = {}
    for name, value in tensors.items():
        if isinstance(value, tuple):
            t, sharding = value
            changed = (t.float() + step).to(t.dtype) if t.dtype.is_floating_point and t.dtype.itemsize > 1 else t
            out[name] = (changed, sharding)
        else:
            out[name] = value
    return out


def _delete(c, names) -> None:
    for name in names:
        try:
            c.delete(name)
        except NotFoundError:
            pass


def test_a_registered_sync_runs_every_step_bit_exact_on_the_program_planned_once(client):
    c = client
    tensors, infer, scales = state_dict(2, 256, seed=3)
    try:
        c.put_many(tensors, scales=scales, step=0)
        sync = c.register_sync(infer, scales=scales)
        assert isinstance(sync, RegisteredSync) and sync.num_tensors == len(tensors)
        programs = set()
        for step in range(1, 4):
            if step > 1:  # the trainer publishes the next step in its own layout, as a weight sync's loop does
                tensors = _next_step(tensors, step)
                c.put_many(tensors, scales=scales, step=step)
            result = sync.run(version=step - 1 if step == 1 else step, delta=False).result(timeout=TIMEOUT_S)
            programs.add(result.plan_id)
            got, values = c.get_many(list(tensors)), _values(tensors)
            assert all(_same(got[n], values[n]) for n in tensors), [n for n in tensors if not _same(got[n], values[n])]
            listed = {t.name: t for t in c.tensors()}
            assert all(listed[n].sharding.mesh == INFER for n in tensors)
            assert set(result.versions) == set(tensors)
            # polled brief while it ran (`Job.result`); once ended, a brief reply is whole
            ended = c._planner_call("GetJob", pb.JobRequest(job=result.id, brief=True))
            assert result.versions == _result(ended).versions
            # the job reports when every host started, and how much of that was the planner's: both within the job
            assert 0 < result.handed_s <= result.started_s <= sum(result.phases.values())
        assert len(programs) == 1, programs
    finally:
        _delete(c, tensors)


def test_a_registered_sync_names_what_changed_under_it_and_loses_nothing(client, fresh_name):
    c = client
    a = {f"{fresh_name}_{i}": (np.arange(64, dtype=np.float32).reshape(8, 8) + i, Sharding(TRAIN, ("tp", None)))
         for i in range(3)}
    dst = {n: Sharding(INFER, (None, "tp")) for n in a}
    try:
        c.put_many(a, step=1)
        sync = c.register_sync(dst)
        first = sync.run().result(timeout=TIMEOUT_S)
        # put back in another source layout: the run plans again, and moves it right
        other = {n: (x + 10, Sharding(TRAIN, (None, "tp"))) for n, (x, _) in a.items()}
        c.put_many(other, step=2)
        again = sync.run(version=2).result(timeout=TIMEOUT_S)
        assert again.plan_id != first.plan_id
        got = c.get_many(list(a))
        assert all(np.array_equal(got[n], other[n][0]) for n in a)
        # an older step than the current one: the job fails naming it, and every tensor keeps its version
        before = {t.name: t.version for t in c.tensors() if t.name in a}
        with pytest.raises(JobFailedError, match=rf"tensor .{fresh_name}_0. holds no version labeled step 1"):
            sync.run(version=1).result(timeout=TIMEOUT_S)
        assert {t.name: t.version for t in c.tensors() if t.name in a} == before
        # a tensor deleted: the run is refused at once, naming it; the others stay as they were
        gone = f"{fresh_name}_1"
        c.delete(gone)
        with pytest.raises(NotFoundError, match=f"no tensor named '{gone}'"):
            sync.run()
        got = c.get_many([n for n in a if n != gone])
        assert all(np.array_equal(got[n], other[n][0]) for n in got)
        # a sync the planner does not hold, and a registration that gives what belongs to each run
        with pytest.raises(NotFoundError, match="no registered sync 'nosuchsync'.*register it again"):
            RegisteredSync(c, "nosuchsync", 0).run()
        with pytest.raises(InvalidArgumentError, match="give the step, pin and delta to each Sync"):
            c._planner_call("RegisterSync", pb.ReshardManyRequest(
                targets=[pb.TensorTarget(name=n, dst_json=json.dumps(s.to_json())) for n, s in dst.items()], step=2))
        with pytest.raises(InvalidArgumentError, match="register_sync takes a dict"):
            c.register_sync([("x", dst[gone])])
    finally:
        _delete(c, a)


def test_a_registered_sync_refuses_what_reshard_many_refuses(client, fresh_name):
    c = client
    name = f"{fresh_name}_w"
    c.put(name, np.zeros((8, 8), np.float32), Sharding(TRAIN, ("tp", None)))
    try:
        # (a host no test registers: another registers a "ghost" on this cluster)
        with pytest.raises(InvalidArgumentError, match="unknown device 'never-registered/0'"):
            c.register_sync({name: Sharding(Mesh.from_hosts({"x": 2}, ["never-registered"], 2), ("x", None))})
        with pytest.raises(NotFoundError, match="no tensor named 'nope'"):
            c.register_sync({"nope": Sharding(INFER, (None, "tp"))})
        assert np.array_equal(c.get(name), np.zeros((8, 8), np.float32))
    finally:
        _delete(c, [name])


def test_a_whole_sync_reads_each_tensor_at_its_own_version_and_plans_again_for_another_layout(client, fresh_name):
    """The runs a weight sync makes every step moving whole (`JobRunner._sync_work`, the catalog's columns): at one
    version, at several (one tensor published again alone), and after a source layout changed."""
    c = client
    rows, cols = Sharding(TRAIN, ("tp", None)), Sharding(TRAIN, (None, "tp"))
    names = [f"{fresh_name}_{i}" for i in range(4)]
    dst = {n: Sharding(INFER, (None, "tp")) for n in names}

    def put(offset: float, sharding: Sharding, which=names) -> dict:
        values = {n: np.arange(64, dtype=np.float32).reshape(8, 8) + offset + 100 * i for i, n in enumerate(which)}
        c.put_many({n: (v, sharding) for n, v in values.items()})
        return values

    try:
        held = put(0, rows)
        sync = c.register_sync(dst)
        plans = [sync.run(delta=False).result(timeout=TIMEOUT_S).plan_id]
        for k, (sharding, alone) in enumerate([(rows, False), (rows, True), (cols, False), (cols, True)], 1):
            held.update(put(10 * k, sharding))
            if alone:  # one tensor a version ahead of the others
                held.update(put(10 * k + 5, sharding, names[:1]))
            before = {t.name: t.version for t in c.tensors() if t.name in dst}
            result = sync.run(delta=False).result(timeout=TIMEOUT_S)
            plans.append(result.plan_id)
            assert result.versions == {n: v + 1 for n, v in before.items()}
            got = c.get_many(names)
            assert all(np.array_equal(got[n], held[n]) for n in names), k
            assert all(t.sharding == dst[t.name] for t in c.tensors() if t.name in dst)
        # one program per source layout
        assert plans[0] == plans[1] == plans[2] != plans[3] == plans[4], plans
    finally:
        _delete(c, names)


def test_a_tensor_published_while_a_whole_sync_runs_fails_the_sync_and_keeps_the_upload():
    """A registered sync's job reads its records as it commits (`JobRunner._sync_work`): one published anew while
    the job moved its older version fails the commit, naming it, and every tensor keeps what it held."""
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), ("x", None))
    dst = Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None, "x"))
    with LocalCluster(2, 1, transport="grpc",
                      agent_args=["--rate-limit-mib-s", "2", "--chunk-mib", "0.25"]) as cluster, \
            cluster.connect() as c:
        a = {f"w{i}": np.full((512, 1024), i, np.float32) for i in range(2)}  # 2 MiB each: 2 s to move both
        c.put_many({n: (v, src) for n, v in a.items()})
        sync = c.register_sync(dict.fromkeys(a, dst))
        sync.run(delta=False).result(timeout=TIMEOUT_S)
        c.put_many({n: (v + 1, src) for n, v in a.items()})
        job = sync.run(delta=False)
        deadline = time.monotonic() + 30
        while job.progress()[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        done, total = job.progress()
        assert 0 < done < total, f"the upload must land mid-sync; {done} of {total} bytes were sent"
        new = np.full((512, 1024), 7, np.float32)
        c.put("w0", new, src)
        with pytest.raises(JobFailedError, match=r"tensor 'w0' v3 changed or was deleted during the reshard"):
            job.result(timeout=TIMEOUT_S)
        assert np.array_equal(c.get("w0"), new) and c.info("w0").sharding == src
        assert np.array_equal(c.get("w1"), a["w1"] + 1) and c.info("w1").version == 3
        # and the sync runs again, from what is current now
        sync.run(delta=False).result(timeout=TIMEOUT_S)
        got = c.get_many(list(a))
        assert np.array_equal(got["w0"], new) and np.array_equal(got["w1"], a["w1"] + 1)
        assert all(c.info(n).sharding == dst for n in a)
