"""The client's same-machine host path: a shard's bytes through shared memory to or from an agent of this machine.

Where CUDA IPC does not apply (the agent keeps its shards in host memory, the caller passes ``ipc=False``, or the
data is in host memory) and the agent runs on this machine (its ``DescribeDevice`` boot id is ours), a shard of
``MIN_BYTES`` or more goes through a shared-memory segment (`reshard.proto.shared_memory`) instead of a gRPC byte
stream: the client writes it into a segment (a CUDA tensor straight from its GPU, into pinned memory) and names the
region in one call, and the agent copies it out (reads run the other way round). One copy at each end, against a
stream's chunking, framing and socket copies. A segment is reused call after call; up to ``keep_bytes`` of free
segments stay (pinned where a GPU copy used them).

Every hand-over is checked: by the GPU digest where both the caller's tensor and the agent's shards are on GPUs
(each end computes it on its GPU), else by the XXH3-64 of the bytes in host memory. An agent that cannot open the
client's segment (another container's /dev/shm, another user) answers FAILED_PRECONDITION; the client then streams
to that agent from then on, as it does for an agent from before this path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import xxhash

from reshard.proto import devices
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import DataLossError
from reshard.proto.layout import np_dtype
from reshard.proto.shared_memory import MIN_BYTES, SegmentPool

__all__ = ["HostPath", "MIN_BYTES", "KEEP_BYTES"]

log = logging.getLogger(__name__)

KEEP_BYTES = 16 * 2**30  # free segments a client keeps for its next calls

Call = Callable[[str, Any], Any]  # (method, request) -> reply, raising domain errors (FailedPreconditionError for
# an agent that cannot take a segment, or has no such call)


class HostPath:
    """Which agents take shards through shared memory, and the hand-overs themselves."""

    def __init__(self, enabled: bool, keep_bytes: int = KEEP_BYTES):
        self.enabled = enabled
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._pool: Optional[SegmentPool] = None
        self._off: dict[str, str] = {}  # address -> why the path failed with that agent

    def usable(self, address: str, info: Optional[pb.AgentDevice], nbytes: int) -> bool:
        """Whether ``nbytes`` of a shard go through shared memory to or from the agent at ``address``, which
        described itself as ``info`` (None: it did not)."""
        if not self.enabled or nbytes < MIN_BYTES or info is None:
            return False
        with self._lock:
            if address in self._off:
                return False
        here = devices.machine_id()
        return bool(here) and info.machine_id == here

    def failed(self, address: str, error: Exception) -> None:
        """Stream to and from ``address`` from now on: it could not take a segment (``error`` says why)."""
        with self._lock:
            self._off[address] = str(error)
        log.info("the agent at %s takes no shared-memory segment from this client; streaming instead: %s",
                 address, error)

    def put(self, call: Call, header: pb.ShardHeader, arr, agent_on_gpu: bool,
            early: Optional[tuple[Any, devices.DeviceChecksum]] = None) -> None:
        """Hand over ``arr`` (a CUDA tensor, or a C-contiguous numpy array) as the shard ``header`` names;
        ``early``: the CUDA tensor made contiguous and its GPU digest under way, where the caller started one."""
        cuda = devices.is_cuda(arr)
        on_gpus = cuda and agent_on_gpu
        nbytes = arr.numel() * arr.element_size() if cuda else arr.nbytes
        segment = self._segments().take(nbytes)
        try:
            view = segment.view(0, nbytes)
            if cuda:
                import torch

                segment.pin()
                src, check = early or (arr.contiguous(), None)
                if on_gpus and check is None:
                    check = devices.DeviceChecksum().update(src)
                torch.from_numpy(view).copy_(src.reshape(-1).view(torch.uint8))  # GPU to host; waits for it
                digest = check.value if on_gpus else xxhash.xxh3_64_intdigest(view)
            else:
                np.copyto(view, np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                digest = xxhash.xxh3_64_intdigest(view)
            call("PutShardShm", pb.ShmPutShardRequest(
                header=header, region=pb.ShmRegion(name=segment.name, offset=0, nbytes=nbytes), digest=digest,
                device_digest=on_gpus))
        finally:
            self._segments().give(segment)

    def read(self, call: Call, request: pb.GetShardRequest, nbytes: int, dtype: str, shape: tuple[int, ...],
             to: Optional[str], agent_on_gpu: bool, deliver: Optional[Callable[[np.ndarray], None]] = None):
        """The shard ``request`` names (``nbytes`` of ``dtype`` in ``shape``): a torch tensor on ``to``, or with
        ``to`` None handed to ``deliver`` as a numpy view of the segment (valid during the call) and None
        returned."""
        on_gpus = to is not None and to != "cpu" and agent_on_gpu
        segment = self._segments().take(nbytes)
        try:
            view = segment.view(0, nbytes)
            if to is not None and to != "cpu":
                segment.pin()
            reply = call("GetShardShm", pb.ShmGetShardRequest(
                shard=request, region=pb.ShmRegion(name=segment.name, offset=0, nbytes=nbytes),
                device_digest=on_gpus))
            what = f"shared-memory read of {request.tensor!r} v{request.version} from device {request.device}"
            if to is None or to == "cpu" or not on_gpus:
                _expect(xxhash.xxh3_64_intdigest(view), reply.digest, "XXH3-64", what)
            values = view.view(np_dtype(dtype)).reshape(shape)
            if to is None:
                deliver(values)
                return None
            if to == "cpu":
                return devices.to_torch(values.copy(), dtype, "cpu")
            import torch

            out = torch.empty(shape, dtype=devices.torch_dtype(dtype), device=to)
            out.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(view))  # host to GPU
            if on_gpus:
                _expect(devices.device_digest(out), reply.digest, "GPU digest", what)
            return out
        finally:
            self._segments().give(segment)

    def _segments(self) -> SegmentPool:
        with self._lock:
            if self._pool is None:
                self._pool = SegmentPool(self.keep_bytes)
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _expect(got: int, want: int, kind: str, what: str) -> None:
    if got != want:
        raise DataLossError(f"{what}: the {kind} of the bytes received {got:016x} differs from the agent's "
                            f"{want:016x}")
