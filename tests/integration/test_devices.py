"""Devices on machines without a GPU: what the CUDA path shares with the CPU path, and the start-up checks.

The GPU digest, the CUDA IPC handle's fields, the buffers layer and the SDK's
``device=``/``to=``/``ipc=`` arguments run here on CPU tensors; the start-up
checks run against real planner and agent processes: an agent on a device this
host lacks fails at start, and an agent the planner refuses (two agents on one
GPU in a collective group; a GPU uuid reported through a test-only flag, since
this machine has none) never shows as up. ``test_cuda.py`` runs the same paths
on a GPU.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

import reshard
from reshard import Mesh, Sharding
from reshard.client import (FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError,
                            UnavailableError)
from reshard.proto import devices
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.server.common.config import AgentConfig
from reshard.server.planner.membership import GroupCoordinator
from reshard.server.planner.registry import Registry
from reshard.server.agent.service import serve_agent
from reshard.server.common.tickets import new_secret, put_fields, sign
from reshard.server.transport import buffers

GPU = "GPU-00000000-1111-2222-3333-444444444444"  # a uuid no real GPU here has


# -- the GPU digest, on CPU tensors ---------------------------------------------------------------

def _reference_digest(data: bytes) -> int:
    """The digest as the module notes define it, byte by byte in Python."""
    p = 2**31 - 1
    a = (len(data) + sum(data)) % p
    b = sum(j * x for j, x in enumerate(data, start=1)) % p
    return (b << 32) | a


@pytest.mark.parametrize("nbytes", [0, 1, 2, 7, 64, 1001, 2048, 2049, 3 * 2048 + 5])
def test_digest_matches_its_definition(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    want = _reference_digest(data.tobytes())
    assert devices.device_digest(torch.from_numpy(data)) == want  # torch's reductions
    assert devices.device_digest(data) == want == devices.device_digest(data.tobytes())  # numpy's


@pytest.mark.parametrize("cuts", [(0,), (1, 2048), (5, 2050, 4097), (2047, 2048, 2049, 6000)])
def test_digest_summed_piece_by_piece_is_the_whole_digest(cuts):
    """A stream's trailer sums its pieces as they come; pieces start and end at any byte, on either side."""
    data = np.random.default_rng(len(cuts)).integers(0, 256, 3 * 2048 + 17, dtype=np.uint8)
    bounds = [0, *cuts, data.size]
    check = devices.DeviceChecksum()
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        check.update(torch.from_numpy(data[lo:hi]) if i % 2 else data[lo:hi])  # torch and numpy pieces mixed
    assert check.nbytes == data.size and check.value == _reference_digest(data.tobytes())
    out = torch.empty(data.size, dtype=torch.uint8)
    assert devices.copy_digest(out, torch.from_numpy(data)) == check.value and np.array_equal(out.numpy(), data)


def test_digest_reads_bytes_not_elements_and_passes_chunk_boundaries(monkeypatch):
    t = torch.randn(37, 11, dtype=torch.float32)
    whole = devices.device_digest(t)
    assert whole == _reference_digest(t.numpy().tobytes())
    assert devices.device_digest(t.view(torch.uint8)) == whole  # the same bytes as another dtype
    assert devices.device_digest(t.t().contiguous().t()) == whole  # the same elements in another layout
    assert devices.device_digest(t.view(torch.uint8).reshape(-1)[1:]) == _reference_digest(t.numpy().tobytes()[1:])
    monkeypatch.setattr(devices, "_FOLD", 5)  # many blocks of 5 bytes, one short: the same sums
    assert devices.device_digest(t) == whole
    for dtype in (torch.bfloat16, torch.bool, torch.int64, torch.complex64):
        x = torch.ones(3, 5, dtype=dtype)
        assert devices.device_digest(x) == _reference_digest(x.view(torch.uint8).numpy().tobytes())


def test_digest_catches_a_flipped_bit_a_swap_and_a_longer_tail():
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    base = devices.device_digest(torch.from_numpy(data))
    flipped = data.copy()
    flipped[1234] ^= 0x10
    swapped = data.copy()
    swapped[[3, 900]] = swapped[[900, 3]]
    assert swapped[3] != swapped[900]
    longer = np.concatenate([data, np.zeros(2, np.uint8)])
    for other in (flipped, swapped, longer):
        assert devices.device_digest(torch.from_numpy(other)) != base


# -- CUDA IPC handles: fields only, no pickle ------------------------------------------------------

def _handle(**over) -> devices.CudaIpcHandle:
    fields = dict(gpu_uuid=GPU, handle=b"\x01" * 64, storage_nbytes=4096, storage_offset_bytes=512,
                  ref_counter_handle=b"/torch_123_456", ref_counter_offset=3, event_handle=b"\x02" * 64,
                  event_sync_required=True, offset=16, shape=(10, 20), stride=(20, 1), dtype="float32")
    return devices.CudaIpcHandle(**{**fields, **over})


def test_ipc_handle_round_trips_through_its_message():
    h = _handle()
    msg = pb.CudaIpcTensor.FromString(pb.CudaIpcTensor(**h.fields()).SerializeToString())
    assert devices.CudaIpcHandle.from_message(msg) == h
    assert h.nbytes == 800 and h.end_byte == (16 + 200) * 4


def test_ipc_handle_past_its_storage_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"reaches byte 4068, past its storage of 4000 bytes"):
        _handle(storage_nbytes=4000, offset=817)
    with pytest.raises(InvalidArgumentError, match="one non-negative stride per dim"):
        _handle(stride=(1,))


# -- buffers and device checks on CPU ----------------------------------------------------------------

def test_device_check_names_the_device_count_on_a_host_without_cuda():
    assert devices.check_device("cpu") == "cpu"
    with pytest.raises(FailedPreconditionError,
                       match=r"device cuda:3 does not exist here: this process sees no CUDA device \(device count 0"):
        devices.check_device("cuda:3")
    with pytest.raises(InvalidArgumentError, match="neither cpu nor cuda"):
        devices.check_device("tpu:0")


def test_a_buffer_that_does_not_fit_is_resource_exhausted_naming_its_size_and_device():
    """An agent's allocation that fails is the caller's RESOURCE_EXHAUSTED (a job fails naming it), not an
    internal error; test_cuda.py checks the same on a GPU, where it reports the GPU's free memory."""
    with pytest.raises(ResourceExhaustedError, match=r"cannot allocate 1\.0 PiB on cpu for a float32\[281474976710656\]"
                                                     r" buffer: Unable to allocate .* Free memory there \(delete "
                                                     r"tensors, release pins\), or shard the tensor over more devices"):
        buffers.empty((2**48,), "float32")


def test_buffers_move_numpy_and_torch_cpu_alike():
    box = ((2, 4), (0, 3))
    tile = ((0, 4), (0, 3))
    buf = buffers.empty((4, 3), "bfloat16")
    assert buf.dtype == np.uint16 and buffers.device_of(buf) == "cpu"
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16)
    buffers.write(buf, box, tile, src)  # torch into numpy: the same bits
    assert np.array_equal(buf[2:], src.view(torch.int16).numpy().view(np.uint16))
    host = buffers.to_device(src, "bfloat16", "cpu")
    assert isinstance(host, np.ndarray) and host.dtype == np.uint16
    t = buffers.empty((4, 3), "float32", device="cpu")
    back = torch.zeros(4, 3)
    buffers.write(back, box, tile, np.ones((2, 3), np.float32))  # numpy into torch
    assert back[2:].eq(1).all() and back[:2].eq(0).all() and t.shape == (4, 3)
    assert bytes(buffers.host_bytes(back[2:])) == np.ones((2, 3), np.float32).tobytes()
    assert buffers.backend_refusal("gloo") == ""
    assert "CUDA" in buffers.backend_refusal("nccl")


# -- the planner's membership rules, over an in-memory registry -----------------------------------

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _group():
    clock = _Clock()
    registry = Registry(heartbeat_timeout_s=5.0, clock=clock)
    return registry, GroupCoordinator(registry, store_port=1234, clock=clock), clock


def _register(registry, group, host, transport, backend="nccl", gpu=GPU):
    return group.register(host, transport, backend, gpu,
                          admit=lambda: registry.register(host, 1, f"{host}:1", 10.0, "cuda:0", gpu, secret=bytes(16)))


def test_second_collective_agent_on_one_gpu_is_refused_and_never_admitted():
    registry, group, _ = _group()
    _register(registry, group, "a", "collective")
    with pytest.raises(FailedPreconditionError,
                       match=rf"hosts a and b are both on GPU {GPU}, but a process group takes one member per GPU "
                             rf"\(NCCL\) and host a is a member: give each agent its own GPU"):
        _register(registry, group, "b", "collective")
    assert registry.get("b") is None and group.view().members == ("a",)


def test_auto_agent_on_a_taken_gpu_runs_grpc_and_says_why():
    registry, group, _ = _group()
    _register(registry, group, "a", "auto")
    _register(registry, group, "b", "auto")
    assert group.mode("b") == "grpc" and group.view().members == ("a",)
    assert re.search(rf"hosts a and b are both on GPU {GPU}", group.reason("b"))
    assert group.choose(["a", "b"], 0.0)[0] == "grpc"
    _register(registry, group, "c", "auto", backend="gloo", gpu="")
    assert group.mode("c") == "grpc" and "one group has one backend" in group.reason("c")
    assert group.reason("a") == ""


def test_member_that_lost_its_gpu_while_down_stays_out():
    registry, group, clock = _group()
    _register(registry, group, "a", "collective")
    clock.now = 10.0  # a is down
    _register(registry, group, "b", "collective")  # b may have the GPU now
    registry.heartbeat("a", "a:1", sign(bytes(16), "heartbeat", "a", "a:1"))  # a comes back without registering
    assert group.view().members == ("b",)


# -- real processes ----------------------------------------------------------------------------------

# 10-14 s of make test (a collective cluster and a second collective agent, each importing torch): the slow pass.
# make test has the rule in tests/unit/test_membership.py and an agent refused at registration end to end in
# test_no_rendezvous.py.
@pytest.mark.slow
def test_agent_refused_at_registration_never_shows_as_up():
    with LocalCluster(host_names=["g0"], devices_per_host=2, transport="collective",
                      agent_args=["--report-gpu-uuid", GPU]) as cluster, cluster.connect() as c:
        with pytest.raises(UnavailableError) as refused:
            cluster.start_agent("g1")
        assert "exit code 2" in str(refused.value)
        assert f"hosts g0 and g1 are both on GPU {GPU}" in str(refused.value)
        assert [(a["host"], a["up"], a["gpu_uuid"], a["device"]) for a in c.agents()] == [("g0", True, GPU, "cpu")]


# 15 s of make test (a collective cluster of its own): the slow pass; the rule is tested above on real agents
@pytest.mark.slow
def test_auto_agent_on_a_taken_gpu_moves_jobs_over_grpc_and_the_planner_says_why():
    with LocalCluster(host_names=["g0", "g1"], devices_per_host=2, transport="auto",
                      agent_args=["--report-gpu-uuid", GPU]) as cluster, cluster.connect() as c:
        agents = {a["host"]: a for a in c.agents()}
        # LocalCluster starts its agents together: whichever registers second finds the GPU taken
        second = next(h for h, a in agents.items() if a["transport"] == "grpc")
        first = next(h for h in agents if h != second)
        assert agents[first]["transport"] != "grpc" and agents[first]["transport_reason"] == ""
        assert f"hosts {first} and {second} are both on GPU {GPU}" in agents[second]["transport_reason"]
        a = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
        c.put("w", a, Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["g0"], 2), ("y", None)))
        result = c.reshard("w", Sharding(Mesh.from_hosts({"x": 1, "y": 2}, ["g1"], 2), (None, None))).result(60)
        assert result.transport == "grpc" and set(result.transports) == {"grpc"}
        assert np.array_equal(c.get("w"), a)


def test_agent_on_a_missing_gpu_fails_at_start_naming_the_device_count():
    proc = subprocess.run([sys.executable, "-m", "reshard.server.cli", "agent", "--planner", "127.0.0.1:1",
                           "--host", "g0", "--devices", "1", "--device", "cuda:3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "error: device cuda:3 does not exist here: this process sees no CUDA device (device count 0" in proc.stderr


def test_cpu_agent_refuses_a_cuda_ipc_hand_over_and_says_what_to_do():
    secret = new_secret()  # the planner's side: it signs the upload's ticket with the agent's secret
    server, port, _ = serve_agent(AgentConfig("h0", 1, "127.0.0.1:1", transport="grpc"), secret)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.AgentStub(ch)
            info = stub.DescribeDevice(pb.Empty())
            assert (info.host, info.device, info.gpu_uuid) == ("h0", "cpu", "")
            assert info.machine_id == devices.machine_id() != ""
            h = _handle(shape=(4, 5), stride=(5, 1), offset=0)
            ticket = sign(secret, "put", *put_fields("u", "t", "h0/0", "float32", ((0, 4), (0, 5))))
            header = pb.ShardHeader(upload_id="u", tensor="t", device="h0/0", dtype="float32",
                                    box=pb.Box(lo=[0, 0], hi=[4, 5]), ticket=ticket)
            with pytest.raises(grpc.RpcError) as refused:
                stub.PutShardIpc(pb.IpcPutShardRequest(header=header, source=pb.CudaIpcTensor(**h.fields()),
                                                       digest=0))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "keeps its shards in host memory (--device cpu)" in refused.value.details()
    finally:
        server.stop(0)


# -- the SDK and the local cluster on CPU ---------------------------------------------------------------

def test_local_cluster_on_cpu_takes_and_returns_torch_cpu_tensors():
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], 2)
    with reshard.local_cluster(hosts=2, devices_per_host=2, device="cpu", transport="grpc") as c:
        assert {a["device"] for a in c.agents()} == {"cpu"}
        t = torch.randn(10, 6).to(torch.bfloat16)
        c.put("t", t, Sharding(mesh, ("x", "y")))
        back = c.get("t")
        assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and torch.equal(back, t)
        assert torch.equal(c.get("t", device="cpu"), t)
        assert torch.equal(c.get_shard("t", "host1/1", to="cpu"), t[5:, 3:])
        a = np.arange(60, dtype=np.int32).reshape(10, 6)
        c.put("a", a, Sharding(mesh, ("x", None)))
        assert isinstance(c.get("a"), np.ndarray) and np.array_equal(c.get("a"), a)  # numpy in, numpy out
        got = c.get("a", device="cpu")  # a device asks for torch
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), a)
        assert c.put_shard("s", "host0/0", torch.ones(5, 6), Sharding(mesh, ("x", None)), ipc=False, shape=(10, 6)) is False
        with pytest.raises(InvalidArgumentError, match="ipc=True hands over CUDA tensors"):
            c.put("n", a, Sharding(mesh, ("x", None)), ipc=True)
        with pytest.raises(InvalidArgumentError, match="ipc=True reads into a CUDA tensor"):
            c.get("a", ipc=True)
        with pytest.raises(InvalidArgumentError, match="ipc must be True, False or 'auto'"):
            c.get_shard("a", "host0/0", ipc="yes")
        with pytest.raises(FailedPreconditionError, match="this process sees no CUDA device"):
            c.get("a", device="cuda:0")


def _lines_until(stream, marker: str) -> list[str]:
    out: list[str] = []
    for line in stream:
        out.append(line)
        if marker in line:
            return out
    raise AssertionError(f"the output ended before a line with {marker!r}: {out}")


def test_reshard_up_takes_a_device():
    up = subprocess.Popen([sys.executable, "-m", "reshard.server.cli", "up", "--hosts", "2", "--devices-per-host",
                           "1", "--transport", "grpc", "--device", "cpu"], stdout=subprocess.PIPE, text=True)
    try:
        printed = "".join(_lines_until(up.stdout, "Ctrl-C"))
        assert re.findall(r"^agent\s+(host\d).* on (\S+)$", printed, re.MULTILINE) == [("host0", "cpu"), ("host1", "cpu")]
        token = open(re.search(r"token\s+(\S+)", printed).group(1)).read()
        with reshard.connect(re.search(r"planner\s+(\S+)", printed).group(1), token=token) as c:
            assert [(a["host"], a["device"]) for a in c.agents()] == [("host0", "cpu"), ("host1", "cpu")]
        up.send_signal(signal.SIGINT)
        assert up.wait(20) == 0
    finally:
        if up.poll() is None:
            up.kill()
        up.stdout.close()


def test_local_cluster_wants_one_device_per_host():
    with pytest.raises(InvalidArgumentError, match="device= gives 3 devices for 2 hosts"):
        LocalCluster(2, 1, device=["cpu"] * 3)
