"""What a registered sync's job reads in array operations: the catalog's columns agree with its records through
every change, a column claim takes every tensor or none, the job runner's hold on tensors is all or nothing and
first come, first served (real threads), and a quantizing sync's job hands the agents the reads its general way
does."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import numpy as np

from reshard import Mesh, Sharding
from reshard.server.common.config import PlannerConfig
from reshard.server.planner.catalog import Catalog, TensorRecord, bumped
from reshard.server.planner.control import Planner
from reshard.server.planner.jobs import Preparation
from reshard.server.planner.locks import TensorLocks

MESH = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)
ROWS, COLS = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))
WAIT_S = 10.0


def _catalog(n: int, step: int | None = None) -> tuple[Catalog, list[str], np.ndarray]:
    cat = Catalog()
    names = [f"t{i}" for i in range(n)]
    cat.commit([(None, TensorRecord(name, (4, 4), "float32", ROWS, 1, step=step)) for name in names])
    return cat, names, cat.slots(names)


def test_a_column_claim_gives_each_tensor_its_next_version_and_the_columns_follow_every_change():
    cat, names, slots = _catalog(5, step=3)
    versions, layouts, dtypes = cat.claim_current(slots, 3)
    assert versions.tolist() == [1] * 5 and layouts.tolist() == [id(ROWS)] * 5
    assert (dtypes == cat.dtype_ids(["float32"])[0]).all()
    # claimed: a second claim, by columns or by names, numbers above it; unclaimed, the claim is the same again
    assert cat.claim_current(slots) is None
    assert cat.claim(names[:1]) == {"t0": 3}
    cat.unclaim(names, slots)
    assert cat.claim_current(slots)[0].tolist() == [1] * 5
    cat.unclaim(names)
    # a step label that is not the current version's: no claim by columns (the job's own way names the label)
    assert cat.claim_current(slots, 4) is None
    assert cat.claim(names) == dict.fromkeys(names, 2)
    cat.unclaim(names, slots)
    # a commit in another sharding and dtype, a delete, a new name: the columns say what the records say
    old = cat.get("t1")
    cat.swap(old, replace(bumped(old, COLS, 2), dtype="bfloat16"))
    cat.delete("t2")
    assert cat.claim_current(slots) is None  # t2 has no current version
    kept = [0, 1, 3, 4]
    versions, layouts, dtypes = cat.claim_current(slots[kept])
    assert versions.tolist() == [1, 2, 1, 1]
    assert layouts.tolist() == [id(ROWS), id(COLS), id(ROWS), id(ROWS)]
    assert dtypes.tolist() == cat.dtype_ids(["float32", "bfloat16", "float32", "float32"]).tolist()
    cat.unclaim([names[i] for i in kept], slots[kept])
    fresh = cat.slots(["new"])
    assert fresh[0] not in slots and cat.claim_current(fresh) is None
    # restored from records (a restarted planner): the same columns
    again = Catalog()
    again.load(cat.list())
    assert again.claim_current(again.slots([names[i] for i in kept]))[0].tolist() == [1, 2, 1, 1]


def test_a_column_claim_waits_while_an_upload_of_one_of_its_tensors_commits():
    cat, names, slots = _catalog(3)
    claimed = []
    with cat.publishing(["t1"]) as versions:
        assert versions == {"t1": 2}
        t = threading.Thread(target=lambda: claimed.append(cat.claim_current(slots)))
        t.start()
        time.sleep(0.2)
        assert not claimed  # waits for the upload's commit
        cat.commit([(None, TensorRecord("t1", (4, 4), "float32", ROWS, 2))])
    t.join(WAIT_S)
    assert claimed[0][0].tolist() == [1, 2, 1]


def test_the_hold_on_tensors_is_all_or_nothing():
    locks = TensorLocks(size=4)  # grows as slots beyond it come
    order: list[str] = []
    small, other = threading.Event(), threading.Event()
    both = np.array([1, 700])

    def job(name: str, slots: np.ndarray, held: threading.Event, release: threading.Event) -> None:
        with locks.hold(slots):
            order.append(name)
            held.set()
            release.wait(WAIT_S)

    a_held, a_go = threading.Event(), threading.Event()
    a = threading.Thread(target=job, args=("a", np.array([1]), a_held, a_go))
    a.start()
    assert a_held.wait(WAIT_S)
    # b names 1 (held) and 700: it takes neither while it waits, so c takes 700's neighbour freely
    b_held = threading.Event()
    b = threading.Thread(target=job, args=("b", both, b_held, small))
    b.start()
    c_held = threading.Event()
    c = threading.Thread(target=job, args=("c", np.array([699]), c_held, other))
    c.start()
    assert c_held.wait(WAIT_S) and not b_held.is_set()
    a_go.set()
    assert b_held.wait(WAIT_S)
    small.set()
    other.set()
    for t in (a, b, c):
        t.join(WAIT_S)
    assert order == ["a", "c", "b"]


def test_a_job_that_waits_is_not_passed_by_later_jobs_on_its_tensors():
    """A state dict's job waiting for one tensor is not starved by a stream of small jobs on its others."""
    locks = TensorLocks()
    order: list[str] = []
    first_held, first_go = threading.Event(), threading.Event()

    def first() -> None:
        with locks.hold(np.array([0])):
            first_held.set()
            first_go.wait(WAIT_S)
            order.append("first")

    def job(name: str, slots: np.ndarray) -> None:
        with locks.hold(slots):
            order.append(name)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert first_held.wait(WAIT_S)
    threads.append(threading.Thread(target=job, args=("big", np.arange(100))))
    threads[-1].start()
    time.sleep(0.2)  # big waits for slot 0
    threads.append(threading.Thread(target=job, args=("small", np.array([50]))))
    threads[-1].start()
    time.sleep(0.2)
    assert order == []  # small names a tensor big waits for: it waits behind big
    first_go.set()
    for t in threads:
        t.join(WAIT_S)
    assert order == ["first", "big", "small"]


class _Capturing:
    """`AgentCalls` that record each job's `Preparation` and do nothing else: what the planner hands the agents."""

    def __init__(self):
        self.preparations = {}

    def __getattr__(self, name):
        def call(host, *args, **kw):
            for a in args:
                if isinstance(a, Preparation):
                    self.preparations[a.job] = a
        return call


def _reads(prep: Preparation) -> dict:
    if prep.columns is None:
        return dict(prep.reads)
    tensors, names, versions = prep.columns
    return dict(zip(tensors, zip(names, versions.tolist())))


def test_a_quantizing_sync_moving_whole_hands_the_agents_the_reads_its_general_way_does():
    """The columns' way (`JobRunner._sync_work`) against the general one, on the same sync a step apart: the same
    reads (a quantized weight and its scale at the versions claimed, the weight as held under its source name,
    the rest at their own), the same versions claimed and the same records committed."""
    planner = Planner(PlannerConfig(heartbeat_timeout_s=600), _Capturing())
    try:
        for h in ("a", "b"):
            planner.register(h, 1, f"{h}:1", 10.0, secret=f"{h}-secret-0123456789".encode())
        steps = iter(range(10))

        def publish() -> int:  # the trainer's next step, in its own dtypes and layout, labeled
            step = next(steps)
            planner.catalog.commit([(None, TensorRecord(n, (256, 256), d, ROWS, planner.catalog.next_version(n),
                                                        step=step)) for n, d in (("w", "bfloat16"), ("n", "float32"))])
            return step

        def run(step: int):  # the step's sync, naming it (the scale the job made is labeled the step before)
            job = planner.sync(sync.id, step=step, delta=False)
            assert job.done_event.wait(30) and job.state == "succeeded", job.error
            return job, planner.agents.preparations[job.id]

        cols = json.dumps(COLS.to_json())
        publish()
        sync = planner.register_sync([("w", cols), ("n", cols)], "auto", None, [("w", "w_s", None)],
                                     dtypes={"w": "float8_e4m3fn"})
        run(publish())
        general, prep = run(publish())  # the scale is in the catalog now: the general way keeps the sync's reads
        assert prep.columns is None and set(prep.reads) == {"n", "w", "w_s", "w~bfloat16"}
        reads = _reads(prep)
        by_columns, prep = run(publish())
        assert prep.columns is not None and prep.reads == {}
        # a step on: the trainer's tensors two versions on (its put, the sync's commit), the scale one (the sync's)
        on = {"w": 2, "n": 2, "w_s": 1}
        assert _reads(prep) == {t: (n, v + on[n]) for t, (n, v) in reads.items()}
        assert by_columns.versions == {n: v + on[n] for n, v in general.versions.items()}
        assert by_columns.ran.id == general.ran.id
        assert planner.catalog.get("w").dtype == "float8_e4m3fn" and planner.catalog.get("w").sharding == COLS
        assert planner.catalog.get("w_s").version == by_columns.versions["w_s"]
        assert "quantized on the way, bfloat16 -> float8_e4m3fn" in by_columns.deltas["w"]["why"]
    finally:
        planner.close()
