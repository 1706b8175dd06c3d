"""The store's buffer recycler: released host buffers come back for new tiles, never while anything holds them."""

import mmap

import numpy as np

from reshard.server.agent.store import Recycler, ShardStore, TileBuffer

MiB = 1 << 20


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _commit(store: ShardStore, name: str, version: int, array: np.ndarray) -> None:
    store.stage(f"put-{name}-{version}", "h0/0", TileBuffer(array, tuple((0, n) for n in array.shape), "float32"))
    store.commit(f"put-{name}-{version}", name, version, ["h0/0"])


def test_a_released_version_s_buffer_makes_the_next_tile_of_its_size():
    store = ShardStore(host="h0")
    first = store.empty((256, 1024), "float32")
    _commit(store, "w", 1, first)
    address = _address(first)
    del first  # nothing but the store holds it now
    assert store.release("w", 1) == 1
    again = store.empty((1024, 256), "float32")  # same bytes, another shape
    assert _address(again) == address and again.shape == (1024, 256)
    assert store.recycler.reused == 1
    assert store.empty((3, 7), "float64").shape == (3, 7)  # too small to keep: plain malloc
    assert store.recycler.reused == 1


def test_a_version_larger_than_the_cap_comes_back_whole_for_the_next():
    """The weight-sync pattern on a serving host, with tiles of more bytes than the recycler's cap: the released
    version is kept whole (the cap grows to the most the store held committed), so every tile of the next version
    is made in its memory, and none of its buffers is freed (on nixl a freed buffer a peer knew is never offered
    again). Beyond that, the cap holds: a buffer past it is dropped, oldest first."""
    store = ShardStore(host="h0", recycle_bytes=2 * MiB)
    tiles = [store.empty((MiB // 4,), "float32") for _ in range(6)]  # 6 MiB of tiles, a cap of 2 MiB
    for i, tile in enumerate(tiles):
        _commit(store, f"w{i}", 1, tile)
    addresses = {_address(t) for t in tiles}
    assert store.committed_peak == 6 * MiB and store.recycler.cap_bytes == 8 * MiB
    del tiles, tile
    for i in range(6):  # the trainer publishes version 2 on other hosts: this host's version 1 goes first
        store.release(f"w{i}", 1)
    assert store.recycler.nbytes == 6 * MiB
    again = [store.empty((MiB // 4,), "float32") for _ in range(6)]
    assert {_address(t) for t in again} == addresses and store.recycler.reused == 6
    for _ in range(3):  # 3 MiB of the job's scratch beside them: 9 MiB in all, one past the cap
        store.recycle(np.empty(MiB, np.uint8))
    assert store.recycler.nbytes == 3 * MiB
    for i, tile in enumerate(again):
        _commit(store, f"w{i}", 2, tile)
    del again, tile
    for i in range(6):
        store.release(f"w{i}", 2)
    assert store.recycler.nbytes == 8 * MiB  # the oldest scratch buffer went


def test_an_agent_with_a_memory_limit_keeps_its_recycler_s_cap():
    """Its container is sized for the limit plus the cap: a released version beyond the cap is not kept."""
    store = ShardStore(host="h0", limit_bytes=64 * MiB, recycle_bytes=2 * MiB)
    tiles = [store.empty((MiB // 4,), "float32") for _ in range(6)]
    for i, tile in enumerate(tiles):
        _commit(store, f"w{i}", 1, tile)
    del tiles, tile
    for i in range(6):
        store.release(f"w{i}", 1)
    assert store.recycler.cap_bytes == 2 * MiB and store.recycler.nbytes == 2 * MiB


def test_a_buffer_someone_still_reads_is_never_handed_out():
    store = ShardStore(host="h0")
    _commit(store, "w", 1, store.empty((256, 1024), "float32"))
    reader = store.get("w", 1, "h0/0").array[10:20]  # a stream of the old version still running
    store.release("w", 1)
    fresh = store.empty((256, 1024), "float32")
    assert not np.shares_memory(fresh, reader)
    assert store.recycler.reused == 0


def test_an_aborted_transaction_s_staged_tiles_are_recycled():
    store = ShardStore(host="h0")
    store.stage("job", "h0/0", TileBuffer(store.empty((128, 1024), "float32"), ((0, 128), (0, 1024)), "float32"))
    store.abort("job")
    assert store.recycler.nbytes == 128 * 1024 * 4
    store.empty((128, 1024), "float32")
    assert store.recycler.nbytes == 0 and store.recycler.reused == 1


def test_the_recycler_keeps_at_most_its_cap_dropping_the_oldest():
    recycler = Recycler(3 * MiB)
    arrays = [np.empty(MiB, np.uint8) for _ in range(4)]
    for a in arrays:
        recycler.put(a)
    assert recycler.nbytes == 3 * MiB
    del arrays
    assert recycler.take(MiB) is not None
    assert recycler.take(2 * MiB) is None  # no buffer of that size
    Recycler(MiB).put(np.empty(2 * MiB, np.uint8))  # larger than the cap: not kept, no error


def test_views_and_foreign_memory_are_not_kept():
    recycler = Recycler(16 * MiB)
    whole = np.empty(4 * MiB, np.uint8)
    recycler.put(whole[: MiB])  # part of a buffer: its owner still uses the rest
    recycler.put(np.frombuffer(bytearray(MiB), np.uint8))  # memory numpy does not own
    assert recycler.nbytes == 0


def test_a_repeated_all_reduce_writes_into_the_last_result_s_memory():
    """The weight-sync pattern: each step's result replaces the last; after the first, no fresh memory is touched.
    Each round reduces other addends, so a result buffer still holding the last round's sum fails the check on
    whichever device's copy it is in (`Hosts.get` compares every copy)."""
    from reshard import Mesh, Sharding, reshard_program
    from tests.unit.test_runtime import HOSTS, Hosts

    hosts = Hosts()
    try:
        mesh = Mesh.from_hosts({"x": len(HOSTS)}, list(HOSTS), 1)
        shape = (256, 128)  # 128 KiB of float32 per device
        full = ((0, 256), (0, 128))
        replicated = Sharding(mesh, (None, None))
        text = reshard_program(shape, "float32", Sharding(mesh, (None, None), partial=("x",)),
                               replicated).validate().dumps()
        rng = np.random.default_rng(11)
        for k in range(3):  # round k reduces version 2k+1 into 2k+2, then releases the result for the next round
            addends = {f"{h}/0": rng.integers(-1000, 1000, shape).astype(np.float32) for h in HOSTS}  # sums exact
            hosts.put("g", {d: (a, full) for d, a in addends.items()}, version=2 * k + 1)
            job, runs = hosts.start(text, "g", src_version=2 * k + 1)
            hosts.finish(job, runs)
            del runs
            want = sum(addends.values(), np.zeros(shape, np.float32))
            assert np.array_equal(hosts.get("g", replicated, shape, version=2 * k + 2), want), k
            for store in hosts.stores.values():
                store.release("g", 2 * k + 2)
        assert all(store.recycler.reused == 2 for store in hosts.stores.values()), \
            [store.recycler.reused for store in hosts.stores.values()]
    finally:
        hosts.close()


def test_address_of_is_the_address_numpy_gives_for_every_kind_of_array():
    """`shm.address_of` takes a faster way for writable C-contiguous arrays (posting and sending a bucket ask it
    several times per member), and falls back for the rest: the same address either way."""
    from reshard.server.transport import shm

    owner = np.arange(1 << 16, dtype=np.uint8)
    read_only = owner[100:200]
    read_only.flags.writeable = False
    mapped = np.frombuffer(mmap.mmap(-1, 1 << 16), dtype=np.uint8)
    cases = [owner, owner[4096:8192], owner.view(np.float32).reshape(128, 128)[3:7], read_only,
             owner.reshape(256, 256)[:, 8:16], owner[:0], np.frombuffer(b"bytes", dtype=np.uint8), mapped[1:]]
    for a in cases:
        assert shm.address_of(a) == a.ctypes.data, (a.shape, a.strides, a.flags.writeable)
