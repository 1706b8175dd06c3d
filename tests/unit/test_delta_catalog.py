"""The catalog's side of delta sync (issue 40), in memory: content ids through uploads and reshards, and each
tensor's base pair: held like a pin, replaced by the next sync (freeing what only it held), saved and read back,
expired, dropped with its name, and never held by a catalog without delta (--no-delta). And the job runner's
fallback: a run whose agents report a base mismatch runs again with that tensor moved whole."""

from __future__ import annotations

from reshard import Mesh, Sharding
from reshard.server.planner.catalog import Catalog, TensorRecord, Uploads, bumped
from reshard.server.planner.state import StateStore

MESH = Mesh.from_hosts({"x": 2}, ["h0"], 2)
TRAIN, SERVE = Sharding(MESH, ("x", None)), Sharding(MESH, (None, "x"))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def upload(cat: Catalog, name: str = "w", store: StateStore | None = None) -> TensorRecord:
    """Publish ``name``'s next version in TRAIN through an upload transaction's record (a fresh content id); saved
    in ``store`` as the planner saves a commit's records."""
    up = Uploads(cat, 60.0).begin(name, (4, 4), "float32", TRAIN, "numpy", per_shard=False)
    cat.commit([(None, up.record)])
    if store is not None:
        store.save_tensor(name, up.record.json_text())
    return cat.get(name)


def sync(cat: Catalog, name: str = "w", store: StateStore | None = None) -> tuple[list[TensorRecord], TensorRecord]:
    """A reshard_many's commit of ``name`` into SERVE: the freed versions and the new record."""
    old = cat.get(name)
    new = bumped(old, SERVE)
    freed = cat.commit([(old, new)], bases={name: (old.version, new.version)})
    if store is not None:
        store.save_tensor(name, new.json_text())
    return freed, new


def held(cat: Catalog, name: str = "w") -> list[tuple[int, int]]:
    return [(r.version, pins + base) for r, pins, base in cat.versions(name)]  # every hold: pins and the pair


def test_an_upload_gets_a_fresh_content_id_and_a_reshard_copies_its_sources():
    cat = Catalog()
    v1 = upload(cat)
    v2 = upload(cat)
    assert v1.content and v2.content and v1.content != v2.content
    moved = bumped(v2, SERVE)
    assert moved.content == v2.content
    # Saved and read back with the record; a record saved before content ids reads back as unknown ("").
    assert TensorRecord.from_json(moved.to_json()) == moved
    assert '"content": "' + moved.content + '"' in moved.json_text()
    old = moved.to_json()
    del old["content"]
    assert TensorRecord.from_json(old).content == ""


def test_a_sync_holds_its_base_pair_and_the_next_one_frees_it():
    cat = Catalog()
    a = upload(cat)
    freed, b = sync(cat)
    assert freed == []  # a stays: the pair holds it, though b superseded it
    assert held(cat) == [(a.version, 1), (b.version, 1)]
    c = upload(cat)
    assert held(cat) == [(a.version, 1), (b.version, 1), (c.version, 0)]  # b kept by the pair
    pairs = cat.bases(["w", "other"])
    assert list(pairs) == ["w"]
    pair, src, dst = pairs["w"]
    assert (pair.src, pair.dst) == (a.version, b.version) and (src, dst) == (a, b)
    assert src.content == dst.content != c.content
    freed, d = sync(cat)  # c -> d: (c, d) replaces (a, b), which nothing else holds
    assert sorted(r.version for r in freed) == [a.version, b.version]
    assert held(cat) == [(c.version, 1), (d.version, 1)]
    assert cat.base_pairs()["w"].src == c.version


def test_a_pin_outlives_the_pair_on_the_same_version():
    cat = Catalog()
    upload(cat)
    _, b = sync(cat)
    pin = cat.pin(["w"], None)  # on b
    upload(cat)
    freed, _ = sync(cat)
    assert [r.version for r in freed] == [1]  # a; b is pinned
    assert cat.release_pin(pin.id) == [b]


def test_base_pairs_are_saved_and_read_back(tmp_path):
    path = str(tmp_path / "state.db")
    store = StateStore(path)
    cat = Catalog(store)
    a = upload(cat, store=store)
    _, b = sync(cat, store=store)
    upload(cat, store=store)
    again = Catalog(StateStore(path))
    again.restore()
    assert again.base_pairs() == cat.base_pairs()
    assert held(again) == held(cat) == [(a.version, 1), (b.version, 1), (3, 0)]
    freed, _ = sync(again, store=store)  # the restored pair is released like any
    assert sorted(r.version for r in freed) == [a.version, b.version]
    third = Catalog(StateStore(path))
    third.restore()
    assert held(third) == [(3, 1), (4, 1)]


def test_a_pair_expires_unused_and_a_job_that_uses_it_renews_it():
    clock = Clock()
    cat = Catalog(pin_timeout_s=10.0, clock=clock)
    a = upload(cat)
    sync(cat)
    upload(cat)
    clock.now = 8.0
    assert cat.bases(["w"])  # a job reads it: renewed
    clock.now = 16.0
    assert cat.expired_bases() == ([], [])
    clock.now = 18.5
    names, freed = cat.expired_bases()
    assert names == ["w"] and sorted(r.version for r in freed) == [a.version, 2]
    assert cat.bases(["w"]) == {} and held(cat) == [(3, 0)]


def test_delete_drops_the_pair_and_frees_what_it_held(tmp_path):
    store = StateStore(str(tmp_path / "state.db"))
    cat = Catalog(store)
    upload(cat)
    _, b = sync(cat)
    rec, freed = cat.delete("w")
    assert rec == b and sorted(r.version for r in freed) == [1, 2]
    assert cat.base_pairs() == {} and store.delta_bases() == [] and store.held_versions() == []


def test_no_delta_holds_no_pair_and_reads_saved_ones_back_as_expired(tmp_path):
    cat = Catalog(delta=False)
    upload(cat)
    freed, _ = sync(cat)
    assert [r.version for r in freed] == [1] and cat.base_pairs() == {} and held(cat) == [(2, 0)]
    path = str(tmp_path / "state.db")
    store = StateStore(path)
    with_delta = Catalog(store)
    upload(with_delta, store=store)
    sync(with_delta, store=store)
    without = Catalog(StateStore(path), delta=False)
    without.restore()
    names, freed = without.expired_bases()
    assert names == ["w"] and [r.version for r in freed] == [1] and held(without) == [(2, 0)]


# -- a job whose agents find another base: it runs again with the tensor moved whole --------------------------


def test_a_base_mismatch_runs_the_job_again_moving_that_tensor_whole():
    import numpy as np

    from reshard.proto.errors import FailedPreconditionError
    from reshard.server.common.contract import DELTA_BASE_MISMATCH
    from reshard.server.planner.jobs import JobRunner
    from reshard.server.planner.registry import Registry

    from .test_jobs import DST, HOSTS, SHAPE, SRC, RuntimeCalls
    from .test_runtime import Hosts

    class MismatchedBase(RuntimeCalls):
        """The hosts' runtimes, but a run that names delta bases fails as an agent whose base differs does."""

        def __init__(self, hosts):
            super().__init__(hosts)
            self.bases: dict[str, dict] = {}

        def prepare(self, host, address, prep, timeout):
            self.bases[prep.job] = dict(prep.delta_bases)
            super().prepare(host, address, prep, timeout)

        def execute(self, host, address, job, program_id, on_progress, timeout, prepare=None, commit=False):
            if prepare is not None:
                self.bases[job] = dict(prepare.delta_bases)
            if self.bases.get(job):
                raise FailedPreconditionError(f"{DELTA_BASE_MISMATCH}: tensor 't' box [0:19, 0:12] on {host}/0 "
                                              f"differs from the sender's base v1")
            return super().execute(host, address, job, program_id, on_progress, timeout, prepare, commit)

    hosts = Hosts()
    try:
        registry = Registry(heartbeat_timeout_s=60.0)
        for h in HOSTS:  # 1 Gbit/s NICs: slow enough that the default moves a delta (`jobs._delta_pays`)
            registry.register(h, 2, h, 1.0, secret=bytes(16))
        catalog = Catalog()
        calls = MismatchedBase(hosts)
        runner = JobRunner(registry, catalog, StateStore(None), calls, job_timeout_s=30.0, rpc_timeout_s=10.0,
                           max_concurrent=2)
        a = np.arange(np.prod(SHAPE), dtype=np.int32).reshape(SHAPE)
        catalog.add(TensorRecord("t", SHAPE, "int32", SRC, 1, content="c1"))
        hosts.put_tensor("t", a, SRC)
        first = runner.submit_many({"t": DST}, "auto", 0, {})
        assert first.done_event.wait(30) and first.state == "succeeded", first.error
        assert first.deltas["t"]["mode"] == "full"
        b = a + 1
        catalog.commit([(None, TensorRecord("t", SHAPE, "int32", SRC, 3, content="c3"))])
        hosts.put("t", {d: (b[tuple(slice(lo, hi) for lo, hi in box)].copy(), box)
                        for d, box in SRC.tiles(SHAPE).items()}, version=3)
        second = runner.submit_many({"t": DST}, "auto", 0, {})
        assert second.done_event.wait(30) and second.state == "succeeded", second.error
        assert calls.bases[second.id] == {"t": (1, 2)}  # the first run named the pair's versions
        assert calls.bases[f"{second.id}-full"] == {}  # the second moved it whole
        d = second.deltas["t"]
        assert d["mode"] == "full" and d["why"].startswith("fell back: the agents' delta base differed "
                                                          f"({DELTA_BASE_MISMATCH}: tensor 't'"), d
        assert d["bytes"] == d["full_bytes"] > 0
        assert second.delta_note.startswith(f"ran again with 1 tensor moved whole after a delta base mismatch (t): "
                                            f"{DELTA_BASE_MISMATCH}")
        assert catalog.get("t").version == 4 and catalog.base_pairs()["t"].src == 3
        for dev, box in DST.tiles(SHAPE).items():
            got = hosts.stores[dev.split("/")[0]].get("t", 4, dev).array
            assert np.array_equal(got, b[tuple(slice(lo, hi) for lo, hi in box)])
    finally:
        hosts.close()
