"""The SDK's client: metadata through the planner, tensor bytes straight to and from the agents.

Uploads are transactions: shards are staged on their agents and the tensor
enters the catalog only when every device's shard is there, so a client that
dies midway leaves nothing visible (the planner drops the staged shards once the
upload has been idle for its timeout).

Tensors go in as numpy arrays or torch tensors on any device, and come back as
they went in (numpy, or torch on the CPU) unless ``get``/``get_shard`` name a
torch device. A CUDA tensor streams through pinned host memory, except to or
from an agent on this machine that keeps its shards on a GPU: there it is handed
over by CUDA IPC (``ipc="auto"``, the default; ``ipc=True`` insists, ``False``
never tries), copied on the GPU and checked by a digest computed on the GPU at
both ends (`reshard.proto.devices`).

A put of a name that exists publishes its next version (optionally labeled with a
``step``); a reader pins versions (`Client.pin`) to keep reading them while newer
ones are published, and names them with ``version=`` (a `Pin` or a step label).
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import compress
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import grpc
import numpy as np

from reshard.box import Box, box_str, to_slices, volume
from reshard.client.frameworks import FrameworkAdapters
from reshard.client.host_path import HostPath
from reshard.proto import devices
from reshard.dtypes import bfloat16_to_float32, dtype_name, float32_to_bfloat16
from reshard.errors import ReshardError, ScaleLayoutError
from reshard.manifest import Manifest
from reshard.many import scale_pairs, scale_sharding
from reshard.mesh import host_of
from reshard.plans import Plan
from reshard.program import Program
from reshard.sequence import Op
from reshard.proto import reshard_pb2 as pb
from reshard.proto import reshard_pb2_grpc as pb_grpc
from reshard.proto.auth import TlsFiles, channel, resolve_token
from reshard.proto.errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from reshard.proto.layout import np_dtype, tile_shape
from reshard.proto.status import domain_error
from reshard.proto.wire import box_from_pb, message_size_options, read_shard_stream, shard_streams, unbatched
from reshard.sharding import Sharding

__all__ = ["Client", "connect", "Job", "JobResult", "JobFailedError", "TensorInfo", "Pin", "RegisteredSync"]

MiB = 2**20
PLANNER_MESSAGE_BYTES = 64 * MiB  # the largest request a planner takes by default (PlannerConfig.max_message_bytes)
_TARGETS_KEPT = 8  # reshard_many target lists kept as wire bytes (`Client._targets`)
_GROUP_WAIT_S = 5.0  # how long one FinishUploads of a shared group waits for the other ranks before asking again
# Tiles up to this size that go to one agent share a stream in put and put_many: a stream's set-up costs more
# than such a tile's bytes (a few ms on a 1 Gbit/s link), and larger tiles go on streams of their own, in parallel.
_BATCHED_SHARD_BYTES = 1 * MiB

Ipc = Union[bool, str]  # True, False or "auto": whether CUDA tensors go by CUDA IPC to agents on this machine


@dataclass(frozen=True)
class _TileRead:
    """One tile to read into host memory: which shard, where, its size, and what takes its values."""

    tensor: str
    version: int
    loc: pb.TileLocation
    nbytes: int
    deliver: Callable[[np.ndarray], None]
    dtype: str = ""  # the tensor's: a tile read through shared memory needs it (a stream's header says it)
    keeps: bool = True  # ``deliver`` may keep the array it is given: shared memory then hands it a copy


def _shard_header(upload_id: str, name: str, loc: pb.TileLocation, dtype: str) -> pb.ShardHeader:
    """The header of a PutShard or PutShardIpc of tile ``loc``, with the planner's ticket for it."""
    return pb.ShardHeader(upload_id=upload_id, tensor=name, device=loc.device, dtype=dtype, box=loc.box,
                          ticket=loc.ticket)


class JobFailedError(ReshardError, RuntimeError):
    """A reshard job ended in ``failed``; the message is the job's error text."""

    def __init__(self, message: str, job_id: str = ""):
        super().__init__(message)
        self.job_id = job_id


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding
    version: int
    kind: str
    lost: bool = False  # some tile has no copy left (every agent that held one restarted): get() raises DataLossError
    step: Optional[int] = None  # the version's label, as its publisher gave it (put(step=)); None: unlabeled
    pins: int = 0  # versions(): the pins holding this version (0 elsewhere)
    # versions(): held as half of the name's delta base pair, the versions its last reshard_many moved from and to,
    # which the next one diffs against (issue 40; the planner's --no-delta holds none)
    delta_base: bool = False

    def __str__(self) -> str:
        return (f"{self.name}: {self.dtype}{list(self.shape)} {self.sharding} v{self.version}"
                + (f" step {self.step}" if self.step is not None else "") + (" LOST" if self.lost else ""))


@dataclass(frozen=True)
class Pin:
    """Versions held for a reader (`Client.pin`): ``versions`` maps each tensor to the version held, which stays
    readable (``get(..., version=pin)``) while newer ones are published, until the pin is released (`Client.release`,
    or leaving a ``with`` block) or goes unused for the planner's ``--pin-timeout-s``."""

    id: str
    versions: dict[str, int]
    step: Optional[int] = None  # the step label it was pinned by, if any
    client: Optional["Client"] = field(default=None, repr=False, compare=False)  # what `__exit__` releases it with

    def __enter__(self) -> "Pin":
        return self

    def __exit__(self, *exc) -> None:
        if self.client is not None:
            self.client.release(self)


def _version_fields(version) -> dict:
    """The request fields that name a read's version: a `Pin`'s id, or a step label; None: none (current)."""
    if version is None:
        return {}
    if isinstance(version, Pin):
        return {"pin": version.id}
    if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
        return {"step": version}
    raise InvalidArgumentError(f"version={version!r}: give a Pin (c.pin(...)), a step label (an int >= 0), or None "
                               f"for the current versions")


def _step_fields(step) -> dict:
    """The request field of a version label to publish with (None: unlabeled)."""
    if step is None:
        return {}
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgumentError(f"step={step!r} must be an int >= 0 (such as the training step), or None")
    return {"step": step}


@dataclass(frozen=True)
class JobResult:
    id: str
    state: str
    tensor: str
    strategy: str
    plan_id: str
    seconds: float
    version: int
    progress: dict[str, tuple[int, int]]  # host -> (bytes sent, bytes to send)
    # host -> {"bytes_in": {peer: n}, "bytes_out": {peer: n}, "local_bytes": n, "native_reduces": n}: the last, how
    # many of the host's reduces ran as the transport's own all-reduce (gloo's) rather than the agents' ring;
    # "delta_wire_bytes"/"delta_full_bytes": {tensor: n}, what it sent for tensors moved as deltas, and what those
    # streams would have carried whole
    traffic: dict[str, dict]
    error: str = ""
    transport: str = ""  # what carried the network transfers: "grpc", "collective" or "nixl"
    transports: tuple[str, ...] = ()  # per plan transfer: "grpc", "collective", "nixl", or "local" (stayed on a host)
    transport_reason: str = ""  # why the job ran on `transport` (its hosts' modes, the group's state)
    versions: dict[str, int] = field(default_factory=dict)  # reshard_many: tensor -> the version it committed as
    # Where the job's seconds went, in order: waiting (for earlier jobs on its tensors), planning, running (every
    # host's part), committing; and each host's part of running, seconds (the slowest host sets the pace)
    phases: dict[str, float] = field(default_factory=dict)
    host_seconds: dict[str, float] = field(default_factory=dict)
    manifest_digest: str = ""  # reshard_many(manifest=): SHA-256 of the manifest the job was checked against
    # Delta sync (reshard_many): per tensor {"mode": "delta" or "full", "why", "bytes": network bytes sent for it,
    # "full_bytes": what a full move would have sent}; the job's network bytes had every tensor moved whole; what
    # the planner says of the job as a whole (e.g. that it fell back to full moves after a base mismatch)
    deltas: dict[str, dict] = field(default_factory=dict)
    full_network_bytes: int = 0
    delta_note: str = ""
    # Seconds from the request to every host's part of the job running (its agent's first report), on the
    # planner's clock: what starting the job cost (a weight sync's step waits this long before any byte moves)
    started_s: float = 0.0
    # Of it, until the planner's calls reached every host (each host's report less its agent's own seconds to start,
    # its prepare): what starting the job cost the planner
    handed_s: float = 0.0

    @property
    def network_bytes(self) -> int:
        """Bytes the job's hosts received over the network (delta frames as sent)."""
        return sum(sum(t["bytes_in"].values()) for t in self.traffic.values())


def _result(info: pb.JobInfo) -> JobResult:
    transports, versions, deltas = _per_tensor(info)
    return JobResult(
        id=info.id, state=info.state, tensor=info.tensor, strategy=info.strategy, plan_id=info.plan_id,
        seconds=info.seconds, version=info.version,
        progress={p.host: (p.bytes_done, p.bytes_total) for p in info.progress},
        traffic={t.host: {"bytes_in": dict(t.bytes_in), "bytes_out": dict(t.bytes_out), "local_bytes": t.local_bytes,
                          "native_reduces": t.native_reduces, "delta_wire_bytes": dict(t.delta_wire_bytes),
                          "delta_full_bytes": dict(t.delta_full_bytes)} for t in info.traffic},
        error=info.error, transport=info.transport, transport_reason=info.transport_reason,
        transports=transports, versions=versions,
        phases={p.name: p.seconds for p in info.phases}, host_seconds=dict(sorted(info.host_seconds.items())),
        manifest_digest=info.manifest_digest,
        deltas=deltas,
        full_network_bytes=info.full_network_bytes, delta_note=info.delta_note, started_s=info.started_s,
        handed_s=info.handed_s)


def _per_tensor(info: pb.JobInfo) -> tuple[tuple[str, ...], dict[str, int], dict[str, dict]]:
    """A reply's transports, versions and deltas (`JobResult`'s), from its columns (`pb.JobColumns`) or, from a
    planner before them, its messages."""
    if not info.HasField("columns"):
        return tuple(info.transports), dict(info.versions), {
            d.name: {"mode": d.mode, "why": d.why, "bytes": d.bytes, "full_bytes": d.full_bytes} for d in info.deltas}
    c = info.columns
    names, texts = c.names.split("\n") if c.names else [], list(c.texts)
    deltas = {n: {"mode": texts[m], "why": texts[w], "bytes": b, "full_bytes": f}
              for n, m, w, b, f in zip(names, c.delta_modes, c.delta_whys, c.delta_bytes, c.delta_full_bytes)}
    versions = dict(compress(zip(names, c.versions), c.versions))  # 0: commits none
    return tuple(map(texts.__getitem__, c.transports)), versions, deltas


def _delta(delta: Optional[bool]) -> Optional[bool]:
    """A reshard_many's ``delta``, checked."""
    if delta is not None and not isinstance(delta, bool):
        raise InvalidArgumentError(f"delta={delta!r}: give None (where it pays), True or False")
    return delta


class RegisteredSync:
    """A `reshard_many` the planner checked once (`Client.register_sync`): ``run`` starts it again, each step of a
    weight sync, naming it by ``id``."""

    def __init__(self, client: "Client", sync_id: str, num_tensors: int):
        self._client = client
        self.id = sync_id
        self.num_tensors = num_tensors  # the tensors each run commits, the weights' scales included

    def run(self, version=None, delta: Optional[bool] = None) -> "Job":
        """Start the sync's job and return it at once, as `Client.reshard_many` does: ``version`` (a `Pin` or a step
        label) names the versions it moves, which must be current (its job fails otherwise), and ``delta`` is
        `reshard_many`'s."""
        request = pb.SyncRequest(sync_id=self.id, **_version_fields(version))
        if _delta(delta) is not None:
            request.delta = delta
        return Job(self._client, self._client._planner_call("Sync", request))

    def __repr__(self) -> str:
        return f"RegisteredSync({self.id[:12]}, {self.num_tensors} tensors)"


class Job:
    """A reshard or compute job in flight. Many may run at once; jobs on one tensor run in submission order."""

    def __init__(self, client: "Client", info: pb.JobInfo):
        self._client = client
        self.id = info.id
        self.tensor = info.tensor

    def info(self, wait_s: float = 0.0, brief: bool = False) -> JobResult:
        """The job as the planner has it, waiting up to ``wait_s`` for it to end; ``brief``: while it runs, without
        its tensors' versions and deltas, its inputs and what carries each transfer (a state dict's job has
        millions), which a finished job's reply always has."""
        return _result(self._client._planner_call("GetJob", pb.JobRequest(job=self.id, wait_s=wait_s, brief=brief),
                                                  timeout=wait_s + self._client.timeout))

    def done(self) -> bool:
        return self.info(brief=True).state in ("succeeded", "failed")

    def progress(self) -> tuple[int, int]:
        """(bytes sent, bytes to send) summed over the agents."""
        p = self.info(brief=True).progress
        return sum(d for d, _ in p.values()), sum(t for _, t in p.values())

    def result(self, timeout: Optional[float] = None) -> JobResult:
        """Wait for the job; raises `JobFailedError` with the job's error, or `DeadlineExceededError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 5.0 if deadline is None else min(5.0, deadline - time.monotonic())
            info = self.info(wait_s=max(left, 0.0), brief=True)  # whole once it has ended
            if info.state == "succeeded":
                return info
            if info.state == "failed":
                raise JobFailedError(info.error, self.id)
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceededError(f"job {self.id} on {self.tensor!r} is still {info.state} after {timeout:g}s")

    def __repr__(self) -> str:
        return f"Job({self.id[:12]} on {self.tensor!r})"


def _check_ipc(ipc: Ipc) -> None:
    if not (ipc is True or ipc is False or ipc == "auto"):
        raise InvalidArgumentError(f"ipc must be True, False or 'auto'; got {ipc!r}")


def _source(array, ipc: Ipc):
    """(elements, dtype name, kind) of what the caller puts: a C-contiguous numpy array, or a CUDA tensor.

    bfloat16 and float8 elements, from torch or from an ml_dtypes array alike, come as numpy bits of their width
    (`np_dtype`); a plain uint16 or uint8 array is stored as what it is, integers.
    """
    _check_ipc(ipc)
    if type(array).__module__.startswith("torch"):
        t = array.detach()
        dtype = dtype_name(t.dtype)  # first: a dtype reshard lacks is named before any copy is made
        if ipc is True and not devices.is_cuda(t):
            raise InvalidArgumentError(f"ipc=True hands over CUDA tensors by CUDA IPC; this tensor is on {t.device}")
        return (t if devices.is_cuda(t) else devices.to_host(t)), dtype, "torch"
    if isinstance(array, np.ndarray):
        if ipc is True:
            raise InvalidArgumentError("ipc=True hands over CUDA tensors by CUDA IPC; a numpy array is in host memory")
        dtype = dtype_name(array.dtype)
        return np.ascontiguousarray(array).view(np_dtype(dtype)), dtype, "numpy"
    raise InvalidArgumentError(f"expected a numpy array or a torch tensor, got {type(array).__name__}")


def _early_digest(arr, ipc: Ipc) -> Optional[tuple[Any, devices.DeviceChecksum]]:
    """For a CUDA tensor that may go by CUDA IPC (or, failing that, through shared memory to a GPU agent): (it made
    contiguous, its digest started on its GPU), so that the digest runs while the caller waits for the planner; None
    for anything else. Nothing waits for the GPU here."""
    if ipc is False or not devices.is_cuda(arr) or not arr.numel():
        return None
    src = arr.contiguous()
    return src, devices.DeviceChecksum().update(src)


def _target(device: Optional[str], ipc: Ipc) -> Optional[str]:
    """The torch device a read returns on (None: as the tensor was put), checked in this process."""
    _check_ipc(ipc)
    to = None if device is None else devices.check_device(str(device))
    if to is not None:
        devices.import_torch(f"a read to device {to!r} (it returns a torch tensor)")
    if ipc is True and (to is None or to == "cpu"):
        raise InvalidArgumentError(f"ipc=True reads into a CUDA tensor by CUDA IPC: name a device such as 'cuda:0' "
                                   f"(got {device!r})")
    return to


def _from_numpy(arr: np.ndarray, dtype: str, kind: str):
    """What a read returns on the host: numpy, or torch for a tensor put from torch.

    bfloat16 and float8 arrive as numpy bits (`np_dtype`): as an ml_dtypes array when the tensor was not put from
    torch and ml_dtypes is importable here (JAX brings it), else as a torch tensor.
    """
    bits = np_dtype(dtype).name != dtype
    if bits and kind != "torch":
        try:
            import ml_dtypes
        except ImportError:
            pass
        else:
            return arr.view(getattr(ml_dtypes, dtype))
    if kind != "torch" and not bits:
        return arr
    try:
        return devices.to_torch(arr, dtype)
    except ImportError:
        raise FailedPreconditionError(f"the tensor is {dtype}, which numpy lacks; reading it needs ml_dtypes or "
                                      f"torch here: pip install ml_dtypes, or pip install 'reshard[torch]'") from None


def _sharding_of(sharding) -> Sharding:
    if not isinstance(sharding, Sharding):
        raise InvalidArgumentError(f"sharding must be a reshard.Sharding, got {type(sharding).__name__}")
    return sharding


def _sharding_json(sharding: Sharding) -> str:
    return _json_text(_sharding_of(sharding))


@functools.lru_cache(maxsize=1024)
def _json_text(sharding: Sharding) -> str:
    """Kept per layout: a state dict's hundreds of tensors share a few, and every weight-sync step sends them."""
    return json.dumps(sharding.to_json(), sort_keys=True)


class Client(FrameworkAdapters):
    """A connection to a reshard planner (``reshard.connect("host:port")``)."""

    def __init__(self, address: str, *, token: Optional[str] = None, tls: Optional[TlsFiles] = None,
                 timeout: float = 30.0, chunk_bytes: int = 4 * MiB, workers: int = 8, shared_memory: bool = True):
        """``token``: the cluster token (default: ``$RESHARD_TOKEN``, or the file ``$RESHARD_TOKEN_FILE``
        names); ``tls``: the CA (and, for mutual TLS, this client's certificate and key) when the cluster
        serves TLS. See docs/security.md. ``shared_memory``: shards of 1 MiB or more go to and from agents of
        this machine through shared memory, not a stream, where no CUDA IPC applies (`reshard.client.host_path`);
        False streams them."""
        self.address = address
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self._token = resolve_token(token)
        self._tls = tls
        # agents send at most 64 MiB chunks; a state dict's requests to the planner name every tensor (up to the
        # planner's PlannerConfig.max_message_bytes: a put_many of 32,000 small tensors is 4.6 MB)
        opts = message_size_options(max(chunk_bytes, PLANNER_MESSAGE_BYTES), 64 * MiB)
        self._options = opts
        self._channel = channel(address, token=self._token, tls=tls, options=opts)
        self._planner = pb_grpc.PlannerStub(self._channel)
        self._lock = threading.Lock()
        # (name, sharding) pairs of a reshard_many's targets -> those targets as wire bytes (`_targets`)
        self._targets_kept: OrderedDict[tuple, bytes] = OrderedDict()
        self._agents: dict[str, grpc.Channel] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reshard-sdk")
        self._agent_devices: dict[str, Optional[pb.AgentDevice]] = {}  # address -> what DescribeDevice said
        self._no_ipc: dict[str, str] = {}  # address -> why CUDA IPC with that agent failed
        self._addresses: dict[str, str] = {}  # host -> its agent's address, as ListAgents last said (`_require_ipc`)
        self._host_path = HostPath(shared_memory)
        self.cluster = None  # set by local_cluster

    # -- plumbing ---------------------------------------------------------------------

    def _planner_call(self, method: str, request, timeout: Optional[float] = None):
        size = request.ByteSize()
        if size > PLANNER_MESSAGE_BYTES:
            raise ResourceExhaustedError(
                f"{method} request of {size:,} bytes is over the {PLANNER_MESSAGE_BYTES:,} bytes a planner takes in "
                f"one message (PlannerConfig.max_message_bytes); split it into several calls of fewer tensors")
        try:
            return getattr(self._planner, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise domain_error(e, f"planner at {self.address}") from None

    def _agent(self, address: str) -> pb_grpc.AgentStub:
        if not address:
            raise UnavailableError("the agent holding this shard is down; wait for it to come back")
        with self._lock:
            ch = self._agents.get(address)
            if ch is None:
                ch = self._agents[address] = channel(address, token=self._token, tls=self._tls,
                                                     options=self._options)
        return pb_grpc.AgentStub(ch)

    def _ipc_with(self, address: str, ipc: Ipc) -> bool:
        """Whether a CUDA tensor goes to or from the agent at ``address`` by CUDA IPC (``ipc=True``: or why not)."""
        if ipc is False:
            return False
        why = self._why_no_ipc(address)
        if why and ipc is True:
            raise FailedPreconditionError(f"ipc=True, but {why}; pass ipc='auto' to stream the bytes instead")
        return not why

    def _describe(self, address: str) -> tuple[Optional[pb.AgentDevice], str]:
        """What the agent at ``address`` said of its device (asked once), or (None, why not)."""
        with self._lock:
            known, info = address in self._agent_devices, self._agent_devices.get(address)
        if known:
            return info, "" if info is not None else f"the agent at {address} has no CUDA IPC hand-over"
        try:
            info = self._agent(address).DescribeDevice(pb.Empty(), timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an agent from before CUDA IPC: never ask again
                with self._lock:
                    self._agent_devices[address] = None
            return None, f"the agent at {address} did not describe its device ({e.code().name})"
        with self._lock:
            self._agent_devices[address] = info
        return info, ""

    def _why_no_ipc(self, address: str) -> str:
        with self._lock:
            if address in self._no_ipc:
                return self._no_ipc[address]
        info, why = self._describe(address)
        if info is None:
            return why
        if info.device == "cpu":
            return f"the agent of host {info.host} keeps its shards in host memory (--device cpu)"
        if not info.machine_id or info.machine_id != devices.machine_id():
            return f"the agent of host {info.host} runs on another machine"
        if info.pid == os.getpid():
            return f"the agent of host {info.host} runs in this process, where CUDA cannot open its own IPC handles"
        return ""

    def _require_ipc(self, hosts) -> None:
        """Under ``ipc=True``, fail before an upload opens (and holds the name) when an agent of ``hosts`` cannot
        take a CUDA IPC hand-over. The agents' addresses are those the planner last listed (a ListAgents call costs
        a rank's every put_shard a round trip, and they rarely change); it is asked again where that list lacks one
        of ``hosts`` or an agent refuses, so an agent that came, or moved to another address, is found then."""
        hosts = set(hosts)
        with self._lock:
            addresses = dict(self._addresses)
        fresh = not hosts <= addresses.keys()
        if fresh:
            addresses = self._list_addresses()
        while True:
            try:
                for h in sorted(hosts & addresses.keys()):
                    self._ipc_with(addresses[h], True)
                return
            except FailedPreconditionError:
                if fresh:
                    raise
            addresses, fresh = self._list_addresses(), True

    def _list_addresses(self) -> dict[str, str]:
        """Every agent's address by host, asked of the planner now (`agents` keeps them for `_require_ipc`)."""
        return {a["host"]: a["address"] for a in self.agents()}

    def _ipc_failed(self, address: str, ipc: Ipc, error: FailedPreconditionError) -> None:
        """Under ``ipc="auto"``, remember that CUDA IPC with ``address`` does not work and stream from now on."""
        if ipc is True:
            raise error
        with self._lock:
            self._no_ipc[address] = f"CUDA IPC with the agent at {address} failed ({error})"

    def _ipc_call(self, address: str, method: str, request, what: str):
        """A CUDA IPC or shared-memory call to the agent at ``address``, raising its errors as the domain errors they
        stand for; an agent from before the call has it fail its precondition (the caller then streams)."""
        try:
            return getattr(self._agent(address), method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise FailedPreconditionError(f"the agent at {address} has no {method}: an older version") from None
            raise domain_error(e, f"agent at {address} ({what})") from None

    def _upload_all(self, shards: list[tuple[str, str, pb.TileLocation, str, Any]], ipc: Ipc) -> None:
        """Hand every (upload id, tensor, location, dtype, tile array) to its agent, streams in parallel. The small
        tiles in host memory that go to one agent travel in one stream (a PutShard of several shards), so a state
        dict of thousands of tiny tensors pays a stream per agent, not per tile."""
        batches: dict[str, list] = {}
        jobs = []
        for upload_id, name, loc, dtype, arr in shards:
            if not devices.is_cuda(arr) and arr.nbytes <= _BATCHED_SHARD_BYTES:
                batches.setdefault(loc.address, []).append((upload_id, name, loc, dtype, arr))
            else:
                jobs.append(self._pool.submit(self._upload, upload_id, name, loc.device, loc, dtype, arr, ipc))
        jobs += [self._pool.submit(self._upload_batch, address, batch) for address, batch in batches.items()]
        for f in jobs:
            f.result()

    def _upload_batch(self, address: str, batch: list[tuple[str, str, pb.TileLocation, str, Any]]) -> None:
        """Host-memory tiles to the agent at ``address`` in one PutShard stream."""
        chunks = shard_streams(((_shard_header(upload_id, name, loc, dtype), arr)
                                for upload_id, name, loc, dtype, arr in batch), self.chunk_bytes)
        try:
            self._agent(address).PutShard(chunks, timeout=None)
        except grpc.RpcError as e:
            what = (f"device {batch[0][2].device}" if len(batch) == 1
                    else f"{len(batch)} shards, devices {sorted({loc.device for _, _, loc, _, _ in batch})}")
            raise domain_error(e, f"agent at {address} ({what})") from None

    def _upload(self, upload_id: str, name: str, device: str, loc: pb.TileLocation, dtype: str, arr,
                ipc: Ipc, early: Optional[tuple[Any, devices.DeviceChecksum]] = None) -> None:
        """``early``: (the contiguous tensor, its digest under way), from `_early_digest`."""
        address, tile = loc.address, box_from_pb(loc.box)
        if devices.is_cuda(arr) and volume(tile) and self._ipc_with(address, ipc):
            src, check = early or _early_digest(arr, ipc)  # src stays alive until the agent has copied it
            try:
                digest = check.value  # waits for the GPU: the rank's writes before the call are in
                self._ipc_call(address, "PutShardIpc", pb.IpcPutShardRequest(
                    header=_shard_header(upload_id, name, loc, dtype),
                    source=pb.CudaIpcTensor(**devices.share_cuda(src).fields()),
                    digest=digest), f"device {device}")
                return
            except FailedPreconditionError as e:
                self._ipc_failed(address, ipc, e)
        if self._by_shm(address, arr.numel() * arr.element_size() if devices.is_cuda(arr) else arr.nbytes):
            try:
                self._host_path.put(self._shm_call(address, f"device {device}"),
                                    _shard_header(upload_id, name, loc, dtype), arr, self._agent_on_gpu(address),
                                    early)
                return
            except FailedPreconditionError as e:
                self._host_path.failed(address, e)
        host = devices.to_host(arr) if devices.is_cuda(arr) else arr
        self._upload_batch(address, [(upload_id, name, loc, dtype, host)])

    def _by_shm(self, address: str, nbytes: int) -> bool:
        """Whether ``nbytes`` of a shard go to or from the agent at ``address`` through shared memory."""
        return self._host_path.usable(address, self._describe(address)[0], nbytes)

    def _agent_on_gpu(self, address: str) -> bool:
        info = self._describe(address)[0]
        return info is not None and info.device not in ("", "cpu")

    def _shm_call(self, address: str, what: str):
        return lambda method, request: self._ipc_call(address, method, request, what)

    def _fetch(self, name: str, version: int, loc: pb.TileLocation, dtype: str, to: str, ipc: Ipc):
        """The tile ``loc`` names as a torch tensor on ``to``."""
        tile = box_from_pb(loc.box)
        if to != "cpu" and volume(tile) and self._ipc_with(loc.address, ipc):
            import torch

            out = torch.empty(tile_shape(tile), dtype=devices.torch_dtype(dtype), device=to)
            try:
                reply = self._ipc_call(loc.address, "GetShardIpc", pb.IpcGetShardRequest(
                    shard=pb.GetShardRequest(tensor=name, version=version, device=loc.device),
                    destination=pb.CudaIpcTensor(**devices.share_cuda(out).fields())), f"device {loc.device}")
            except FailedPreconditionError as e:
                self._ipc_failed(loc.address, ipc, e)
            else:
                got = devices.device_digest(out)
                if got != reply.digest:
                    raise DataLossError(f"CUDA IPC read of {name!r} v{version} from device {loc.device}: the digest "
                                        f"of the bytes received {got:016x} differs from the agent's {reply.digest:016x}")
                return out
        if self._by_shm(loc.address, volume(tile) * np_dtype(dtype).itemsize):
            try:
                return self._host_path.read(
                    self._shm_call(loc.address, f"device {loc.device}"),
                    pb.GetShardRequest(tensor=name, version=version, device=loc.device),
                    volume(tile) * np_dtype(dtype).itemsize, dtype, tile_shape(tile), to,
                    self._agent_on_gpu(loc.address))
            except FailedPreconditionError as e:
                self._host_path.failed(loc.address, e)
        arr = self._download(name, version, loc.device, loc.address).reshape(tile_shape(tile))
        return devices.to_torch(arr, dtype, to)

    def _download(self, name: str, version: int, device: str, address: str) -> np.ndarray:
        try:
            stream = self._agent(address).GetShard(pb.GetShardRequest(tensor=name, version=version, device=device))
            return read_shard_stream(unbatched(stream))[1]
        except grpc.RpcError as e:
            raise domain_error(e, f"agent at {address} (device {device})") from None

    # -- cluster -------------------------------------------------------------------------

    def agents(self) -> list[dict[str, Any]]:
        reply = self._planner_call("ListAgents", pb.Empty())
        with self._lock:
            self._addresses = {a.host: a.address for a in reply.agents}
        return [{"host": a.host, "address": a.address, "num_devices": a.num_devices, "up": a.up,
                 "heartbeat_age_s": a.heartbeat_age_s, "transport": a.transport or "grpc", "in_group": a.in_group,
                 "device": a.device or "cpu", "gpu_uuid": a.gpu_uuid, "transport_reason": a.transport_reason,
                 "memory_used_bytes": a.memory_used_bytes, "memory_limit_bytes": a.memory_limit_bytes,
                 "device_gflops": a.device_gflops, "memory_gb_per_s": a.memory_gb_per_s}
                for a in reply.agents]

    def devices(self) -> list[str]:
        """Device ids (``host/index``) of the agents that are up, host by host."""
        return [f"{a['host']}/{i}" for a in self.agents() if a["up"] for i in range(a["num_devices"])]

    # -- tensors ---------------------------------------------------------------------------

    def put(self, name: str, array, sharding: Sharding, *, step: Optional[int] = None,
            ipc: Ipc = "auto") -> TensorInfo:
        """Scatter a whole tensor: every device of ``sharding`` gets its tile, then the tensor appears; a name
        that exists gets its next version (same shape and dtype, any sharding), and readers that pinned the
        older one keep reading it.

        ``array`` is a numpy array or a torch tensor on any device; ``step`` labels the version (an int >= 0,
        such as the training step: ``get(name, version=step)`` reads it); ``ipc`` as in `put_shard`.
        """
        arr, dtype, kind = _source(array, ipc)
        step_fields = _step_fields(step)
        if ipc is True:
            self._require_ipc(_sharding_of(sharding).mesh.hosts)
        reply = self._planner_call("BeginUpload", pb.BeginUploadRequest(
            name=name, shape=arr.shape, dtype=dtype, sharding_json=_sharding_json(sharding), kind=kind,
            **step_fields))
        self._upload_all([(reply.upload_id, name, p, dtype, arr[to_slices(box_from_pb(p.box))])
                          for p in reply.locations], ipc)
        self._planner_call("FinishUpload", pb.FinishUploadRequest(
            upload_id=reply.upload_id, devices=[p.device for p in reply.locations]))
        return self.info(name)

    def put_shard(self, name: str, device: str, array, sharding: Sharding,
                  shape: Optional[Sequence[int]] = None, *, step: Optional[int] = None, ipc: Ipc = "auto") -> bool:
        """Hand over one device's shard, as a training rank does.

        The tensor appears in the catalog once every device of ``sharding`` has
        put its shard (all with the same shape, dtype and sharding); returns True
        for the call that completed it. ``shape`` is the global shape, required
        when ``sharding`` splits a dim: one shard cannot tell how long a split dim
        is (``torch.chunk`` cuts 13 and 16 rows over 4 devices alike into shards
        of 4, but the last of 13 has 1), so it is never guessed.

        A CUDA tensor goes to an agent on this machine that keeps its shards on a
        GPU by CUDA IPC under ``ipc="auto"``, and streams through pinned host memory
        otherwise; ``ipc=True`` fails rather than stream, ``ipc=False`` always
        streams. Either way the tensor may be freed once the call returns.

        A name that exists gets its next version, as with `put`; ``step`` labels it (every rank gives the same).
        """
        arr, dtype, kind = _source(array, ipc)
        step_fields = _step_fields(step)
        if ipc is True:
            self._require_ipc([host_of(device)])
        if shape is None:
            for d, (n, axes) in enumerate(zip(arr.shape, _sharding_of(sharding).dim_axes(arr.ndim))):
                ways = math.prod(sharding.mesh.axis_size(a) for a in axes)
                if ways > 1:
                    raise InvalidArgumentError(
                        f"put_shard of {name!r} on device {device} needs shape=, the global shape: {sharding.spec_str()} "
                        f"splits dim {d} {ways} ways, and a shard {n} long does not tell how long the dim is "
                        f"(torch.chunk cuts 13 rows over 4 devices as 4, 4, 4, 1 and 16 rows as 4, 4, 4, 4); pass "
                        f"shape= (a DTensor's .shape), or hand DTensors over with put_dtensor")
            shape = arr.shape
        early = _early_digest(arr, ipc)  # the GPU digests while the planner opens the upload
        reply = self._planner_call("BeginUpload", pb.BeginUploadRequest(
            name=name, shape=shape, dtype=dtype, sharding_json=_sharding_json(sharding), kind=kind,
            device=device, shard_shape=arr.shape, **step_fields))
        placement = next(p for p in reply.locations if p.device == device)
        self._upload(reply.upload_id, name, device, placement, dtype, arr, ipc, early)
        done = self._planner_call("FinishUpload", pb.FinishUploadRequest(upload_id=reply.upload_id, devices=[device]))
        return done.complete

    def put_shard_group(self, key: str, tensors: Mapping[str, tuple[Sequence[int], Any, Sharding]],
                        shards: Sequence[tuple[str, str, Any]], *, step: Optional[int] = None, kind: str = "torch",
                        ipc: Ipc = "auto", wait: bool = True) -> bool:
        """One process's part of a publish shared by several (the ranks of a DTensor state dict: `put_state_dict`
        calls it): ONE transaction for every tensor of every process.

        Every process calls it with the same ``key`` (a random string they share; `put_state_dict` broadcasts one
        through the mesh's process group) and the same ``tensors`` (``{name: (global shape, dtype, sharding)}``, in
        the same order, with the same ``step`` and ``kind``, else InvalidArgumentError naming the first difference)
        and hands over ``shards``, its own (``[(name, device, array)]``: each the tile its sharding gives that
        device; of a Partial sharding, the device's addends). The tensors' next versions enter the catalog
        together once every device of every tensor is in, and with ``wait`` every caller returns then (True); a
        caller that dies midway leaves nothing: the group expires after the planner's upload timeout, the others
        raise FailedPreconditionError naming the devices that never came, and no version changes. Without
        ``wait`` it returns once its shards are in: True for the call that committed the group.
        """
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"key={key!r}: give the group's key, a string every process shares")
        if not isinstance(tensors, Mapping) or not tensors:
            raise InvalidArgumentError("put_shard_group declares a non-empty dict {name: (shape, dtype, sharding)}")
        declared = [pb.BeginUploadRequest(name=n, shape=list(shape), dtype=dtype_name(dtype), kind=kind,
                                          sharding_json=_sharding_json(sharding))
                    for n, (shape, dtype, sharding) in tensors.items()]
        dtypes = {d.name: d.dtype for d in declared}
        sources = []
        for name, device, array in shards:
            if name not in dtypes:
                raise InvalidArgumentError(f"a shard of {name!r} is handed over, but the group declares "
                                           f"{list(dtypes)[:10]}; declare every tensor whose shards are put")
            arr, dtype, _ = _source(array, ipc)
            if dtype != dtypes[name]:
                raise InvalidArgumentError(f"the shard of {name!r} on device {device} is {dtype}, but the tensor is "
                                           f"declared {dtypes[name]}; convert it, or declare its dtype")
            sources.append((name, device, arr, dtype))
        mine = sorted({device for _, device, _, _ in sources})
        if ipc is True:
            self._require_ipc({host_of(d) for d in mine})
        reply = self._planner_call("BeginUploads", pb.BeginUploadsRequest(
            tensors=declared, group_key=key, devices=mine, **_step_fields(step)))
        where = {(name, loc.device): (opened.upload_id, loc)
                 for name, opened in zip(tensors, reply.uploads) for loc in opened.locations}
        work, done = [], {}
        for name, device, arr, dtype in sources:
            if (name, device) not in where:
                raise InvalidArgumentError(f"device {device!r} is not in the mesh of {name!r} "
                                           f"({_sharding_of(tensors[name][2]).mesh}); hand each tensor's shards to "
                                           f"its own devices")
            upload_id, loc = where[name, device]
            tile = box_from_pb(loc.box)
            if tuple(arr.shape) != tile_shape(tile):
                raise InvalidArgumentError(f"the shard of {name!r} on device {device} has shape {tuple(arr.shape)}, "
                                           f"but its sharding gives that device the tile {box_str(tile)}")
            work.append((upload_id, name, loc, dtype, arr))
            done.setdefault(upload_id, []).append(device)
        self._upload_all(work, ipc)
        request = pb.FinishUploadsRequest(group_id=reply.group_id, wait_s=_GROUP_WAIT_S if wait else 0.0, done=[
            pb.FinishUploadRequest(upload_id=u, devices=devs) for u, devs in done.items()])
        while True:
            finished = self._planner_call("FinishUploads", request, timeout=request.wait_s + self.timeout)
            if finished.complete or not wait:
                return finished.complete
            request = pb.FinishUploadsRequest(group_id=reply.group_id, wait_s=_GROUP_WAIT_S)

    def _tensor(self, name: str, version=None) -> pb.TensorInfo:
        return self._planner_call("GetTensor", pb.TensorRequest(name=name, **_version_fields(version)))

    def info(self, name: str) -> TensorInfo:
        return _info(self._tensor(name))

    def get(self, name: str, device: Optional[str] = None, *, ipc: Ipc = "auto", version=None):
        """Gather the whole tensor (one replica of each tile).

        By default numpy or torch on the CPU, as it was put; ``device`` (``"cpu"``,
        ``"cuda:0"``) returns a torch tensor there, its tiles read by CUDA IPC where
        ``ipc`` allows (see `put_shard`). ``version``: a `Pin` reads the version it holds
        (and renews it), an int reads the version labeled that step (still held: current
        or pinned); None reads the current version.
        """
        to = _target(device, ipc)
        finish, fetches, reads = self._gather(self._tensor(name, version), to, ipc)
        self._read_all(fetches, reads)
        return finish()

    def _read_all(self, fetches: list[Callable], reads: list["_TileRead"]) -> None:
        """Run ``fetches`` and ``reads`` at once on the pool. The small tiles read from one agent come in one stream
        (a GetShard of several shards), so thousands of tiny tensors cost a stream per agent, not per tile."""
        batches: dict[str, list[_TileRead]] = {}
        jobs = [self._pool.submit(fetch) for fetch in fetches]
        for r in reads:
            if r.nbytes <= _BATCHED_SHARD_BYTES:
                batches.setdefault(r.loc.address, []).append(r)
            else:
                jobs.append(self._pool.submit(self._read_one, r))
        jobs += [self._pool.submit(self._read_batch, address, batch) for address, batch in batches.items()]
        for f in jobs:
            f.result()

    def _read_one(self, r: "_TileRead") -> None:
        """One large tile into host memory: through shared memory from an agent of this machine, else streamed."""
        if self._by_shm(r.loc.address, r.nbytes):
            try:
                self._host_path.read(self._shm_call(r.loc.address, f"device {r.loc.device}"),
                                     pb.GetShardRequest(tensor=r.tensor, version=r.version, device=r.loc.device),
                                     r.nbytes, r.dtype, (r.nbytes // np_dtype(r.dtype).itemsize,), None,
                                     self._agent_on_gpu(r.loc.address),
                                     (lambda a: r.deliver(a.copy())) if r.keeps else r.deliver)
                return
            except FailedPreconditionError as e:
                self._host_path.failed(r.loc.address, e)
        self._read_batch(r.loc.address, [r])

    def _read_batch(self, address: str, batch: list["_TileRead"]) -> None:
        """Tiles from the agent at ``address``, in one GetShard stream, each handed to its ``deliver`` as it comes."""
        first, *more = [pb.GetShardRequest(tensor=r.tensor, version=r.version, device=r.loc.device) for r in batch]
        first.more.extend(more)
        try:
            stream = unbatched(self._agent(address).GetShard(first))
            for r in batch:
                header, values = read_shard_stream(stream)
                if (header.tensor, header.version, header.device) != (r.tensor, r.version, r.loc.device):
                    raise DataLossError(f"the agent at {address} sent the shard of {header.tensor!r} "
                                        f"v{header.version} on {header.device} where {r.tensor!r} v{r.version} on "
                                        f"{r.loc.device} was asked for")
                r.deliver(values)
        except grpc.RpcError as e:
            what = f"device {batch[0].loc.device}" if len(batch) == 1 else f"{len(batch)} shards"
            raise domain_error(e, f"agent at {address} ({what})") from None

    def _gather(self, t: pb.TensorInfo, to: Optional[str], ipc: Ipc
                ) -> tuple[Callable[[], Any], list[Callable], list["_TileRead"]]:
        """How to read tensor ``t`` whole: the calls that fetch its tiles onto a torch device, or the tiles to read
        into host memory (either runs at once, `_read_all`), and what returns the tensor once they ran."""
        name = t.name
        _check_not_lost(t)
        # One copy of each tile; of a Partial tensor, one of each tile's addends, which are summed.
        addend = _addend_of(Sharding.from_json(json.loads(t.sharding_json)))
        seen: dict[tuple, pb.TileLocation] = {}
        for p in t.locations:
            tile = box_from_pb(p.box)
            if p.lost or not all(lo < hi for lo, hi in tile):
                continue
            key = (tile, addend(p.device))
            if key not in seen or not seen[key].address:
                seen[key] = p
        partial = any(k[1] for k in seen)
        lock = threading.Lock()
        # numpy holds bfloat16 as its bits: addends are summed as float32 numbers and rounded once at the end
        bits16 = partial and t.dtype == "bfloat16"
        if to is None:
            out = (np.zeros if partial else np.empty)(tuple(t.shape), dtype=np.float32 if bits16 else np_dtype(t.dtype))

            def place(tile: Box, values: np.ndarray) -> None:
                values = values.reshape(tile_shape(tile))
                with lock:
                    if partial:
                        out[to_slices(tile)] += bfloat16_to_float32(values) if bits16 else values
                    else:
                        out[to_slices(tile)] = values

            itemsize = np_dtype(t.dtype).itemsize
            reads = [_TileRead(name, t.version, p, volume(tile) * itemsize, functools.partial(place, tile), t.dtype,
                               keeps=False) for (tile, _), p in seen.items()]
            if bits16:
                return (lambda: _from_numpy(float32_to_bfloat16(out), t.dtype, t.kind)), [], reads
            return (lambda: _from_numpy(out, t.dtype, t.kind)), [], reads
        else:
            import torch

            out = (torch.zeros if partial else torch.empty)(tuple(t.shape), dtype=devices.torch_dtype(t.dtype),
                                                            device=to)

            def fetch(tile: Box, p: pb.TileLocation) -> None:
                values = self._fetch(name, t.version, p, t.dtype, to, ipc).reshape(tile_shape(tile))
                with lock:
                    if partial:
                        out[to_slices(tile)] += values
                    else:
                        out[to_slices(tile)] = values

        return (lambda: out), [functools.partial(fetch, tile, p) for (tile, _), p in seen.items()], []

    # -- many tensors at once -------------------------------------------------------------------

    def put_many(self, tensors: Mapping[str, Any], *, scales: Optional[Mapping[str, str]] = None,
                 step: Optional[int] = None, ipc: Ipc = "auto") -> dict[str, TensorInfo]:
        """Scatter several whole tensors in one transaction: ``{name: (array, sharding)}``. They enter the catalog
        together, or none does (a failure, or a client that dies midway, leaves no tensor of them). Names that
        exist get their next versions, all visible at once, each labeled ``step`` (as in `put`).

        ``scales`` maps a weight's name to its block-scale tensor's, or to (name, block) where the block is not
        the weight's dim over the scale's: the scale's value may be the array alone, and takes the layout that
        follows its weight block for block (`reshard.many.scale_sharding`); given with a sharding, it must be
        that one. Arrays are numpy arrays or torch tensors, as `put` takes them. Returns
        every tensor's `TensorInfo`.
        """
        if not isinstance(tensors, Mapping) or not tensors:
            raise InvalidArgumentError(f"put_many takes a non-empty dict {{name: (array, sharding)}}; got "
                                       f"{type(tensors).__name__} {'(empty)' if not tensors else ''}")
        step_fields = _step_fields(step)
        follows = {s: (w, block) for w, (s, block) in scale_pairs(scales or {}).items()}
        arrays: dict[str, tuple[Any, str, str]] = {}
        shardings: dict[str, Optional[Sharding]] = {}
        for name, value in tensors.items():
            if isinstance(value, tuple) and len(value) == 2:
                array, sharding = value
                shardings[name] = _sharding_of(sharding)
            elif name in follows:
                array, shardings[name] = value, None
            else:
                raise InvalidArgumentError(
                    f"put_many value of {name!r} must be (array, sharding); got {type(value).__name__} (only a "
                    f"scale named in scales= may be the array alone: it takes its weight's layout)")
            arrays[name] = _source(array, ipc)
        for scale, (weight, block) in follows.items():
            if weight not in tensors or scale not in tensors:
                raise InvalidArgumentError(f"scales pairs {weight!r} with {scale!r}, but put_many puts "
                                           f"{sorted(tensors)[:10]}; put a weight and its scale together")
            if shardings[weight] is None:
                raise InvalidArgumentError(f"weight {weight!r} needs a sharding for its scale {scale!r} to follow")
            derived = scale_sharding(arrays[weight][0].shape, shardings[weight], arrays[scale][0].shape, weight,
                                     scale, block)
            if shardings[scale] is not None and shardings[scale] != derived:
                raise ScaleLayoutError(f"scale {scale!r} is given {shardings[scale]} but follows weight {weight!r} "
                                       f"into {derived}; give it that layout, or the array alone")
            shardings[scale] = derived
        if ipc is True:
            self._require_ipc({h for s in shardings.values() for h in s.mesh.hosts})
        reply = self._planner_call("BeginUploads", pb.BeginUploadsRequest(tensors=[
            pb.BeginUploadRequest(name=name, shape=arr.shape, dtype=dtype, sharding_json=_sharding_json(shardings[name]),
                                  kind=kind) for name, (arr, dtype, kind) in arrays.items()], **step_fields))
        shards = []
        for name, opened in zip(arrays, reply.uploads):
            arr, dtype, _ = arrays[name]
            shards += [(opened.upload_id, name, p, dtype, arr[to_slices(box_from_pb(p.box))]) for p in opened.locations]
        self._upload_all(shards, ipc)
        self._planner_call("FinishUploads", pb.FinishUploadsRequest(group_id=reply.group_id))
        infos = self._planner_call("GetTensors", pb.TensorsRequest(names=list(arrays))).tensors
        return {t.name: _info(t) for t in infos}

    def get_many(self, names: Sequence[str], device: Optional[str] = None, *, ipc: Ipc = "auto",
                 version=None) -> dict[str, Any]:
        """Gather several whole tensors, as the catalog holds them at one instant: each at the version a
        `reshard_many` committed them together, never some old and some new. ``device``, ``ipc`` and ``version``
        (a `Pin`, a step label, or None for the current versions) as in `get`."""
        if isinstance(names, str):
            raise InvalidArgumentError(f"get_many takes a list of tensor names; got the string {names!r} (use get)")
        to = _target(device, ipc)
        infos = self._planner_call("GetTensors", pb.TensorsRequest(names=list(names),
                                                                   **_version_fields(version))).tensors
        plans = {t.name: self._gather(t, to, ipc) for t in infos}
        self._read_all([f for _, fetches, _ in plans.values() for f in fetches],
                       [r for _, _, reads in plans.values() for r in reads])
        return {name: finish() for name, (finish, _, _) in plans.items()}

    def locate(self, names: Sequence[str], version=None) -> list[pb.TensorInfo]:
        """The catalog's records of ``names`` with their tiles' locations (the planner's ``TensorInfo`` messages),
        as they are at one instant, in one call; ``version`` as in `get_many`. With `read_tiles`, what reads
        weights into a caller's own buffers (`get_state_dict`)."""
        if isinstance(names, str):
            raise InvalidArgumentError(f"locate takes a list of tensor names; got the string {names!r}")
        return list(self._planner_call("GetTensors", pb.TensorsRequest(names=list(names),
                                                                       **_version_fields(version))).tensors)

    def read_tiles(self, tiles: Sequence[tuple[pb.TensorInfo, pb.TileLocation, Callable[[np.ndarray], None]]]
                   ) -> None:
        """Read each (tensor, location, deliver) of ``tiles``: the stored tile at ``location`` (one of the
        ``tensor``'s from `locate`) into host memory, handed to ``deliver`` as a flat numpy array of the tensor's
        dtype (bfloat16 and float8 as their bits) from one of the client's threads. Tiles are read at once, the
        small ones from one agent in one stream, so thousands of small tensors cost a stream per agent; deliveries
        of different tiles may run concurrently."""
        reads = []
        for info, loc, deliver in tiles:
            if loc.lost:
                raise DataLossError(f"the shard of {info.name!r} v{info.version} on device {loc.device} was lost: the "
                                    f"agent of host {host_of(loc.device)} restarted; read another copy")
            reads.append(_TileRead(info.name, info.version, loc, volume(box_from_pb(loc.box)) *
                                   np_dtype(info.dtype).itemsize, deliver, info.dtype))
        self._read_all([], reads)

    def get_shard(self, name: str, device: str, *, to: Optional[str] = None, ipc: Ipc = "auto"):
        """The tile ``device`` (``host/index``) holds; numpy or torch on the CPU, as the tensor was put.

        ``to`` (``"cpu"``, ``"cuda:0"``) returns a torch tensor on that torch device,
        read by CUDA IPC where ``ipc`` allows (see `put_shard`).
        """
        target = _target(to, ipc)
        t = self._tensor(name)
        p = next((p for p in t.locations if p.device == device), None)
        if p is None:
            raise NotFoundError(f"tensor {name!r} has no shard on device {device!r}; its devices are "
                                f"{[q.device for q in t.locations]}")
        if p.lost:
            raise DataLossError(f"the shard of {name!r} v{t.version} on device {device} (tile "
                                f"{box_str(box_from_pb(p.box))}) was lost: the agent of host {host_of(device)} restarted")
        if target is not None:
            return self._fetch(name, t.version, p, t.dtype, target, ipc)
        got: list[np.ndarray] = []
        self._read_one(_TileRead(name, t.version, p, volume(box_from_pb(p.box)) * np_dtype(t.dtype).itemsize,
                                 got.append, t.dtype))
        return _from_numpy(got[0].reshape(tile_shape(box_from_pb(p.box))), t.dtype, t.kind)

    def digests(self, name: str) -> dict[str, str]:
        """blake2b of every device's shard bytes, computed where the shards live (for verification)."""
        t = self._tensor(name)
        by_addr: dict[str, list[str]] = {}
        for p in t.locations:
            by_addr.setdefault(p.address, []).append(p.device)
        out: dict[str, str] = {}
        for address, held in by_addr.items():
            try:
                reply = self._agent(address).Digest(pb.DigestRequest(tensor=name, version=t.version, devices=held),
                                                    timeout=self.timeout)
            except grpc.RpcError as e:
                raise domain_error(e, f"agent at {address}") from None
            out.update(reply.blake2b)
        return out

    def tensors(self) -> list[TensorInfo]:
        return [_info(t) for t in self._planner_call("ListTensors", pb.Empty()).tensors]

    def delete(self, name: str) -> None:
        """Take ``name`` out of the catalog and free its version, unless a pin holds it: then it stays readable
        through the pin until released."""
        self._planner_call("DeleteTensor", pb.TensorRequest(name=name))

    def delete_many(self, names: Sequence[str]) -> None:
        """`delete` of every one of ``names`` in one call, their versions freed with one call per host: all of them,
        or none where one is unknown, named twice or in a queued or running job (the error names it)."""
        if isinstance(names, str):
            raise InvalidArgumentError(f"delete_many takes a list of tensor names; got the string {names!r} (use "
                                       f"[{names!r}])")
        self._planner_call("DeleteTensors", pb.DeleteTensorsRequest(names=list(names)))

    # -- versions ------------------------------------------------------------------------------

    def pin(self, names: Optional[Sequence[str]] = None, *, step: Optional[int] = None) -> Pin:
        """Hold, for each of ``names`` (None: every tensor in the catalog), its current version, or the version
        labeled ``step`` (NotFoundError naming the steps held when there is none), so that it stays readable
        (``get_many(names, version=pin)``) while newer versions are published and resharded. Release it with
        `release` or a ``with`` block; it expires after the planner's ``--pin-timeout-s`` without a read."""
        if isinstance(names, str):
            raise InvalidArgumentError(f"pin takes a list of tensor names; got the string {names!r} (use [{names!r}])")
        request = pb.PinRequest(names=list(names or ()), every=names is None, **_step_fields(step))
        info = self._planner_call("Pin", request)
        return Pin(info.id, dict(info.versions), info.step if info.HasField("step") else None, client=self)

    def release(self, pin: Pin) -> None:
        """Let go of ``pin``: the older versions no other pin holds are freed on their agents. Idempotent."""
        if not isinstance(pin, Pin):
            raise InvalidArgumentError(f"release takes a Pin (from c.pin()); got {type(pin).__name__}")
        self._planner_call("ReleasePin", pb.PinReleaseRequest(id=pin.id))

    def versions(self, name: str) -> list[TensorInfo]:
        """The versions held of ``name`` (current last, older ones while a pin or its delta base pair holds them),
        each with its version, step label, sharding, the number of readers' pins on it and whether it is half of the
        delta base pair (``delta_base``)."""
        return [_info(t) for t in self._planner_call("Versions", pb.TensorRequest(name=name)).tensors]

    # -- resharding ---------------------------------------------------------------------------

    def reshard(self, name: str, sharding: Sharding, strategy: str = "auto", *, delta: Optional[bool] = None) -> Job:
        """Start moving ``name`` to ``sharding``; returns a `Job` at once.

        ``delta`` (delta sync, as `reshard_many` takes it): True or False moves the tensor as a one-tensor
        `reshard_many`, whose commit keeps its base pair (the versions moved from and to), so that the next such
        move can carry only the elements that changed since: True moves a delta wherever a base pair is held, False
        moves it whole, and ``JobResult.deltas`` says how it moved. None, the default, is the plain move, which
        keeps no base pair (and so no old version's memory)."""
        if delta is not None:
            if not isinstance(delta, bool):
                raise InvalidArgumentError(f"delta={delta!r}: give True, False, or None (a plain move)")
            return self.reshard_many({name: sharding}, strategy, delta=delta)
        info = self._planner_call("Reshard", pb.ReshardRequest(name=name, dst_json=_sharding_json(sharding),
                                                               strategy=strategy))
        return Job(self, info)

    def reshard_many(self, shardings: Mapping[str, Sharding], strategy: str = "auto",
                     bucket_mib: Optional[float] = None, scales: Optional[Mapping[str, str]] = None, *,
                     manifest: Optional[Manifest] = None, version=None, delta: Optional[bool] = None,
                     dtype: Union[str, Mapping[str, str], None] = None) -> Job:
        """Start moving every tensor of ``shardings`` (``{name: sharding}``) to its sharding in one job; returns a
        `Job` at once.

        One program for all of them, planned together (`reshard.many.plan_many`): senders balanced over every
        tensor, moves smaller than ``bucket_mib`` packed into streams of at least that (None: the planner's
        default, 0: none). One commit: every tensor's new version becomes visible together, or, if the job fails,
        none does and each stays readable at its old one (``JobResult.versions`` has the new ones). ``scales``
        maps a weight to its block-scale tensor (or to (name, block), as in `put_many`), which follows the
        weight's new layout block for block: leave the scale out of ``shardings``.

        ``manifest`` (a `reshard.Manifest`, e.g. ``Manifest.from_module(model)``) is what the consumer expects: the
        planner refuses the job before any byte moves when a tensor it lists is not moved or not in the catalog,
        one moved is not in it, or one has another shape or dtype, listing each (INVALID_ARGUMENT, raised here as
        `InvalidArgumentError`), and the job records its digest (``JobResult.manifest_digest``).

        ``version`` (a `Pin` or a step label, as in `get_many`) names the versions to move, which must be the
        current ones (FailedPreconditionError otherwise: a newer version was published); the versions it commits
        carry their step label, and the ones they supersede stay readable while a pin holds them.

        ``delta`` (delta sync): None moves each tensor as the changes since its previous sync where the planner
        holds that sync's versions (its base pair) and a delta pays: the link time its change rate saves against
        its hosts' CPU to diff and apply (whole on fast links); False moves every
        tensor whole; True moves changes wherever a base pair is held. Either way the result is bit-exact;
        ``JobResult.deltas`` says per tensor how it moved, why, and its bytes against a full move's.

        ``dtype`` quantizes on the way: one dtype name for every tensor (less the scales), or ``{name: dtype}``.
        Today ``"float8_e4m3fn"`` from bfloat16, float16 or float32 is the conversion (`reshard.quantize`): each
        such tensor must be 2-D and have a scale in ``scales``, which the job makes (float32, one entry per 128 x
        128 block, or per ``block`` where ``scales`` names one) or publishes the next version of; the senders
        quantize before the moves, so the wire carries the fp8 values and their scales. The new versions are
        float8_e4m3fn and float32; the old bf16 version stays readable until the commit, and after it while a pin
        holds it. A tensor asked for in its own dtype moves as it is; any other dtype raises
        `InvalidArgumentError` naming the tensor, its dtype, what was asked and what is supported. Such a tensor
        never moves as a delta (``JobResult.deltas`` says it was quantized).
        """
        request = self._many_request("reshard_many", shardings, strategy, bucket_mib, scales, manifest, dtype)
        request.MergeFrom(pb.ReshardManyRequest(**_version_fields(version)))
        if _delta(delta) is not None:
            request.delta = delta
        return Job(self, self._planner_call("ReshardMany", request))

    def register_sync(self, shardings: Mapping[str, Sharding], strategy: str = "auto",
                      bucket_mib: Optional[float] = None, scales: Optional[Mapping[str, str]] = None, *,
                      manifest: Optional[Manifest] = None,
                      dtype: Union[str, Mapping[str, str], None] = None) -> "RegisteredSync":
        """A weight sync's `reshard_many`, checked once by the planner and then run every step by
        `RegisteredSync.run`, which sends no names or shardings: the arguments are `reshard_many`'s (the versions
        and ``delta`` go to each run). The planner checks the request again at a run only where a tensor's shape
        or dtype, the catalog's names or an agent's registration changed since (a sync that quantizes on the way,
        whose weights go fp8 and back every step, compares its tensors' dtypes with those it was checked with); a
        tensor put back in another sharding is planned again by that run. The planner keeps the last 64 syncs registered, in memory: a run
        of one it forgot (it restarted) raises `NotFoundError`; register it again."""
        request = self._many_request("register_sync", shardings, strategy, bucket_mib, scales, manifest, dtype)
        info = self._planner_call("RegisterSync", request)
        return RegisteredSync(self, info.sync_id, info.num_tensors)

    def _many_request(self, what: str, shardings: Mapping[str, Sharding], strategy: str,
                      bucket_mib: Optional[float], scales: Optional[Mapping[str, str]], manifest: Optional[Manifest],
                      dtype: Union[str, Mapping[str, str], None]) -> pb.ReshardManyRequest:
        """A `reshard_many` (``what``) request but its versions and delta."""
        if not isinstance(shardings, Mapping):
            raise InvalidArgumentError(f"{what} takes a dict {{name: sharding}}; got {type(shardings).__name__}")
        request = self._targets(shardings)
        request.strategy = strategy
        request.scales.extend(pb.ScalePair(weight=w, scale=s, block=block or ())
                              for w, (s, block) in scale_pairs(scales or {}).items())
        if dtype is not None:
            # One dtype for all asks it of every tensor but the scales, which stay float32; the planner checks the rest.
            followers = {s for s, _ in scale_pairs(scales or {}).values()}
            asked = dtype if isinstance(dtype, Mapping) else {n: dtype for n in shardings if n not in followers}
            try:
                request.dtypes.update({n: d if isinstance(d, str) else dtype_name(d) for n, d in asked.items()})
            except (TypeError, ValueError) as e:
                raise InvalidArgumentError(f"dtype={dtype!r}: give one dtype name such as 'float8_e4m3fn', or a dict "
                                           f"of tensor name -> dtype name ({e})") from None
        if manifest is not None:
            if not isinstance(manifest, Manifest):
                raise InvalidArgumentError(f"manifest must be a reshard.Manifest (Manifest.from_module(model)); got "
                                           f"{type(manifest).__name__}")
            request.manifest_json = manifest.json_text()
        if bucket_mib is not None:
            if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, (int, float)) or not bucket_mib >= 0:
                raise InvalidArgumentError(f"bucket_mib={bucket_mib!r}: give a size in MiB, 0 for no buckets, or None "
                                           f"for the planner's default")
            request.bucket_bytes = int(bucket_mib * MiB)
        return request

    def _targets(self, shardings: Mapping[str, Sharding]) -> pb.ReshardManyRequest:
        """A request holding ``shardings`` as its targets. The targets of the last few state dicts asked for are kept
        as wire bytes, read back when the same names and layouts come again: a weight sync sends the same dict
        every step, and building 501 targets took 2.6 ms of every request, which the job waited for (reading them
        back, 0.05 ms)."""
        key = tuple(shardings.items())
        if not all(isinstance(s, Sharding) for _, s in key):  # refused as the targets are built, naming the type
            return pb.ReshardManyRequest(targets=[pb.TensorTarget(name=n, dst_json=_sharding_json(s)) for n, s in key])
        with self._lock:
            wire = self._targets_kept.get(key)
            if wire is not None:
                self._targets_kept.move_to_end(key)
        if wire is not None:
            return pb.ReshardManyRequest.FromString(wire)
        request = pb.ReshardManyRequest(targets=[pb.TensorTarget(name=n, dst_json=_sharding_json(s)) for n, s in key])
        with self._lock:
            self._targets_kept[key] = request.SerializeToString()
            while len(self._targets_kept) > _TARGETS_KEPT:
                self._targets_kept.popitem(last=False)
        return request

    def plan(self, tensor: Union[str, Sequence[int]], dst: Sharding, strategy: str = "auto", *,
             dtype: Optional[str] = None, src: Optional[Sharding] = None) -> Plan:
        """Dry run: the plan a reshard of ``tensor`` (a name, or a shape with ``dtype`` and ``src``) would run."""
        if isinstance(tensor, str):
            req = pb.PlanRequest(name=tensor, dst_json=_sharding_json(dst), strategy=strategy)
        else:
            if dtype is None or src is None:
                raise InvalidArgumentError("plan(shape, dst) needs dtype= and src= when no tensor name is given")
            req = pb.PlanRequest(shape=list(tensor), dtype=dtype_name(dtype), src_json=_sharding_json(src),
                                 dst_json=_sharding_json(dst), strategy=strategy)
        return Plan.from_json(self._planner_call("Plan", req).plan_json)

    # -- compute on the agents --------------------------------------------------------------------

    def _compute_request(self, op: str, inputs: Sequence[str], out: str, out_sharding: Optional[Sharding],
                         strategy: str, params: dict) -> pb.ComputeRequest:
        if not isinstance(out, str) or not out:
            raise InvalidArgumentError(f"out={out!r}: give the output tensor a name")
        bad = [x for x in inputs if not isinstance(x, str)]
        if bad:
            raise InvalidArgumentError(f"inputs are tensor names in the catalog; got {type(bad[0]).__name__} "
                                       f"(put arrays first with put)")
        return pb.ComputeRequest(op=op, inputs=list(inputs), out=out, strategy=strategy,
                                 out_sharding_json=_sharding_json(out_sharding) if out_sharding is not None else "",
                                 params={k: _param_text(k, v) for k, v in params.items()})

    def einsum(self, equation: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None,
               strategy: str = "auto") -> Job:
        """Run ``numpy.einsum(equation, *inputs)`` on the agents, where the inputs' shards are; the result is
        tensor ``out`` (a new version of it when it exists). Returns a `Job` at once.

        Mesh-TensorFlow's rule: each device runs the einsum on its tiles and a summed dim split over mesh axes is
        all-reduced over them. ``out_sharding`` None keeps the layout's splits of the output dims (replicated over
        the reduced axes); a Partial one leaves the sum pending, one that adds a reduced axis to an output dim
        reduce-scatters onto it, any other layout or mesh is reached by a reshard. Inputs whose layouts conflict
        are moved first, into the layout the cost model prices lowest (`plan_einsum` shows the program). One input
        is an einsum too: ``einsum("ij->i", "x", out="y")`` sums over ``j``, ``einsum("ij->ji", ...)`` transposes.
        """
        return Job(self, self._planner_call("Compute", self._compute_request(
            "einsum", inputs, out, out_sharding, strategy, {"equation": equation})))

    def plan_einsum(self, equation: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None,
                    strategy: str = "auto") -> Program:
        """Dry run of `einsum`: the program it would run now (its steps, ``estimate_seconds``, ``host_bytes()``,
        ``summary()``, and the chosen layout as text, ``einsum_layout_text``); moves no data."""
        return _program(self._planner_call("PlanCompute", self._compute_request(
            "einsum", inputs, out, out_sharding, strategy, {"equation": equation})))

    def apply(self, op: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None, strategy: str = "auto",
              **params) -> Job:
        """Run kernel ``op`` on the agents' shards of ``inputs`` into tensor ``out``; returns a `Job` at once.

        ``op``: ``add``, ``sub``, ``mul`` (inputs of one shape), ``scale`` (``factor=``), ``relu``, ``relu_grad``
        (x, g), ``axpy`` (w, g, ``alpha=``: w - alpha * g), ``sum`` / ``max`` (``dims=[...]``, dropped; a sum over
        every dim gives a scalar), ``softmax_xent`` (logits, targets, ``axis=``: the per-row loss),
        ``softmax_xent_grad`` (``axis=``, ``scale=``), ``fp8_quantize`` (a 2-D bf16 tensor to float8 e4m3 codes
        with ``block=`` x ``block`` blocks, 128 by default; its tiles must start on block boundaries). Inputs in
        different layouts are moved to a common one
        first (the cost model picks it); ``out`` may name an input (``apply("axpy", "w", "g", out="w", alpha=lr)``
        gives ``w`` a new version).
        """
        return Job(self, self._planner_call("Compute", self._compute_request(op, inputs, out, out_sharding, strategy,
                                                                             params)))

    def plan_apply(self, op: str, *inputs: str, out: str, out_sharding: Optional[Sharding] = None,
                   strategy: str = "auto", **params) -> Program:
        """Dry run of `apply`: the program it would run now; moves no data."""
        return _program(self._planner_call("PlanCompute", self._compute_request(op, inputs, out, out_sharding,
                                                                                strategy, params)))

    def _compute_many_request(self, ops: Sequence[Op], strategy: str) -> pb.ComputeManyRequest:
        if isinstance(ops, Op) or not all(isinstance(op, Op) for op in ops):
            raise InvalidArgumentError("compute_many takes a list of reshard.Op, e.g. [Op.einsum('bi,io->bo', 'x', "
                                       "'w', out='z'), Op.apply('relu', 'z', out='h')]")
        return pb.ComputeManyRequest(strategy=strategy, ops=[
            self._compute_request(op.op, op.inputs, op.out, op.out_sharding, strategy, op.params) for op in ops])

    def compute_many(self, ops: Sequence[Op], strategy: str = "auto") -> Job:
        """Run ``ops`` (`reshard.Op`: einsums and kernels, as `einsum` and `apply` take them) in order as ONE job:
        one program, planned on the layouts the earlier ops leave, and one commit of every output, so a reader
        sees all of them old or all new. An op that names a tensor an earlier op writes reads that result. Saves
        each op the job's fixed cost (a layer's forward: the einsum and its relu in one job). Returns a `Job`."""
        return Job(self, self._planner_call("ComputeMany", self._compute_many_request(ops, strategy)))

    def plan_compute_many(self, ops: Sequence[Op], strategy: str = "auto") -> Program:
        """Dry run of `compute_many`: the program it would run now; moves no data."""
        return _program(self._planner_call("PlanComputeMany", self._compute_many_request(ops, strategy)))

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._host_path.close()
        with self._lock:
            for ch in self._agents.values():
                ch.close()
            self._agents.clear()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"reshard.Client({self.address!r})"


def _param_text(name: str, value) -> str:
    """A kernel parameter as the wire carries it: numbers as text, dims as ``"0,2"``."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(int(v)) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgumentError(f"parameter {name}={value!r}: give a number, a string or a list of dims")
    return repr(value) if isinstance(value, float) else str(value)


def _program(reply: pb.ProgramReply) -> Program:
    """The program of a dry run, with the layout the planner chose as text (``einsum_layout_text``): its JSON
    leaves the layout out, for the layout is no part of a program's content."""
    program = Program.from_json(reply.program_json)
    return replace(program, einsum_layout_text=reply.layout) if reply.layout else program


def _addend_of(sharding: Sharding):
    """device -> its coordinates along the sharding's partial axes (empty when it is not Partial)."""
    if not sharding.partial:
        return lambda device: ()
    mesh = sharding.mesh
    index = [mesh.axis_index(a) for a in sharding.partial]
    position = {d: i for i, d in enumerate(mesh.require_devices())}
    return lambda device: tuple(mesh.coords(position[device])[i] for i in index)


def _check_not_lost(t: pb.TensorInfo) -> None:
    """Raise DataLossError naming every tile of ``t`` whose every copy was lost, and the devices that held them."""
    if not t.lost:
        return
    held: dict[Box, list[pb.TileLocation]] = {}
    for p in t.locations:
        held.setdefault(box_from_pb(p.box), []).append(p)
    gone = {tile: [p.device for p in ps] for tile, ps in held.items() if all(p.lost for p in ps)}
    shown = "; ".join(f"tile {box_str(tile)} held by {', '.join(devs)}" for tile, devs in list(gone.items())[:8])
    raise DataLossError(f"tensor {t.name!r} v{t.version} lost {len(gone)} of its {len(held)} tiles: every agent that "
                        f"held them restarted ({shown}{'; ...' if len(gone) > 8 else ''}); put it again, or delete it")


def _info(t: pb.TensorInfo) -> TensorInfo:
    return TensorInfo(t.name, tuple(t.shape), t.dtype, Sharding.from_json(json.loads(t.sharding_json)), t.version,
                      t.kind, t.lost, t.step if t.HasField("step") else None, t.pins, t.delta_base)


def connect(address: str, **kwargs) -> Client:
    """A client of the planner at ``address`` (``"host:port"``)."""
    return Client(address, **kwargs)
