"""The nixl transport on GPUs: a box bound for a GPU tile lands in GPU memory (VRAM) and a GPU source is written from
where it lies, checked by the GPU digest, with no host staging at either end; host and GPU agents still move to
each other (the memory each end posts decides the path and the digest); real agent processes move GPU tensors
between agents that share one GPU over NIXL bit for bit.

Runs where torch sees a CUDA device and NIXL imports (``make gpu-check``); skips elsewhere, saying why. The host
half of the same code runs in tests/unit/test_nixl.py. Two NIXL agents in one process (the ``pair`` tests) move GPU
memory at about 0.3 GB/s on an H200 (4 GiB in 12-13 s: UCX has no CUDA IPC within a process), so those tests keep
their tensors small; agents in processes of their own moved 1 GiB in 0.6-0.7 ms.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

import reshard
from reshard import Mesh, Sharding
from reshard.proto import devices
from reshard.server.transport.nixl import NixlTransport, nixl_missing
from reshard.server.transport.session import Session
from reshard.server.transport.streams import StreamKey, in_thread

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs a CUDA device: torch {torch.__version__} sees {torch.cuda.device_count()} "
                              f"(the host path of the same code runs in tests/unit/test_nixl.py)"),
    pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing())),
]

ONE_HOST = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host0"], 2), ("y", None))
ON_HOST1 = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host1"], 2), (None, None))
BOTH_HOSTS = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", "y"))
COLUMNS = Sharding(Mesh.from_hosts({"x": 2}, ["host0", "host1"], 1), (None, "x"))


@pytest.fixture()
def pair():
    """Two NIXL agents in this process, a and b, introduced to each other."""
    a, b = (NixlTransport(h, chunk_bytes=1 << 20, timeout_s=10, stall_timeout_s=10) for h in ("a", "b"))
    a.add_peer("b", b.metadata())
    b.add_peer("a", a.metadata())
    yield a, b
    a.close()
    b.close()


def _placing(device: str, tile):
    """A `Sink.place` of one tile that holds the whole array (numpy or torch): the region of a sub-box where it is
    contiguous."""
    def place(sub):
        view = tile[tuple(slice(lo, hi) for lo, hi in sub)]
        contiguous = view.is_contiguous() if isinstance(view, torch.Tensor) else view.flags.c_contiguous
        return (device, view) if contiguous else None
    return place


def _move(a, b, job: str, src, box, place, dtype: str = "float32"):
    """Stream ``box`` of ``src`` (the whole array) from a to b; b's pieces and trailer."""
    s = Session(job, "p", {0: dtype}, {})
    key = StreamKey(job, 0, 0)
    sent = in_thread("send", a.send, s, key, "b", src, tuple((0, n) for n in src.shape), box)
    items = list(b.arrivals(s, key, "a", box, place))
    sent.result(30)
    return items[:-1], items[-1]


def _joined(pieces) -> bytes:
    return b"".join(devices.to_host(p.data).tobytes() if devices.is_cuda(p.data) else bytes(memoryview(p.data))
                    for p in pieces)


def test_a_gpu_box_goes_from_gpu_memory_into_gpu_memory_checked_by_the_gpu_digest(pair):
    a, b = pair
    src = torch.randn(1024, 1024, device="cuda")  # 4 MiB: four chunks of the transport's 1 MiB
    tile = torch.zeros_like(src)
    pieces, trailer = _move(a, b, "vram", src, ((0, 1024), (0, 1024)), _placing("b/0", tile))
    assert pieces and all(devices.is_cuda(p.data) for p in pieces)  # landed in GPU memory
    assert trailer.device and trailer.nbytes == src.numel() * 4
    assert trailer.digest == devices.device_digest(src)
    assert _joined(pieces) == devices.to_host(src).tobytes()
    assert (a.scratch_bytes, b.scratch_bytes) == (0, 0)  # no host buffer at either end
    assert b.device_scratch_bytes >= src.numel() * 4  # the landing buffer, kept for the next stream
    kept = b.device_scratch_bytes
    src += 1
    pieces, trailer = _move(a, b, "vram-again", src, ((0, 1024), (0, 1024)), _placing("b/0", tile))
    assert trailer.digest == devices.device_digest(src) and b.device_scratch_bytes == kept  # reused


def test_a_strided_gpu_box_is_packed_on_its_gpu_and_lands_whole(pair):
    a, b = pair
    src = torch.arange(64 * 1024, dtype=torch.int32, device="cuda").reshape(64, 1024)
    box = ((16, 48), (256, 768))  # 32 rows of 2 KiB, 2 KiB apart
    tile = torch.zeros(32, 512, dtype=torch.int32, device="cuda")
    pieces, trailer = _move(a, b, "strided", src, box, lambda sub: ("b/0", tile), "int32")
    want = src[16:48, 256:768].contiguous()
    assert trailer.device and trailer.digest == devices.device_digest(want)
    assert _joined(pieces) == devices.to_host(want).tobytes() and a.scratch_bytes == 0


def test_a_host_source_writes_into_gpu_memory_and_a_gpu_source_into_host_memory(pair):
    a, b = pair
    host = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    on_gpu = torch.zeros(512, 512, device="cuda")
    pieces, trailer = _move(a, b, "to-gpu", host, ((0, 512), (0, 512)), _placing("b/0", on_gpu))
    assert all(devices.is_cuda(p.data) for p in pieces)  # the receiver posted GPU memory: the GPU digest, too
    assert trailer.device and trailer.digest == devices.device_digest(host)
    assert _joined(pieces) == host.tobytes()
    src = torch.randn(512, 512, device="cuda")
    dst = np.zeros((512, 512), np.float32)
    pieces, trailer = _move(a, b, "to-host", src, ((0, 512), (0, 512)), _placing("b/0", dst))
    want = devices.to_host(src)
    assert not trailer.device and trailer.digest == xxhash.xxh3_64_intdigest(want.tobytes())
    assert np.array_equal(dst, want) and all(p.landed == "b/0" for p in pieces)  # in the host tile itself


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agents_on_one_gpu_reshard_gpu_tensors_over_nixl_bit_for_bit(dtype):
    """Real agent processes on cuda:0 with --transport nixl: row tiles to replicas on another host, to a 2-D split
    across both (boxes strided in the source), to column tiles (strided in both), and back, each checked."""
    with reshard.local_cluster(hosts=2, devices_per_host=2, device="cuda:0", transport="nixl") as c:
        t = torch.randn(384, 640, device="cuda", dtype=torch.float32).to(dtype)
        c.put("w", t, ONE_HOST)
        for sharding in (ON_HOST1, BOTH_HOSTS, COLUMNS, ONE_HOST):
            result = c.reshard("w", sharding).result(timeout=120)
            assert result.state == "succeeded" and "nixl" in result.transports, result.transports
            got = c.get("w", device="cuda:0")
            assert got.dtype == dtype and torch.equal(_bits(got), _bits(t)), sharding


def test_a_gpu_agent_and_a_host_agent_move_to_each_other_over_nixl():
    with reshard.local_cluster(hosts=2, devices_per_host=2, device=["cuda:0", "cpu"], transport="nixl") as c:
        a = np.random.default_rng(1).standard_normal((256, 384)).astype(np.float32)
        c.put("m", a, ONE_HOST)  # on the GPU agent
        for sharding in (ON_HOST1, BOTH_HOSTS, ONE_HOST):
            c.reshard("m", sharding).result(timeout=120)
            got = c.get("m")
            assert np.array_equal(np.asarray(got), a), sharding


def test_a_broadcast_chain_through_a_host_agent_between_gpu_agents_checks_each_hop_in_its_own_memory():
    """host0 (GPU) -> host1 (host memory) -> host2 (GPU): each hop lands the box in its own kind of memory and
    checks the digest of that kind; the host hop digests what it forwards in the GPU digest the last hop checks."""
    with reshard.local_cluster(hosts=3, devices_per_host=1, device=["cuda:0", "cpu", "cuda:0"],
                               transport="nixl") as c:
        t = torch.randn(512, 1024, device="cuda")
        c.put("b", t, Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None)))
        result = c.reshard("b", Sharding(Mesh.from_hosts({"x": 2}, ["host1", "host2"], 1), (None, None)),
                           strategy="broadcast").result(timeout=120)
        assert result.state == "succeeded"
        for device in ("host1/0", "host2/0"):
            assert torch.equal(_bits(c.get_shard("b", device, to="cuda:0")), _bits(t)), device
