"""An agent's runtime: it runs the host's part of programs, many at once, each as a dependency graph.

A program (``reshard.program``) is steps with ids and dependencies (``step.after``). On
one host a step becomes *tasks*, one per role the host has in it:

=========== ========================================================================
send        a move's sender: copies into its receivers on this host, then the box to
            the remote receivers or down the chain (`Transport.move`)
recv        one hop of a move that arrives here: write, forward, verify (`Transport.take`)
compute     a named kernel on local tiles (`KERNELS`: those of ``reshard.kernels``)
reduce      this host's devices' part of a group reduce (`Transport.reduce`: a ring, or gloo's own
            all-reduce on the collective transport; a step that asks for the ``chain`` algorithm
            runs the same way, with the same result)
=========== ========================================================================

A step is *done here* when all its tasks on this host are. A send, compute or reduce
task starts as soon as every step in its ``after`` that has tasks here is done here
(its inputs are present, local or arrived); independent tasks overlap on a pool shared
by all programs. A receive needs nothing: a passive transport (gRPC, memory) hands the
pushed stream to `Runtime.accept` whenever it comes. Every running task has a deadline
(``step_timeout_s``; a passive receive counts from Execute, ``depth + 1`` timeouts, since
its sender may wait for earlier steps); when one passes, or any task fails, the
program fails: queued tasks never start, running ones stop at their next piece, and
nothing was written but the program's staged destination buffers, which only the
planner's commit makes visible, so every source stays intact.

**No deadlock on the collective transport.** There a receive is a call that blocks a
lane until its peer sends, so tasks cannot simply start when ready. Every host orders
its tasks by (dependency depth, then `interleaved` order within a depth, computed from
the program alone, so every host agrees) and groups a depth's tasks that call peers into
*units* (`lane_units`: the moves along one route, in that order, or one other task),
ordered largest first, again from the program alone. It runs a depth's units FIFO on
``lanes`` threads, each unit's tasks one after another, move units under
``SMALL_UNIT_BYTES`` FIFO on ``lanes`` threads of their own (tasks that call no peer,
local copies and computes, run beside them on the shared pool: they cannot block a
peer), and starts depth ``k + 1`` only after its own depth-``k`` tasks finished: a barrier
per host, not a global one. The tasks beside the lanes finish by themselves. Which
lanes a unit takes is again the program's to say, so each set of lanes runs one
sub-order that every host agrees on. Take the least unfinished unit in one set's order:
on each of its hosts every lower-depth task is finished (by induction on depth), so the
host is at its depth, and every unit before it in that set is finished, so it holds a
lane of the set or is next in its FIFO. Hence it runs on all its hosts at once, whatever
the other set does; its tasks come in the same order on each, and each calls only that
unit's hosts, so each completes; by induction on the order every unit of the depth does.
Before a depth's first call a host confirms, through the planner's store, that its new
peers run the same program on the same group generation (`Transport.handshake`), so a
mismatch raises instead of hanging a receive.

Shard buffers are read and written only through `reshard.server.transport.buffers`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from reshard import box as boxes
from reshard.box import Box
from reshard.cost import sender_bytes
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.jsonio import loads
from reshard.kernels import KERNELS as KERNEL_RULES
from reshard.kernels import axis_param, dims_param, float_param
from reshard.many import program_from_json
from reshard.mesh import host_of
from reshard.program import COMPUTE, DST, MOVE, REDUCE, SRC, Program, Step
from reshard.proto.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from reshard.proto.layout import Checksum, chunk_boxes, digest, tile_shape
from reshard.server.agent.buckets import BUCKETS_KEY, BYTES, Bucket, bucket_moves
from reshard.server.agent.matmul import einsum2
from reshard.server.agent.pace import DevicePace
from reshard.server.agent.staging import NoTiles, StagedTiles, staged_bytes, staging_owner, tile_plan
from reshard.server.agent.store import ShardStore, TileBuffer
from reshard.server.common.config import AgentConfig, PlannerConfig
from reshard.server.common.contract import PROGRAM_NOT_HELD, PROGRAMS_KEPT, PROGRAMS_KEPT_BYTES
from reshard.server.common.sizes import format_size
from reshard.server.common.tickets import program_digest
from reshard.server.transport import buffers
from reshard.server.transport.base import (
    PushHeader,
    Session,
    dtype_pairs_of,
    Traffic,
    Transport,
    first_peer,
    hop_targets,
    interleaved,
    receiving_hops,
    sending_peers,
    stream_count,
)

__all__ = ["Runtime", "Run", "Task", "KERNELS", "host_tasks", "load_program"]

log = logging.getLogger(__name__)

_IDLE_LANES_KEPT = 4  # a runtime's idle lane pools of each lane count (`Runtime._lanes`), for jobs that overlap


# -- kernels ------------------------------------------------------------------------------------------
#
# The math of every kernel is written once, over a backend: numpy on CPU agents, torch on the GPU of a CUDA agent
# (the output buffer says which). numpy holds bfloat16 as uint16 bits (`buffers`), so a CPU agent computes on
# those tiles in float32 and rounds back. Integer einsums run in numpy wherever the tiles live: CUDA has no
# integer matmul. Shapes and params were checked against `reshard.kernels` when the program was validated.


class _Numpy:
    @staticmethod
    def operand(x):
        x = buffers.host_array(x) if buffers.is_torch(x) else np.asarray(x)
        if x.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
            return bfloat16_to_float32(x)
        return x

    @staticmethod
    def result(values, output):
        values = np.asarray(values)
        if output.dtype == np.uint16 and values.dtype != np.uint16:  # round to nearest even bfloat16
            return float32_to_bfloat16(values)
        return values

    @staticmethod
    def einsum(eq, *xs):
        return einsum2(eq, *xs) if len(xs) == 2 else np.einsum(eq, *xs, optimize=True)  # BLAS for contractions
    relu = staticmethod(lambda x: np.maximum(x, np.zeros((), x.dtype)))

    @staticmethod
    def relu_grad(x, g, out=None):
        """``g`` where ``x > 0``, else +0, bit for bit as ``np.where`` gives it in about a quarter of its time
        (``np.where`` on a mask takes a slow path): ``g``'s bits ANDed with all ones where ``x > 0``, all
        zeros (+0.0) elsewhere. Into ``out`` when given (``g``'s shape and dtype)."""
        if x.shape != g.shape or g.dtype.kind != "f":
            values = np.where(x > 0, g, np.zeros((), g.dtype))
            if out is None:
                return values
            out[...] = values
            return out
        out = np.empty_like(g) if out is None else out
        mask = out.view(f"i{g.dtype.itemsize}")  # 1 where x > 0, then -1 (all ones), then g's bits or none
        np.greater(x, 0, out=mask, casting="unsafe")
        np.negative(mask, out=mask)
        np.bitwise_and(g.view(mask.dtype), mask, out=mask)
        return out
    exp = staticmethod(np.exp)
    log = staticmethod(np.log)

    @staticmethod
    def sum(x, dims, keep=False):
        return np.sum(x, axis=dims, keepdims=keep)

    @staticmethod
    def max(x, dims, keep=False):
        info = np.finfo if np.issubdtype(x.dtype, np.floating) else np.iinfo
        least = -np.inf if info is np.finfo else (False if x.dtype == bool else info(x.dtype).min)
        return np.max(x, axis=dims, keepdims=keep, initial=least)


class _Torch:
    @staticmethod
    def operand(x, device):
        if buffers.is_torch(x):
            return x.to(device)
        x = np.asarray(x)
        return buffers.to_device(x, "bfloat16" if x.dtype == np.uint16 else x.dtype.name, str(device))

    @staticmethod
    def result(values, output):
        return values

    @staticmethod
    def einsum(eq, *xs):
        import torch

        if not all(x.is_floating_point() or x.is_complex() for x in xs):  # no integer matmul on CUDA
            values = np.einsum(eq, *(buffers.host_array(x) for x in xs), optimize=True)
            return torch.from_numpy(np.ascontiguousarray(values)).to(xs[0].device)
        return torch.einsum(eq, *xs)

    @staticmethod
    def relu(x):
        import torch

        return torch.clamp_min(x, 0)

    @staticmethod
    def relu_grad(x, g):
        import torch

        return torch.where(x > 0, g, torch.zeros((), dtype=g.dtype, device=g.device))

    exp = staticmethod(lambda x: x.exp())
    log = staticmethod(lambda x: x.log())

    @staticmethod
    def sum(x, dims, keep=False):
        return x.sum(dim=dims, keepdim=keep)

    @staticmethod
    def max(x, dims, keep=False):
        import torch

        if x.numel() == 0 or any(x.shape[d] == 0 for d in dims):
            shape = tuple(1 if d in dims else n for d, n in enumerate(x.shape)) if keep else \
                tuple(n for d, n in enumerate(x.shape) if d not in dims)
            least = float("-inf") if x.is_floating_point() else (False if x.dtype == torch.bool
                                                                 else torch.iinfo(x.dtype).min)
            return torch.full(shape, least, dtype=x.dtype, device=x.device)
        return x.amax(dim=dims, keepdim=keep)


def _log_softmax(xp, logits, axis: int):
    top = xp.max(logits, (axis,), keep=True)
    shifted = logits - top
    return shifted - xp.log(xp.sum(xp.exp(shifted), (axis,), keep=True))


def _xent(xp, xs, params):
    logits, targets = xs
    axis = axis_param("softmax_xent", params, logits.ndim)
    return -xp.sum(targets * _log_softmax(xp, logits, axis), (axis,))


def _xent_grad(xp, xs, params):
    logits, targets = xs
    axis = axis_param("softmax_xent_grad", params, logits.ndim)
    scale = float_param("softmax_xent_grad", params, "scale", 1.0)
    return (xp.exp(_log_softmax(xp, logits, axis)) - targets) * scale


# name -> fn(backend, input tiles as the backend's arrays, params) -> the output tile's values
_MATH: dict[str, Callable[[Any, list, dict], Any]] = {
    "einsum": lambda xp, xs, p: xp.einsum(p["equation"].replace(" ", ""), *xs),
    "add": lambda xp, xs, p: xs[0] + xs[1],
    "sub": lambda xp, xs, p: xs[0] - xs[1],
    "mul": lambda xp, xs, p: xs[0] * xs[1],
    "scale": lambda xp, xs, p: xs[0] * float_param("scale", p, "factor"),
    "relu": lambda xp, xs, p: xp.relu(xs[0]),
    "relu_grad": lambda xp, xs, p: xp.relu_grad(xs[0], xs[1]),
    "axpy": lambda xp, xs, p: xs[0] - float_param("axpy", p, "alpha") * xs[1],
    "sum": lambda xp, xs, p: xp.sum(xs[0], dims_param("sum", p, xs[0].ndim)),
    "max": lambda xp, xs, p: xp.max(xs[0], dims_param("max", p, xs[0].ndim)),
    "softmax_xent": _xent,
    "softmax_xent_grad": _xent_grad,
}


# name -> fn(input arrays, params, out): the elementwise kernels written straight into a host output tile,
# as `_MATH` computes them (the same operations in the same order, so the same bits). A result array made
# and then copied into the tile costs a page fault per 4 KiB and a copy: for a pipeline stage's relu
# and gradient sums, more than the arithmetic.
_INTO: dict[str, Callable[[list, dict, np.ndarray], Any]] = {
    "add": lambda xs, p, out: np.add(xs[0], xs[1], out=out),
    "sub": lambda xs, p, out: np.subtract(xs[0], xs[1], out=out),
    "mul": lambda xs, p, out: np.multiply(xs[0], xs[1], out=out),
    "scale": lambda xs, p, out: np.multiply(xs[0], float_param("scale", p, "factor"), out=out),
    "relu": lambda xs, p, out: np.maximum(xs[0], np.zeros((), out.dtype), out=out),
    "relu_grad": lambda xs, p, out: _Numpy.relu_grad(xs[0], xs[1], out=out),
    "axpy": lambda xs, p, out: np.subtract(xs[0], float_param("axpy", p, "alpha") * xs[1], out=out),
}


def _writes_into(inputs: list, output) -> bool:
    """Whether an elementwise kernel may write into ``output`` itself: a writable host tile of a float dtype
    (integers take a float factor through float64; bfloat16 is stored as integer bits), and inputs of its
    shape and dtype that do not overlap it."""
    if buffers.is_torch(output) or output.dtype.kind != "f" or not output.flags.writeable:
        return False
    return all(isinstance(x, np.ndarray) and x.shape == output.shape and x.dtype == output.dtype
               and not np.may_share_memory(x, output) for x in inputs)


def _kernel(math: Callable[[Any, list, dict], Any], into=None) -> Callable[[list, Any, dict], None]:
    def run(inputs: list, output, params: dict) -> None:
        if into is not None and _writes_into(inputs, output):
            into(inputs, params, output)
            return
        whole = tuple((0, n) for n in output.shape)
        if buffers.is_torch(output):
            xs = [_Torch.operand(x, output.device) for x in inputs]
            values = math(_Torch, xs, params)
        else:
            values = _Numpy.result(math(_Numpy, [_Numpy.operand(x) for x in inputs], params), output)
        buffers.write(output, whole, whole, values)

    return run


def _einsum(inputs: list, output, params: dict) -> None:
    """``einsum``, written straight into the output tile where numpy can (a matmul's ``out``): no result array
    to allocate and copy over, which on fresh memory costs as much as a mid-size matmul."""
    if (len(inputs) == 2 and not buffers.is_torch(output) and output.dtype != np.uint16 and output.flags.writeable
            and all(not buffers.is_torch(x) and np.asarray(x).dtype == output.dtype for x in inputs)):
        einsum2(params["equation"], *inputs, out=output)
        return
    _kernel(_MATH["einsum"])(inputs, output, params)


def _copy(inputs: list, output, params: dict) -> None:
    whole = tuple((0, n) for n in output.shape)
    buffers.write(output, whole, whole, inputs[0])  # bytes as they are, whatever the dtype


# name -> fn(input regions, output region, params): the compute steps' implementations on this agent; the
# core's ``reshard.kernels`` holds their shape rules, for the same names.
KERNELS: dict[str, Callable[[list, Any, dict], None]] = {"copy": _copy,
                                                         **{name: _kernel(m, _INTO.get(name))
                                                            for name, m in _MATH.items()},
                                                         "einsum": _einsum}


# Parsed programs an agent keeps (`Runtime._loaded`): at most PROGRAMS_KEPT, and no more than PROGRAMS_KEPT_BYTES of
# program text in all, the newest kept whatever its size (`server.common.contract`; the planner follows the same rule).


def load_program(text: str, max_bytes: int = AgentConfig.max_message_bytes,
                 max_depth: int = PlannerConfig.max_json_depth) -> tuple[Program, str]:
    """A program from its JSON (or plan JSON v1), and the id it goes by: the id of the document handed over
    (a plan's id for plan JSON), which the planner's Execute and every peer name.

    The JSON nests no deeper than the planner reads JSON, and is no larger than the message that brings it:
    the planner's 4 MiB for a sharding would refuse the program of a 256-device all-to-all (10 MiB).

    The id the text claims is taken as it is, not worked out again from the content (a quarter of reading a
    16,000-step program): the planner's ticket for the Prepare signs the text's hash, and every host confirms the
    id with its peers before it calls them. A text without an id gets its content's."""
    data = loads(text, "program_json", max_bytes=max_bytes, max_depth=max_depth)
    claimed = data.get("id") if isinstance(data, dict) else None
    program = program_from_json(data, check_id=not isinstance(claimed, str))  # many tensors: with its buckets
    return program, claimed if isinstance(claimed, str) else program.id


# -- tasks ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Task:
    """One role of this host in one step (see the module table)."""

    step: Step
    role: str  # send, recv, compute, reduce
    depth: int
    hop: int = 0
    peer: str = ""  # recv: the host the stream comes from
    deps: tuple[int, ...] = ()  # steps that must be done here first
    waiting: int = 0
    deadline: float = 0.0  # monotonic; 0 while it has not started
    finished: bool = False

    @property
    def index(self) -> int:
        return self.step.id

    @property
    def transfer(self):
        return self.step.transfer

    def __str__(self) -> str:
        if self.role == "recv":
            return f"step {self.step.id} (hop {self.hop} of {self.step}, arriving from {self.peer})"
        return f"step {self.step.id} ({self.step})"


def host_tasks(program: Program, host: str, buckets: dict[int, Bucket] | None = None) -> list[Task]:
    """``host``'s tasks of ``program`` in the order every host derives alike: by dependency depth, then
    moves round-robin over (sender, destination) host pairs (`interleaved`), then the other steps by id.
    A bucket (``buckets``: by the id of its first step) is one move, its first step's; a step that waits for
    a member of a bucket waits for that move."""
    buckets = bucket_moves(program) if buckets is None else buckets
    lead = {i: first for first, b in buckets.items() for i in b.ids}
    depth = program.depths
    by_depth: dict[int, list[Step]] = defaultdict(list)
    for s in program.steps:
        if lead.get(s.id, s.id) == s.id:
            by_depth[depth[s.id]].append(buckets[s.id].step if s.id in buckets else s)
    out = []
    for d in sorted(by_depth):
        steps = by_depth[d]
        moves = {s.id: s for s in steps if s.kind == MOVE}
        ordered = [moves[i] for i, _ in interleaved([(s.id, s.transfer) for s in moves.values()])]
        for s in ordered + [s for s in steps if s.kind != MOVE]:
            if s.kind == MOVE:
                t = s.transfer
                if host_of(t.sender) == host:
                    out.append(Task(s, "send", d))
                out += [Task(s, "recv", d, hop, hop_targets(t, hop, host)[2]) for hop in receiving_hops(t, host)]
            elif any(host_of(dev) == host for dev in s.participants()):
                out.append(Task(s, s.kind, d))
    here = {t.step.id for t in out}
    for t in out:
        if t.role != "recv":
            t.deps = tuple(sorted({lead.get(a, a) for a in t.step.after} & here))
            t.waiting = len(t.deps)
    return out


def _task_peers(task: Task, host: str) -> set[str]:
    """The hosts ``task`` calls on the collective transport."""
    s = task.step
    if task.role == "recv":
        _, nxt, prev = hop_targets(s.transfer, task.hop, host)
        return {prev} | ({nxt} if nxt else set())
    if task.role == "send":
        return sending_peers(s.transfer, host)
    if task.role == REDUCE:
        n = len(s.devices)
        mine = [i for i, d in enumerate(s.devices) if host_of(d) == host]
        return {host_of(s.devices[(i + k) % n]) for i in mine for k in (-1, 1)} - {host}
    return set()


# Move units smaller than this run on lanes of their own beside the others (`Runtime._in_order`): a chain of a few
# KiB is latency, not bandwidth, and need not wait until the large routes have drained.
SMALL_UNIT_BYTES = 1 << 20


def _route(t) -> tuple:
    """The hosts a move's streams pass, in order, and its method: moves along one route share their links."""
    if t.method == "broadcast":
        return (t.method, host_of(t.sender), *t.route)
    return (t.method, host_of(t.sender), *(host_of(r) for r in t.receivers))


def lane_units(tasks: list[Task], nbytes: Callable[[Step], int]) -> list[list[Task]]:
    """One depth's tasks that call peers (in the order every host derives alike, `host_tasks`), as the units the
    collective transport's lanes run: the moves along one route (`_route`: the same hosts in the same order) are
    one unit, run one after another in that order; any other task is a unit of its own. Units go largest first
    (``nbytes`` of a move step, summed), ties by their first task's place.

    Every host derives the same units and order from the program alone, so the module docstring's argument holds
    with units for tasks. Why: a lane held by a small move waits until every host of its route reaches it, and
    with one lane per move a few hundred small moves queue behind one another on every host while the links
    idle (a 500-tensor weight sync on 1 Gbit/s links took 1.5x its bound). A route's moves share its links
    anyway, so they lose nothing by running in turn, and the large routes, started first, keep every link busy."""
    units: dict[tuple, list[Task]] = {}
    for i, t in enumerate(tasks):
        key = _route(t.step.transfer) if t.step.kind == MOVE else ("", i)
        units.setdefault(key, []).append(t)
    place = {id(unit): n for n, unit in enumerate(units.values())}
    return sorted(units.values(), key=lambda unit: (-sum(nbytes(t.step) for t in unit if t.step.kind == MOVE),
                                                    place[id(unit)]))


def _depth_order(tasks: list[Task], host: str, nbytes: Callable[[Step], int]) -> tuple[bool, list[tuple]]:
    """Whether any of ``tasks`` (one host's, `host_tasks`) calls a peer, and per depth, in order: the peers first
    called at that depth (frozenset), the indexes of its tasks that call none, and its lane units (`lane_units`),
    each as (whether it runs on the lanes for small routes: moves of under `SMALL_UNIT_BYTES` in all, its tasks'
    indexes)."""
    calls = [_task_peers(t, host) for t in tasks]
    index = {id(t): i for i, t in enumerate(tasks)}
    by_depth: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        by_depth[t.depth].append(i)
    confirmed: set[str] = set()
    depths = []
    for depth in sorted(by_depth):
        at = by_depth[depth]
        peers = set().union(*(calls[i] for i in at)) - confirmed
        confirmed |= peers
        units = []
        for unit in lane_units([tasks[i] for i in at if calls[i]], nbytes):
            small = all(t.step.kind == MOVE for t in unit) and sum(nbytes(t.step) for t in unit) < SMALL_UNIT_BYTES
            units.append((small, [index[id(t)] for t in unit]))
        depths.append((frozenset(peers), [i for i in at if not calls[i]], units))
    return any(calls), depths


# -- one program on this host ----------------------------------------------------------------------------


class _Scratch:
    """The `Sink` of a move into a tensor that is not staged for commit: buffers made as pieces arrive."""

    def __init__(self, run: "Run", tensor: str, box: Box):
        self.run, self.tensor, self.box = run, tensor, box

    def write(self, device: str, box: Box, data) -> None:
        array, origin = self.run.produce(device, self.tensor, DST, self.box)
        buffers.write(array, box, origin, data)

    def place(self, devices: list[str], box: Box):
        return None

    def mark(self, device: str, box: Box) -> None:
        pass


class HostLayout:
    """What a run of ``program`` on ``host`` works out from the program alone: its buckets, streams and each step's
    dtype, this host's tasks (templates: each run counts down copies), the bytes it sends, and the tiles it stages.
    A weight sync runs the same program every step, and for a state dict of hundreds of tensors working these out
    took most of a receiving agent's CPU in a job; the runtime keeps them with the parsed program."""

    def __init__(self, program: Program, host: str):
        self.program = program
        self.buckets = bucket_moves(program)  # first step id -> the bucket that travels as that step's stream
        self.streams, self.dtypes, n = {}, {}, 0
        for s in program.steps:
            self.streams[s.id] = n
            n += stream_count(s.kind, s.transfer, len(s.devices))
            self.dtypes[s.id] = BYTES if s.id in self.buckets else \
                program.tensor(s.tensor if s.kind == MOVE else (s.inputs or (s.output,))[0].tensor).dtype
        self.num_streams = n
        self.dtype_pairs = dtype_pairs_of(self.dtypes)
        self.tasks = host_tasks(program, host, self.buckets)
        self.bytes_total = sum(
            sender_bytes([s.transfer], program.tensor(s.tensor).itemsize, host) for s in program.steps
            if s.kind == MOVE and host_of(s.transfer.sender) == host)
        self.committed = [t for t in program.tensors if t.dst is not None]
        self.committed_names = frozenset(t.name for t in self.committed)
        self.unresharded = [t.name for t in self.committed if not t.is_reshard]
        self.staged = staged_bytes(self.committed, host) if len(self.committed) > 1 else {}
        # tensor -> this host's devices' destination tiles
        self.dst_tiles = {t.name: {d: b for d, b in t.dst.tiles(t.shape).items() if host_of(d) == host}
                          for t in self.committed}
        self.here = [t for t in self.committed if self.dst_tiles[t.name]]  # the tensors this host stages tiles of
        # Every step a move that waits for nothing: the held parts of the tiles are copied beside the streams
        # (`Run._stage`).
        self.moves_only = all(s.kind == MOVE and not s.after for s in program.steps)
        # tensor -> how this host stages its tiles (`staging.tile_plan`)
        self.tile_plans = {t.name: tile_plan(t, self.dst_tiles[t.name]) for t in self.here}
        # How the active transports run this host's tasks (`Runtime._in_order`), by index into `tasks`: whether
        # any calls a peer, then per depth the peers it calls first, the tasks that call none, and its lane units
        # (whether each runs on the lanes for small routes, and its tasks).
        self.calls_peers, self.depths = _depth_order(self.tasks, host, self.step_bytes)
        # The host memory each of this host's bucket tasks holds while it runs, largest first: a sender packs its
        # bucket into one buffer, and every host the bucket reaches (the sender's own included) holds one per
        # device of its own that receives it, until the last byte (`buckets.Bucket`); in all, and apart for the
        # tasks of units that run on the lanes for small routes and for the others.
        small = {i for _, _, units in self.depths for on_small, unit in units if on_small for i in unit}
        held = [(i, self.buckets[t.step.id].nbytes * ((t.role == "send") + sum(host_of(r) == host
                                                                            for r in t.step.transfer.receivers)))
                for i, t in enumerate(self.tasks) if t.step.id in self.buckets and t.role in ("send", "recv")]
        self.bucket_buffers = sorted((n for _, n in held), reverse=True)
        self.small_bucket_buffers = sorted((n for i, n in held if i in small), reverse=True)
        self.large_bucket_buffers = sorted((n for i, n in held if i not in small), reverse=True)

    def step_bytes(self, step: Step) -> int:
        """The bytes a move step carries: its bucket's, when it stands for one."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            return bucket.nbytes
        return boxes.volume(step.transfer.box) * self.program.tensor(step.tensor).itemsize

    def bucket_peak(self, at_once: int, small_at_once: int = 0) -> int:
        """The most bytes of bucket buffers this host holds when ``at_once`` of its tasks run together, or, with
        ``small_at_once`` (the active transports), ``at_once`` of the tasks outside the units for small routes
        and ``small_at_once`` of those."""
        if not small_at_once:
            return sum(self.bucket_buffers[:at_once])
        return sum(self.large_bucket_buffers[:at_once]) + sum(self.small_bucket_buffers[:small_at_once])

    def buckets_at_once(self, at_once: int, small_at_once: int = 0) -> int:
        """How many bucket tasks `bucket_peak` counts."""
        if not small_at_once:
            return min(at_once, len(self.bucket_buffers))
        return min(at_once, len(self.large_bucket_buffers)) + min(small_at_once, len(self.small_bucket_buffers))

    def fresh_tasks(self) -> list[Task]:
        return [copy.copy(t) for t in self.tasks]


class Run(Session):
    """One program's run on this host: its buffers, its tasks and their progress.

    Buffers, by (device, tensor, role): ``src`` is the tensor's committed shard of
    ``src_version``; ``dst`` of a tensor with a destination sharding is its tile, staged
    for the planner's commit (`staging.StagedTiles`, also the `Sink` its moves deliver
    through); every other buffer (another role, or ``dst`` of a tensor that is not
    committed) is made by the step that writes it. A bucket of moves (`buckets.Bucket`)
    runs as its first step: one stream of its members' packed bytes.
    """

    def __init__(self, job: str, program: Program, ident: str, names: dict[str, str], src_version: int,
                 dst_version: int, peers: dict[str, str], host: str, store: ShardStore, transport: Transport, *,
                 generation: int = 0, seq: int = 0, device: str = "cpu", push_tickets: dict[str, str] | None = None,
                 versions: dict[str, int] | None = None, layout: HostLayout | None = None, tasks_at_once: int = 1):
        layout = layout if layout is not None else HostLayout(program, host)
        self.layout = layout
        self.buckets = layout.buckets  # first step id -> the bucket that travels as that step's stream
        super().__init__(job, ident, layout.dtypes, peers, generation=generation, seq=seq, streams=layout.streams,
                         num_streams=layout.num_streams, push_tickets=push_tickets, dtype_pairs=layout.dtype_pairs)
        self.program = program
        self.names = names  # program tensor -> the agent's store name
        self.src_version = src_version
        self.versions = versions or {}  # program tensor -> the stored version it reads, where not src_version
        self.dst_version = dst_version
        self.host = host
        self.store = store
        self.transport = transport
        self.device = device
        self.tasks = layout.fresh_tasks()
        self.digests: dict[int, Future] = {}  # step -> XXH3-64 of its box, from a held source shard
        self.done = threading.Event()
        self.executing = False
        self.started = 0.0
        self._lock = threading.Lock()
        self._left: dict[int, int] = defaultdict(int)  # step -> its unfinished tasks here
        self._dependents: dict[int, list[Task]] = defaultdict(list)
        for t in self.tasks:
            self._left[t.step.id] += 1
            for a in t.deps:
                self._dependents[a].append(t)
        self.steps_total = len(self._left)
        self.steps_done = 0
        self.bytes_total = layout.bytes_total
        self._made: dict[tuple[str, str, str], list[tuple[Box, Any]]] = defaultdict(list)
        self.fills: list[tuple[Any, Box, Box, Any]] = []  # (staged buffer, held box, its tile, source shard)
        self._stage(tasks_at_once)
        self.num_left = len(self.tasks) + bool(self.fills)  # the fills count as one task
        if not self.num_left:
            self.done.set()

    # -- buffers -----------------------------------------------------------------------------------------

    def _stage(self, tasks_at_once: int) -> None:
        """Stage this host's destination tiles and hold room for its bucket buffers (`_reserve_buckets`); a
        failure leaves none of the run's own transactions behind."""
        committed = self.layout.committed
        unversioned = [name for name in self.layout.unresharded if name not in self.versions]
        if len(committed) > 1 and unversioned:
            raise FailedPreconditionError(
                f"job {self.job}: the program ends {len(committed)} tensors in a destination sharding "
                f"({[t.name for t in committed]}); an agent commits several tensors in one job only when each is "
                f"resharded (reshard_many) or the job names its version (compute_many), and {unversioned} are neither"
            )
        # The part of a tile that the device's own source shard holds is copied in at prepare, unless every step
        # is a move that waits for nothing: those read only source shards, and no stream writes that part, so the
        # copy runs beside the streams (`fill`) instead of delaying this host's first call to its peers.
        defer = self.layout.moves_only
        # program tensor -> its tiles staged on this host; a tensor without tiles here stages nothing and has no
        # entry (a sender of a state dict has none)
        self.staging: dict[str, StagedTiles] = {}
        owners = []
        # Several tensors reserve their tiles together: one check against the memory limit, where one per tensor
        # would each pass over everything the store holds. Every tile is staged at the end, under one hold of the
        # store's lock.
        together = staging_owner(self.job, "", 2) if len(committed) > 1 else None
        staged: list = []
        try:
            if together is not None:
                owners.append(together)
                self.store.reserve(together, self.layout.staged,
                                   f"job {self.job[:8]}'s destination tiles of {len(committed)} tensors")
            for decl in self.layout.here:
                owners.append(staging_owner(self.job, decl.name, len(committed)))
                tiles = StagedTiles(self.job, decl, self.names[decl.name], owners[-1], self.store,
                                    self.version(decl.name), self.empty, defer, self.layout.tile_plans[decl.name],
                                    staged, reserve=together is None)
                self.staging[decl.name] = tiles
                self.fills += tiles.fills
            self.store.stage_many(staged)
            if together is not None:
                self.store.abort(together)  # every tile is staged now, and counts as staged
            self._reserve_buckets(tasks_at_once)
        except BaseException:
            if len(committed) > 1:  # the job's own transaction is the planner's to abort; these are the run's
                for owner in owners:
                    self.store.abort(owner)
            raise

    def _reserve_buckets(self, tasks_at_once: int) -> None:
        """Hold room, until the job ends, for the bucket buffers of the ``tasks_at_once`` tasks that may run
        together here: they are allocated as the job runs, and a job over the memory limit is refused now, not
        part way. A cuda agent's limit is its GPU's memory, and bucket buffers are host memory: none is held."""
        # Active transports run as many tasks again on the lanes for small routes (`Runtime._in_order`).
        small = 0 if self.transport.passive else tasks_at_once
        peak = self.layout.bucket_peak(tasks_at_once, small)
        if not peak or self.store.device != "cpu":
            return
        n = self.layout.buckets_at_once(tasks_at_once, small)
        self.store.reserve(self.job, {BUCKETS_KEY: peak},
                           f"job {self.job[:8]}'s bucket buffers ({n} of its {len(self.layout.bucket_buffers)} "
                           f"packed streams here at once, up to {format_size(self.layout.bucket_buffers[0])} "
                           f"each: a smaller bucket_mib packs less)")

    def commit_version(self, tensor: str) -> int:
        """The version program tensor ``tensor`` commits as: ``dst_version``, except in a job that commits several
        tensors, where a resharded one, read at a version of its own (``versions``), commits as the version after
        it, and one the program makes (no ``src``) as the version the job names for it (compute_many)."""
        if len(self.layout.committed) > 1 and tensor in self.versions:
            return self.versions[tensor] + (self.program.tensor(tensor).src is not None)
        return self.dst_version

    def version(self, tensor: str) -> int:
        """The stored version of program tensor ``tensor`` that its ``src`` tiles are."""
        return self.versions.get(tensor, self.src_version)

    def read(self, device: str, tensor: str, box: Box, role: str | None = None) -> tuple[Any, Box]:
        """A buffer of ``device`` that holds ``box`` of ``tensor`` in ``role``, and the box that buffer holds:
        the source shard, the staged tile once earlier steps delivered ``box``, or a buffer an earlier step made.
        ``role`` None is what a move of role ``"src"`` reads, as a plan's transfer does: the source shard, else
        any buffer that holds the box (``"dst"`` first, then the other roles by name)."""
        shard = None
        # A tensor the program declares without ``src`` is made by its steps: a stored tensor of the same name (an
        # output that replaces an older version) is none of its data.
        if role in (None, SRC) and self.program.tensor(tensor).src is not None:
            shard = self.store.find(self.names.get(tensor, tensor), self.version(tensor), device)
            if shard is not None and boxes.contains(shard.tile, box):
                return shard.array, shard.tile
        staged = self.staging.get(tensor) if role in (None, DST) else None
        held = staged.holding(device, box) if staged is not None else None
        if held is not None:
            return held
        with self._lock:
            held = [(b, a) for r in ((role,) if role else (DST, *sorted({k[2] for k in self._made} - {DST})))
                    for b, a in self._made.get((device, tensor, r), ())]
        made = [(b, a) for b, a in held if boxes.contains(b, box)]
        if made:
            return made[-1][1], made[-1][0]
        if role in (None, SRC) and shard is not None:
            held.append((shard.tile, shard.array))
        if not boxes.uncovered(box, [b for b, _ in held]):
            return self._assemble(box, held, self.program.tensor(tensor).dtype), box
        what = f"{tensor!r} in role {role!r}" if role else repr(tensor)
        raise FailedPreconditionError(
            f"job {self.job}: agent {self.host} holds no data of box {boxes.box_str(box)} of {what} for device "
            f"{device}"
        )

    def source_shards(self, device: str, tensors: list[str]) -> list[TileBuffer | None]:
        """``device``'s source shard of each of ``tensors`` (program tensors with a ``src``), at the version this
        run reads: what `read` looks at first, under one hold of the store's lock."""
        return self.store.find_many([(self.names.get(t, t), self.version(t), device) for t in tensors])

    def _assemble(self, box: Box, pieces: list[tuple[Box, Any]], dtype: str):
        """A new buffer of ``box``, copied from the buffers ``pieces`` (held box, buffer) that cover it together:
        a tile that moves delivered in several boxes, read whole by a compute step."""
        out = self.empty(tile_shape(box), dtype)
        for held, array in pieces:
            part = boxes.intersect(held, box)
            if part is not None:
                buffers.write(out, part, box, buffers.region(array, part, held))
        return out

    def empty(self, shape: tuple[int, ...], dtype: str):
        """A new buffer on this run's device, recycled by the store when it can be."""
        if self.device == self.store.device:
            return self.store.empty(shape, dtype)
        return buffers.empty(shape, dtype, self.device)

    def recycle(self) -> None:
        """The run has ended: the buffers its steps made go back to the store for reuse."""
        with self._lock:
            made = [a for arrays in self._made.values() for _, a in arrays]
            self._made.clear()
        for array in made:
            self.store.recycle(array)

    def produce(self, device: str, tensor: str, role: str, box: Box) -> tuple[Any, Box]:
        """The buffer a step writes ``box`` of ``tensor`` in ``role`` into on ``device``, and the box it holds:
        the staged tile for the committed tensor's ``dst``, else a buffer made for ``box`` (once)."""
        if role == DST and tensor in self.layout.committed_names:
            staged = self.staging.get(tensor)
            if staged is None:
                raise NoTiles(self.job, self.names[tensor]).error(device, box)
            return staged.produce(device, box)
        with self._lock:
            made = self._made[(device, tensor, role)]
            for b, a in made:
                if b == box:
                    return a, b
            decl = self.program.tensor(tensor)
            if self.device == self.store.device:  # counted against the limit until the job ends, as it is held
                self.store.reserve(self.job, {f"{device} {tensor} {role} {box}": boxes.volume(box) * decl.itemsize},
                                   f"job {self.job[:8]}'s working buffer of {tensor!r} in role {role!r} "
                                   f"{boxes.box_str(box)} on device {device}")
            array = self.empty(tile_shape(box), decl.dtype)
            made.append((box, array))
            return array, box

    def sink(self, tensor: str, box: Box):
        """Where a move of ``box`` of ``tensor`` delivers on this host."""
        staged = self.staging.get(tensor)
        if staged is not None:
            return staged
        if tensor in self.layout.committed_names:
            return NoTiles(self.job, self.names[tensor])
        return _Scratch(self, tensor, box)

    def executed(self, index: int) -> Step:
        """Step ``index`` as this host runs it: a bucket's first step is the move of the whole bucket."""
        bucket = self.buckets.get(index)
        return bucket.step if bucket is not None else self.program.steps[index]

    def source(self, step: Step) -> tuple[Any, Box]:
        """What the sender of move ``step`` (as `executed` gives it) reads, and the box that buffer holds."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            return bucket.pack(lambda device, tensor, box: self.read(device, tensor, box), self.store.host_buffer,
                               self.source_shards)
        t = step.transfer
        return self.read(t.sender, step.tensor, t.box, None if step.role == SRC else step.role)

    def destination(self, step: Step):
        """Where move ``step`` (as `executed` gives it) delivers on this host."""
        bucket = self.buckets.get(step.id)
        if bucket is not None:
            return bucket.sink(self.sink, self.store.host_buffer, self.store.recycle)
        return self.sink(step.tensor, step.transfer.box)

    def fill(self) -> None:
        """Copy the held parts of this host's tiles that `_stage` left for the run (counted as one task)."""
        try:
            for buf, held, tile, src in self.fills:
                self.check()
                buffers.write(buf, held, tile, buffers.region(src.array, held, src.tile))
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            self.fail(e)
            return
        with self._lock:
            self.num_left -= 1
            if not self.num_left:
                self.done.set()

    def check_complete(self) -> None:
        short = [(name, d, n) for name, staged in self.staging.items() for d, n in staged.short().items()]
        if short:
            name, d, n = short[0]
            raise FailedPreconditionError(
                f"job {self.job}: device {d} still lacks {n} elements of its destination tile of "
                f"{self.names[name]!r} ({len(short)} tiles incomplete); a transfer did not arrive"
            )

    # -- progress -------------------------------------------------------------------------------------

    def begin(self) -> list[Task]:
        """Start executing; returns the tasks ready now (receives excepted: they come by themselves)."""
        with self._lock:
            if self.executing:
                raise FailedPreconditionError(f"job {self.job} is already executing on agent {self.host}")
            self.executing = True
            self.started = time.monotonic()
            return [t for t in self.tasks if t.role != "recv" and not t.waiting and not t.finished]

    def finish(self, task: Task) -> list[Task]:
        """Count ``task`` as done; returns the tasks it made ready."""
        ready = []
        with self._lock:
            if task.finished:
                return ready
            task.finished = True
            self.num_left -= 1
            self._left[task.step.id] -= 1
            if not self._left[task.step.id]:
                self.steps_done += 1
                for t in self._dependents.get(task.step.id, ()):
                    t.waiting -= 1
                    if not t.waiting and self.executing:
                        ready.append(t)
            if not self.num_left:
                self.done.set()
        return ready

    def fail(self, error: BaseException) -> BaseException:
        first = super().fail(error)
        self.done.set()
        return first

    def step_bytes(self, step: Step) -> int:
        """The bytes a move step carries: its bucket's, when it stands for one."""
        return self.layout.step_bytes(step)

    def progress(self) -> tuple[int, int, int, int]:
        """(bytes sent, bytes to send, steps done, steps) on this host; bytes as ``reshard.cost.sender_bytes``."""
        return self.traffic.sent, self.bytes_total, self.steps_done, self.steps_total

    def overdue(self) -> Task | None:
        now = time.monotonic()
        with self._lock:
            return next((t for t in self.tasks if not t.finished and t.deadline and now > t.deadline), None)

    def wait(self, poll: float, timeout: float) -> bool:
        """Wait up to ``poll`` seconds; True once the run finished or failed. Fails the run when a task is past
        its deadline (``timeout`` seconds, see the module docstring)."""
        if self.done.wait(poll):
            return True
        late = self.overdue()
        if late is not None:
            self.fail(DeadlineExceededError(
                f"job {self.job}: {late} on host {self.host} did not finish within {timeout:g}s"
            ))
            return True
        return False

    def result(self, timeout: float, poll: float = 0.05) -> None:
        """Wait for the run (failing it at a task's deadline, ``timeout`` per task); raises its failure."""
        while not self.wait(poll, timeout):
            pass
        self.check()


# -- the runtime ---------------------------------------------------------------------------------------------


class Runtime:
    """Runs the programs of one agent (see the module docstring); shared by all its jobs."""

    def __init__(self, host: str, store: ShardStore, transports: dict[str, Transport], *, workers: int,
                 step_timeout_s: float, device: str = "cpu", pace: DevicePace | None = None):
        self.host = host
        self.pace = pace  # an emulated device speed (the lab's hosts); None: kernels at this machine's speed
        self.store = store
        self.transports = dict(transports)
        self.step_timeout_s = step_timeout_s
        self.device = device  # where staged destination buffers live
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"step-{host}")
        self._digest_pool = ThreadPoolExecutor(2, thread_name_prefix=f"digest-{host}")
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._finished: OrderedDict[str, Traffic] = OrderedDict()
        # `_loaded`'s programs with their ids and this host's layouts, most recent last
        self._programs: OrderedDict[bytes, tuple[Program, str, HostLayout, int]] = OrderedDict()  # + text length
        self._programs_bytes = 0
        # Lane pools of finished runs (`_in_order`), by lane count, for the next runs: a pool's threads would
        # otherwise be started for every job, about 0.15 ms of CPU each, eight or nine of them a job.
        self._idle_lanes: dict[int, list[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]] | None = {}  # None: closed
        for t in self.transports.values():
            t.serve(self.accept)

    # -- lifecycle ----------------------------------------------------------------------------------------

    def prepare(self, job: str, program_json: str, tensor: str, src_version: int, dst_version: int,
                peers: dict[str, str], transport: str = "grpc", generation: int = 0, seq: int = 0,
                push_tickets: dict[str, str] | None = None, reads: dict[str, tuple[str, int]] | None = None,
                program_sha256: str = "") -> Run:
        """Stage ``job``'s destination buffers on this host and get ready to run the program (or plan) in
        ``program_json``, or the one held under ``program_sha256`` (`_loaded`); ``tensor`` is the store's name
        of the program's reshard tensor (the one with a source and a destination sharding); its other tensors go
        by their own names. ``reads`` (a compute program) gives program tensors their stored name and version
        instead: the inputs' versions to read, and the name the output commits as. ``push_tickets`` are the
        planner's tickets for this job's pushes, by receiving host."""
        if self.store.ended(job):  # an abort overtook this prepare (a paused agent), or a replayed prepare
            raise FailedPreconditionError(f"job {job} has already ended on agent {self.host}")
        link = self.transports.get(transport or "grpc")
        if link is None:
            raise FailedPreconditionError(
                f"job {job} asks agent {self.host} for the {transport} transport, but it runs "
                f"--transport {'/'.join(sorted(self.transports))}"
            )
        program, ident, layout = self._loaded(program_json, program_sha256)
        names = {t.name: t.name for t in program.tensors}
        resharded = [t.name for t in program.tensors if t.is_reshard]
        if len(resharded) == 1:
            names[resharded[0]] = tensor
        unknown = sorted(set(reads or ()) - set(names))
        if unknown:
            raise InvalidArgumentError(f"job {job}: reads name tensors {unknown[:5]} that its program does not have")
        names.update((t, name) for t, (name, _) in (reads or {}).items())
        with self._lock:
            if job in self._runs:
                raise FailedPreconditionError(f"job {job} is already prepared on agent {self.host}")
        run = Run(job, program, ident, names, src_version, dst_version, peers, self.host, self.store, link,
                  generation=generation, seq=seq, device=self.device, push_tickets=push_tickets,
                  versions={t: v for t, (_, v) in (reads or {}).items()}, layout=layout,
                  tasks_at_once=link.lanes if not link.passive else self._workers)
        link.attach(run)
        with self._lock:
            self._runs[job] = run
        self._digest_sources(run)
        return run

    def _load(self, text: str) -> tuple[Program, str]:
        """The program in ``text`` and its id (`_loaded`)."""
        return self._loaded(text)[:2]

    def _loaded(self, text: str, sha256: str = "") -> tuple[Program, str, HostLayout]:
        """`load_program` of ``text`` and this host's `HostLayout` of it, kept while it is among the last
        `PROGRAMS_KEPT` distinct texts (and `PROGRAMS_KEPT_BYTES`): a weight sync hands the same program over
        every step, a pipeline each stage's few, and reading a state dict's and working out its layout take a
        large share of its job. Programs and layouts are immutable (runs copy the task templates), so runs share
        them; the key is the text's SHA-256 (``sha256``, `tickets.program_digest`, when the caller has it), so
        only the very same text hits. An empty ``text`` names a held program by ``sha256`` alone."""
        key = sha256 or program_digest(text)
        with self._lock:
            hit = self._programs.get(key)
            if hit is not None:
                self._programs.move_to_end(key)
                return hit[:3]
        if not text:
            raise NotFoundError(f"{PROGRAM_NOT_HELD}: agent {self.host} holds no program with SHA-256 {key[:16]} "
                                f"(it keeps the last {PROGRAMS_KEPT}); the planner sends its text again")
        program, ident = load_program(text)
        loaded = (program, ident, HostLayout(program, self.host))
        with self._lock:
            if key not in self._programs:
                self._programs_bytes += len(text)
            self._programs[key] = (*loaded, len(text))
            while len(self._programs) > 1 and (len(self._programs) > PROGRAMS_KEPT
                                                or self._programs_bytes > PROGRAMS_KEPT_BYTES):
                self._programs_bytes -= self._programs.popitem(last=False)[1][3]
        return loaded

    def _digest_sources(self, run: Run) -> None:
        """Start digesting, in the background, every box this host will stream from a shard it already holds.

        A sender's trailer needs the XXH3-64 of its box; computed from prepare on (xxhash
        releases the GIL), it is ready by the time the last chunk leaves, instead of adding a
        pass over the bytes to the send loop while the transfer is in flight.
        """
        for task in run.tasks:
            t = task.step.transfer if task.role == "send" else None
            # Only a move of role "src" reads the source shard (`Run.read`); one that reads another role, such as
            # the sums a reduce left, is digested as it is sent.
            if t is None or task.step.role != SRC or not first_peer(t) or task.step.id in run.buckets or \
                    run.program.tensor(task.step.tensor).src is None:
                continue
            shard = self.store.find(run.names[task.step.tensor], run.version(task.step.tensor), t.sender)
            if shard is not None and boxes.contains(shard.tile, t.box):
                run.digests[task.step.id] = self._digest_pool.submit(
                    _digest, run, run.dtype(task.step.id)[0], t.box, shard.array, shard.tile,
                    run.transport.chunk_bytes)

    def run(self, job: str) -> Run:
        with self._lock:
            run = self._runs.get(job)
        if run is None:
            raise NotFoundError(f"agent {self.host} has no prepared job {job!r}")
        return run

    def execute(self, job: str, program_id: str) -> Run:
        """Start running ``job``'s tasks; returns its `Run` to wait on (`Run.wait`)."""
        run = self.run(job)
        if program_id != run.program_id:
            raise FailedPreconditionError(
                f"job {job}: execute names program {program_id[:12]} but agent {self.host} prepared program "
                f"{run.program_id[:12]}; every agent must run the same program"
            )
        ready = run.begin()
        if run.fills:
            self._pool.submit(run.fill)
        if run.transport.passive:
            for task in run.tasks:
                if task.role == "recv":
                    task.deadline = run.started + self.step_timeout_s * (task.depth + 1)
            for task in ready:
                self._submit(run, task)
        elif run.tasks:
            threading.Thread(target=self._in_order, args=(run,), daemon=True, name=f"run-{job[:8]}").start()
        return run

    def commit(self, job: str) -> None:
        run = self.run(job)
        if run.failed is not None:
            raise FailedPreconditionError(f"job {job} failed on agent {self.host}, so it cannot commit: {run.failed}")
        run.check_complete()
        # only tensors with destination tiles here stage any
        self.store.commit_many([(staged.owner, run.names[name], run.commit_version(name), list(staged.tiles))
                                for name, staged in run.staging.items()])
        self.store.end(job)
        self._retire(run)

    def abort(self, job: str) -> None:
        with self._lock:
            run = self._runs.get(job)
        if run is not None:
            run.fail(FailedPreconditionError(f"job {job} was aborted"))
            self._retire(run)
            for staged in run.staging.values():
                self.store.abort(staged.owner)
        self.store.abort(job)

    def _retire(self, run: Run) -> None:
        run.transport.mailbox.cancel(run.job, run.failed or FailedPreconditionError(f"job {run.job} ended"))
        run.transport.detach(run)
        run.recycle()
        with self._lock:
            if self._runs.pop(run.job, None) is not None:
                self._finished[run.job] = run.traffic
                while len(self._finished) > 256:
                    self._finished.popitem(last=False)

    def traffic(self, job: str) -> Traffic:
        with self._lock:
            run = self._runs.get(job)
            if run is not None:
                return run.traffic
            if job in self._finished:
                return self._finished[job]
        raise NotFoundError(f"agent {self.host} knows no job {job!r}")

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._digest_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # a run that ends from now on shuts its lanes down (`_lanes_done`)
            idle, self._idle_lanes = self._idle_lanes or {}, None
        for pools in idle.values():
            for pool in (p for pair in pools for p in pair):
                pool.shutdown(wait=False)

    # -- running tasks --------------------------------------------------------------------------------------

    def _submit(self, run: Run, task: Task) -> None:
        self._pool.submit(self._run_task, run, task)

    def _run_task(self, run: Run, task: Task) -> None:
        if run.failed is not None:
            return
        task.deadline = time.monotonic() + self.step_timeout_s
        try:
            self._perform(run, task)
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            run.fail(e)
            run.transport.mailbox.cancel(run.job, run.failed)
            return
        ready = run.finish(task)
        if run.transport.passive:  # active transports run every task in order (`_in_order`)
            for t in ready:
                self._submit(run, t)

    def _run_unit(self, run: Run, unit: list[Task]) -> None:
        """A lane's unit (`lane_units`): its tasks in order, until one fails."""
        for task in unit:
            if run.failed is not None:
                return
            self._run_task(run, task)

    def _perform(self, run: Run, task: Task) -> None:
        step, link = task.step, run.transport
        if task.role == "send":
            array, origin = run.source(step)
            link.move(run, step.id, step.transfer, run.destination(step), array, origin, run.digests.get(step.id))
            if step.id in run.buckets:  # the packed bucket is sent: its buffer goes back for the next one
                run.store.recycle(array)
        elif task.role == "recv":
            link.take(run, step.id, step.transfer, task.hop, run.destination(step))
        elif task.role == COMPUTE:
            self._compute(run, step)
        elif task.role == REDUCE:
            ref, out = step.inputs[0], step.output

            def read(device: str):
                array, origin = run.read(device, ref.tensor, ref.box, ref.role)
                return buffers.region(array, ref.box, origin)

            def produce(device: str, box: Box):
                return run.produce(device, out.tensor, out.role, box)

            link.reduce(run, step.id, step.devices, ref.box, step.op, step.result, step.dim, read, produce)
        else:
            raise AssertionError(f"unknown task role {task.role!r}")

    def _compute(self, run: Run, step: Step) -> None:
        kernel = KERNELS.get(step.kernel)
        if kernel is None:
            raise FailedPreconditionError(
                f"job {run.job}: step {step.id} names kernel {step.kernel!r}, which agent {self.host} does not "
                f"implement; it has {sorted(KERNELS)}"
            )
        inputs = []
        for ref in step.inputs:
            array, origin = run.read(step.device, ref.tensor, ref.box, ref.role)
            inputs.append(buffers.region(array, ref.box, origin))
        out = step.output
        array, origin = run.produce(step.device, out.tensor, out.role, out.box)
        params = dict(step.params)
        started = time.monotonic()
        kernel(inputs, buffers.region(array, out.box, origin), params)
        if self.pace is not None:
            flops = KERNEL_RULES[step.kernel].flops(tuple(tuple(a.shape) for a in inputs), params)
            self.pace.finish(step.device, flops, started, run.check)

    def _lanes(self, n: int) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """A run's own lanes: ``n`` for its units and ``n`` for its units of small routes, idle until now."""
        with self._lock:
            idle = self._idle_lanes.get(n) if self._idle_lanes is not None else None
            if idle:
                return idle.pop()
        return (ThreadPoolExecutor(n, thread_name_prefix=f"lane-{self.host}"),
                ThreadPoolExecutor(n, thread_name_prefix=f"small-{self.host}"))

    def _lanes_done(self, n: int, lanes: tuple[ThreadPoolExecutor, ThreadPoolExecutor], idle: bool) -> None:
        """The run that had ``lanes`` is over: kept for the next run when ``idle`` (no unit of the run is still
        queued or running on them, which could hold up that run's), else, or once the runtime is closed, shut
        down."""
        if idle:
            with self._lock:
                kept = self._idle_lanes.setdefault(n, []) if self._idle_lanes is not None else None
                if kept is not None and len(kept) < _IDLE_LANES_KEPT:
                    kept.append(lanes)
                    return
        for pool in lanes:
            pool.shutdown(wait=False, cancel_futures=True)

    def _in_order(self, run: Run) -> None:
        """Active transports: this host's tasks depth by depth, each depth FIFO on the transport's lanes."""
        link = run.transport
        n = max(1, link.lanes)
        lanes, small_lanes = both = self._lanes(n)
        tasks = run.tasks  # in the layout's order: its depths name them by index
        pending: set = set()
        try:
            if run.layout.calls_peers:
                # Announce this host's program at once, so a peer waiting at a later depth does not wait for this
                # host's earlier, local work. A host that calls no peer (a compute job's local steps) announces
                # nothing: a peer waits only for the hosts it calls, and they call it back.
                link.handshake(run, set())
            for peers, local, units in run.layout.depths:
                if peers:
                    link.handshake(run, set(peers))
                # A task that calls no peer (a local copy, a compute) never waits on another host: it runs beside
                # the lanes, so that a stream need not wait behind it for a lane while its peer's NIC idles.
                pending = {self._pool.submit(self._run_task, run, tasks[i]) for i in local}
                for small, unit in units:
                    lane = small_lanes if small else lanes
                    pending.add(lane.submit(self._run_unit, run, [tasks[i] for i in unit]))
                while pending and run.failed is None:
                    pending = wait(pending, timeout=0.1).not_done
                if run.failed is not None:
                    return
        except BaseException as e:  # noqa: BLE001 - the run fails; Execute reports it
            run.fail(e)
        finally:
            self._lanes_done(n, both, not pending)

    # -- pushes ------------------------------------------------------------------------------------------

    def accept(self, header: PushHeader, items: Iterable) -> list[str] | None:
        """A stream pushed to this host (passive transports): one hop of a move, or a reduce's message."""
        run = self.run(header.job)
        if header.program_id != run.program_id:
            raise FailedPreconditionError(
                f"job {header.job}: push from {header.from_host} carries program {header.program_id[:12]} but agent "
                f"{self.host} prepared program {run.program_id[:12]}"
            )
        steps = run.program.steps
        step = run.executed(header.step) if 0 <= header.step < len(steps) else None
        if step is None:
            raise InvalidArgumentError(f"job {header.job}: step {header.step} is not in the program")
        if step.kind == REDUCE:
            run.transport.mailbox.deliver(header.key, items, self.step_timeout_s)
            return [self.host]
        if step.kind != MOVE:
            raise InvalidArgumentError(f"job {header.job}: step {header.step} is a {step.kind} step; nothing is "
                                       f"pushed for it")
        task = next((t for t in run.tasks if t.role == "recv" and t.step is step and t.hop == header.hop), None)
        try:
            confirmed = run.transport.take(run, step.id, step.transfer, header.hop, run.destination(step), items)
        except BaseException as e:
            run.fail(e)
            raise
        if task is not None:
            for ready in run.finish(task):
                self._submit(run, ready)
        return confirmed


def _digest(run: Run, dtype: str, box: Box, array, origin: Box, chunk_bytes: int) -> int:
    view = buffers.region(array, box, origin)
    if isinstance(view, np.ndarray) and view.flags.c_contiguous:
        return digest(view.reshape(-1).view(np.uint8))
    check = Checksum()
    for sub in chunk_boxes(box, dtype, chunk_bytes):
        run.check()
        check.update(buffers.host_bytes(buffers.region(array, sub, origin)))
    return check.xxh3_64
