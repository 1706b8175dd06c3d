"""Shards on GPUs: CUDA-resident stores, CUDA tensors in and out bit for bit, the CUDA IPC hand-over from a
separate process, device-to-device copies between devices on one GPU, and the GPU start-up refusals.

Runs where torch sees a CUDA device (one is enough) and skips elsewhere, saying why;
``test_devices.py`` runs the same code paths on CPU. NCCL takes one process group
member per GPU, so jobs between agents that share a GPU run over gRPC (``auto``
picks it and says why).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
import torch

import reshard
from reshard import Mesh, Sharding
from reshard.client import Client, FailedPreconditionError, ResourceExhaustedError, UnavailableError
from reshard.proto import devices
from reshard.client.client import _sharding_json
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.server.agent.service import Agent
from reshard.server.common.config import AgentConfig, PlannerConfig
from reshard.server.planner.service import serve_planner
from reshard.server.transport import buffers

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"needs a CUDA device: torch {torch.__version__} sees {torch.cuda.device_count()} "
                              f"(the CPU path of the same code runs in test_devices.py)"),
]

nccl = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                          reason="needs a CUDA device and a torch built with NCCL")

ONE_HOST = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host0"], 2), ("y", None))
BOTH_HOSTS = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2), ("x", "y"))
ON_HOST1 = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host1"], 2), (None, None))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements' bits, so that comparisons are bit for bit (NaN and -0.0 included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _tensor(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


@pytest.fixture(scope="module")
def gpu_cluster():
    """Two agents on cuda:0, gRPC between them (NCCL takes one member per GPU)."""
    with reshard.local_cluster(hosts=2, devices_per_host=2, device="cuda:0", transport="grpc") as c:
        yield c


def test_digest_is_the_same_on_the_gpu_and_on_the_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        t = _tensor((513, 257), dtype)
        assert devices.device_digest(t) == devices.device_digest(t.cpu())
    odd = torch.arange(1001, dtype=torch.uint8, device="cuda")
    assert devices.device_digest(odd) == devices.device_digest(odd.cpu())


def test_buffers_move_host_and_gpu_arrays_through_pinned_staging():
    a = np.random.default_rng(0).standard_normal((5 * 2**20 + 3,)).astype(np.float32)  # > one 16 MiB stage
    on_gpu = buffers.to_device(a, "float32", "cuda:0")
    assert on_gpu.device == torch.device("cuda:0") and np.array_equal(buffers.host_array(on_gpu), a)
    tile = ((0, 8), (0, 6))
    buf = buffers.empty((8, 6), "bfloat16", "cuda:0")
    src = np.arange(24, dtype=np.uint16).reshape(4, 6)  # bfloat16 bits, as numpy holds them
    buffers.write(buf, ((4, 8), (0, 6)), tile, src)  # host into a GPU region
    buffers.write(buf, ((0, 4), (0, 6)), tile, buf[4:])  # GPU to GPU
    assert np.array_equal(buffers.host_array(buf), np.concatenate([src, src]))


def test_store_of_a_cuda_agent_holds_torch_tensors_on_its_gpu():
    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=5.0))
    agent = Agent(AgentConfig("host0", 2, f"127.0.0.1:{port}", device="cuda:0", transport="grpc")).start()
    try:
        with Client(f"127.0.0.1:{port}") as c:
            t = _tensor((64, 32), torch.float32)
            info = c.put("resident", t, ONE_HOST)  # this process holds the agent: bytes stream, no IPC
            for i, dev in enumerate(ONE_HOST.mesh.devices):  # ("y", None): rows split over the two devices
                shard = agent.runtime.store.get("resident", info.version, dev)
                assert isinstance(shard.array, torch.Tensor) and shard.array.device == torch.device("cuda:0")
                assert torch.equal(_bits(shard.array), _bits(t[32 * i:32 * (i + 1)]))
            assert c.agents()[0]["device"] == "cuda:0"
            assert c.agents()[0]["gpu_uuid"] == devices.gpu_uuid("cuda:0")
    finally:
        agent.stop()
        server.stop(0)
        planner.close()


@pytest.mark.parametrize("ipc", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_cuda_tensors_put_get_and_reshard_bit_exact(gpu_cluster, ipc, dtype):
    c = gpu_cluster
    name = f"w_{str(dtype)[6:]}_{ipc}"
    t = _tensor((301, 130), dtype)  # uneven: trailing tiles are smaller
    c.put(name, t, BOTH_HOSTS, ipc=ipc)
    back = c.get(name, device="cuda:0", ipc=ipc)
    assert back.device == torch.device("cuda:0") and torch.equal(_bits(back), _bits(t))
    on_cpu = c.get(name)  # torch in, torch out on the CPU by default
    assert on_cpu.device.type == "cpu" and torch.equal(_bits(on_cpu), _bits(t.cpu()))
    shard = c.get_shard(name, "host1/1", to="cuda:0", ipc=ipc)
    assert torch.equal(_bits(shard), _bits(t[151:, 65:]))
    result = c.reshard(name, ON_HOST1).result(timeout=120)
    assert result.transport == "grpc" and result.state == "succeeded"
    assert torch.equal(_bits(c.get(name, device="cuda:0", ipc=ipc)), _bits(t))
    assert torch.equal(_bits(c.get_shard(name, "host1/0", to="cuda:0")), _bits(t))
    c.delete(name)


_RANK = textwrap.dedent("""
    # A training rank in its own process: hands its shards over by CUDA IPC, frees them, reads them back.
    import sys
    import torch
    import reshard
    from reshard import Mesh, Sharding

    address, token = sys.argv[1], sys.argv[2]
    sharding = Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["host0"], 2), (None, "y"))  # columns split
    full = torch.arange(256 * 96, dtype=torch.float32, device="cuda").reshape(256, 96) * 0.5
    with reshard.connect(address, token=token) as c:
        done = [c.put_shard("ranked", dev, full[:, 48 * i:48 * (i + 1)].clone(), sharding, shape=full.shape, ipc=True)
                for i, dev in enumerate(sharding.mesh.devices)]
        assert done == [False, True], done
        del full
        torch.cuda.empty_cache()
        junk = torch.full((256, 96), -1.0, device="cuda")  # reuse the freed memory: the agent kept its own copy
        want = torch.arange(256 * 96, dtype=torch.float32).reshape(256, 96) * 0.5
        for i, dev in enumerate(sharding.mesh.devices):
            got = c.get_shard("ranked", dev, to="cuda:0", ipc=True)
            assert torch.equal(got.cpu(), want[:, 48 * i:48 * (i + 1)]), dev
        print("rank ok", float(junk.sum()))
""")


def test_cuda_ipc_hand_over_from_a_separate_process(gpu_cluster, tmp_path):
    c = gpu_cluster
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    proc = subprocess.run([sys.executable, str(script), c.address, c.cluster.token], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank ok" in proc.stdout
    want = torch.arange(256 * 96, dtype=torch.float32).reshape(256, 96) * 0.5
    assert torch.equal(c.get("ranked"), want)
    c.delete("ranked")


def test_cuda_ipc_hand_over_with_a_wrong_digest_is_data_loss(gpu_cluster):
    """A hand-over the planner issued (its ticket) whose digest differs from the bytes is refused, nothing staged."""
    c = gpu_cluster
    t = _tensor((16, 16), torch.float32)
    one_device = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    opened = c._planner_call("BeginUpload", pb.BeginUploadRequest(
        name="lossy", shape=[16, 16], dtype="float32", sharding_json=_sharding_json(one_device), kind="torch"))
    loc, = opened.locations
    header = pb.ShardHeader(upload_id=opened.upload_id, tensor="lossy", device=loc.device, dtype="float32",
                            box=loc.box, ticket=loc.ticket)
    request = pb.IpcPutShardRequest(header=header, source=pb.CudaIpcTensor(**devices.share_cuda(t).fields()),
                                    digest=devices.device_digest(t) ^ 1)
    with grpc.insecure_channel(loc.address) as ch, pytest.raises(grpc.RpcError) as lost:
        pb_grpc.AgentStub(ch).PutShardIpc(request, metadata=[("authorization", f"Bearer {c.cluster.token}")])
    assert lost.value.code() == grpc.StatusCode.DATA_LOSS, lost.value.details()
    assert "differs from the sender's" in lost.value.details() and "nothing was staged" in lost.value.details()


def test_devices_of_one_agent_on_one_gpu_copy_device_to_device(monkeypatch):
    """A local move between two devices of one agent (one GPU) never stages through the host."""
    server, port, planner = serve_planner(PlannerConfig(heartbeat_timeout_s=5.0))
    agent = Agent(AgentConfig("host0", 2, f"127.0.0.1:{port}", device="cuda:0", transport="grpc")).start()
    try:
        with Client(f"127.0.0.1:{port}") as c:
            t = _tensor((1024, 512), torch.bfloat16)
            c.put("local", t, ONE_HOST)

            def no_host_copy(view):
                raise AssertionError("a local move between CUDA tiles went through host memory")

            with monkeypatch.context() as m:
                m.setattr(buffers, "to_host", no_host_copy)
                replicated = Sharding(ONE_HOST.mesh, (None, None))
                result = c.reshard("local", replicated).result(timeout=60)
            assert set(result.transports) == {"local"} and result.network_bytes == 0
            assert result.traffic["host0"]["local_bytes"] == t.numel() * t.element_size()
            for dev in replicated.mesh.devices:
                shard = agent.runtime.store.get("local", result.version, dev)
                assert shard.array.device == torch.device("cuda:0")
                assert torch.equal(_bits(shard.array), _bits(t))
    finally:
        agent.stop()
        server.stop(0)
        planner.close()


def test_agent_on_a_missing_gpu_ordinal_fails_at_start():
    count = torch.cuda.device_count()
    proc = subprocess.run([sys.executable, "-m", "reshard.server.cli", "agent", "--planner", "127.0.0.1:1",
                           "--host", "g0", "--devices", "1", "--device", f"cuda:{count}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    noun = "device" if count == 1 else "devices"
    assert f"error: device cuda:{count} does not exist here: this process sees {count} CUDA {noun}" in proc.stderr


@nccl
def test_second_collective_agent_on_one_gpu_is_refused_naming_both():
    uuid = devices.gpu_uuid("cuda:0")
    with LocalCluster(host_names=["g0"], devices_per_host=1, transport="collective", device="cuda:0") as cluster, \
            cluster.connect() as c:
        with pytest.raises(UnavailableError) as refused:
            cluster.start_agent("g1", extra_args=["--device", "cuda:0"])  # the same GPU as g0
        assert f"hosts g0 and g1 are both on GPU {uuid}" in str(refused.value)
        assert [(a["host"], a["in_group"]) for a in c.agents()] == [("g0", True)]


@nccl
def test_auto_agents_on_one_gpu_run_grpc_and_say_why():
    uuid = devices.gpu_uuid("cuda:0")
    with reshard.local_cluster(host_names=["host0", "host1"], devices_per_host=2, transport="auto",
                               device="cuda:0") as c:
        agents = {a["host"]: a for a in c.agents()}
        # The agents start at once: whichever registers first joins the group, the other falls back to gRPC.
        first, second = sorted(agents, key=lambda h: agents[h]["transport"] != "auto")
        assert agents[first]["transport"] == "auto" and agents[first]["in_group"]
        assert agents[second]["transport"] == "grpc"
        assert f"hosts {first} and {second} are both on GPU {uuid}" in agents[second]["transport_reason"]
        t = _tensor((96, 40), torch.float32)
        c.put("fallback", t, ONE_HOST)
        result = c.reshard("fallback", ON_HOST1).result(timeout=120)
        assert result.transport == "grpc"
        assert torch.equal(_bits(c.get("fallback", device="cuda:0")), _bits(t))


def test_ipc_true_refuses_an_agent_on_the_cpu_and_auto_streams():
    with reshard.local_cluster(hosts=1, devices_per_host=2, device="cpu", transport="grpc") as c:
        t = _tensor((8, 8), torch.float32)
        with pytest.raises(FailedPreconditionError, match=r"ipc=True, but the agent of host host0 keeps its shards "
                                                          r"in host memory \(--device cpu\)"):
            c.put("cpu_side", t, ONE_HOST, ipc=True)
        c.put("cpu_side", t, ONE_HOST)  # the refusal came before the upload opened: the name is free
        assert torch.equal(c.get("cpu_side", device="cuda:0"), t)


def test_puts_by_cuda_ipc_ask_the_planner_for_the_agents_at_most_once(gpu_cluster):
    """Each put_shard(ipc=True) checks that its agent can map the rank's memory, at the address the planner last
    listed: one ListAgents for many puts, not one a put (a round trip of every put on a GPU host)."""
    asked = []
    one = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,))
    t = _tensor((64,), torch.float32)
    with gpu_cluster.cluster.connect() as c:
        planner_call = c._planner_call

        def counted(method, *args, **kwargs):
            asked.append(method)
            return planner_call(method, *args, **kwargs)

        c._planner_call = counted
        for _ in range(5):
            assert c.put_shard("listed_once", "host0/0", t, one, ipc=True)
            assert torch.equal(c.get_shard("listed_once", "host0/0", to="cuda:0"), t)
            c.delete("listed_once")
    assert asked.count("ListAgents") <= 1, asked


# -- the GPU digest and CUDA IPC between agents (issue 43) --------------------------------------------------------

@pytest.mark.parametrize("nbytes", [1, 2047, 2048, 2049, 5 * 2**20, 5 * 2**20 + 3])
def test_gpu_digest_one_pass_equals_torch_and_numpy_and_copies(nbytes):
    """The Triton pass (where Triton runs: its words kernel on aligned whole words, else its bytes kernel), torch's
    reductions and numpy agree on the same bytes, and the copy that digests copies every byte."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = src.cpu().numpy()
    want = devices.device_digest(host)  # numpy on the CPU
    assert devices.device_digest(src) == want  # the Triton pass, or torch's reductions without Triton
    for start in (1, 16):  # off the words kernel's alignment, and on it
        assert devices.device_digest(src[start:]) == devices.device_digest(host[start:])
    dst = torch.full_like(src, 7)
    assert devices.copy_digest(dst, src) == want and torch.equal(dst, src)
    triton_kernel = devices._triton_kernel()
    devices._TRITON[:] = [None]  # torch's reductions on the GPU
    try:
        assert devices.device_digest(src) == want
    finally:
        devices._TRITON[:] = [triton_kernel]
    pieces = devices.DeviceChecksum()
    for lo in range(0, nbytes, 3001):  # pieces cut anywhere, as a stream's arrive
        pieces.update(src[lo:lo + 3001])
    assert pieces.value == want


@pytest.mark.parametrize("cuda_ipc", [True, False])
def test_agents_on_one_gpu_move_by_cuda_ipc_or_stream_bytes(cuda_ipc):
    """Two agents on one GPU: a move between them is a CUDA IPC handle and a device-to-device copy (no byte on the
    network), or with --no-cuda-ipc a byte stream; bit-exact either way, also for a box narrower than its tile."""
    args = () if cuda_ipc else ("--no-cuda-ipc",)
    with reshard.local_cluster(hosts=2, devices_per_host=2, device="cuda:0", transport="grpc", agent_args=args) as c:
        for dtype in (torch.float32, torch.bfloat16):
            t = _tensor((513, 258), dtype, seed=3)
            name = f"ipc_{str(dtype)[6:]}"
            c.put(name, t, ONE_HOST)  # split by columns over host0's two devices
            for target in (ON_HOST1, BOTH_HOSTS, ONE_HOST):  # replicated; 2x2 tiles (strided boxes); back
                result = c.reshard(name, target).result(timeout=120)
                assert result.state == "succeeded" and result.transport == "grpc"
                assert (result.network_bytes == 0) == cuda_ipc, result.network_bytes
                assert torch.equal(_bits(c.get(name, device="cuda:0")), _bits(t))
            c.delete(name)


@pytest.mark.parametrize("agent_device", ["cuda:0", "cpu"])
def test_cuda_tensors_without_ipc_go_through_pinned_shared_memory(agent_device):
    """ipc=False, or an agent in host memory: a CUDA shard of 1 MiB or more goes through a shared-memory segment
    (pinned: DMA at full rate), checked by the GPU digest where both ends are on GPUs, else by XXH3; bit-exact both
    ways, into GPU and host tensors."""
    from reshard.proto import shared_memory

    one = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    with reshard.local_cluster(hosts=1, devices_per_host=1, device=agent_device, transport="grpc") as c:
        t = _tensor((1024, 1000), torch.bfloat16, seed=9)  # 2 MB
        c.put_shard("shm", "host0/0", t, one, ipc=False)
        mine = [n for n in os.listdir(shared_memory.SHM_DIR)
                if n.startswith("reshard-sdk-") and n.split("-")[3] == str(os.getpid())]
        assert mine, "the CUDA shard was streamed, not handed over through shared memory"
        for to in ("cuda:0", "cpu"):
            got = c.get_shard("shm", "host0/0", to=to, ipc=False)
            assert got.device.type == torch.device(to).type and torch.equal(_bits(got.cuda()), _bits(t))
        assert torch.equal(_bits(c.get("shm", device="cuda:0")), _bits(t))


def test_a_gpu_buffer_that_does_not_fit_is_resource_exhausted_naming_the_gpu_s_free_memory():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(ResourceExhaustedError, match=r"cannot allocate .* on cuda:0 for a float32\[\d+\] buffer: "
                                                     r"[\d.]+ GiB of its [\d.]+ GiB are free; .*or shard the tensor"):
        buffers.empty((total // 2,), "float32", "cuda:0")  # twice the GPU's memory


def test_moves_back_and_forth_between_gpu_agents_keep_at_most_an_eighth_of_the_gpu_mapped():
    """After a move by CUDA IPC the receiver keeps the sender's tile mapped (the next move of the same buffer then
    skips CUDA's open), and torch keeps a mapped tile allocated on the sender after its next commit frees it. The
    receivers keep at most an eighth of the GPU so mapped (`IPC_MAPPED_SHARE`): a tensor of a twelfth of the GPU
    moved between two agents 14 times fits. With 64 GiB kept per receiver, the same moves of 16 GiB on an H200
    ran out of memory in the receiving agent's staging, and that failed as an internal error."""
    n = torch.cuda.get_device_properties(0).total_memory // 12 // 4
    one = {h: Sharding(Mesh.from_hosts({"x": 1}, [h], 1), (None,)) for h in ("host0", "host1")}
    t = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    with reshard.local_cluster(hosts=2, devices_per_host=1, device="cuda:0", transport="grpc") as c:
        c.put_shard("big", "host0/0", t, one["host0"], ipc=True)
        for i in range(14):
            result = c.reshard("big", one["host1" if i % 2 == 0 else "host0"]).result(timeout=120)
            assert result.network_bytes == 0  # by CUDA IPC
        assert torch.equal(c.get_shard("big", "host0/0", to="cuda:0"), t)
    del t
    torch.cuda.empty_cache()
