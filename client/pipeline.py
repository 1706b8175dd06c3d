"""Pipeline training across meshes: stages of layers on meshes of agents, run under a schedule (issue 14).

Each stage is a list of `Dense` layers on its own mesh, with its own layout for activations and for each
weight. One `Pipeline.step` runs ``reshard.schedule.build(kind, stages, m)``: one driver thread per stage
submits that stage's forwards and backwards in order, each as ONE job of split-einsum and kernel ops
(``c.compute_many``: a layer's einsum and relu, a backward's gradients, planned and committed together), and
waits for each, so a stage computes one op at a time while the stages run side by side. A stage's output activation is
resharded onto the next stage's mesh, and an input gradient onto the previous one's, by a job issued the
moment the producing op ends and awaited only by the op that consumes it; the stage meanwhile runs whatever
its schedule says next. After its last backward a stage applies SGD to its weights.

Notation (as in `reshard.schedule`): stage ``i`` of ``n``, microbatch ``k`` of ``m``, layer ``j`` of a stage.
Tensor names, under the pipeline's ``prefix`` ``p``:

=================== ==========================================================================
``p.s{i}.h{j}.m{k}`` input of layer j on stage i; ``h0`` of stage i > 0 arrives from stage i-1
``p.s{i}.z{j}.m{k}`` pre-activation of a relu layer, kept for its backward
``p.s{i}.dy.m{k}``   gradient of stage i's output, arrived from stage i+1
``p.labels.m{k}``    the last stage's labels; ``p.loss.m{k}`` its summed loss
``p.grad.{w}``       weight w's gradient summed over the step's microbatches
=================== ==========================================================================

A forward of a `Dense` layer is ``z = einsum("bi,io->bo", h, w)`` then ``relu``; its backward
``relu_grad``, ``einsum("bi,bo->io")`` for the weight and ``einsum("bo,io->bi")`` for the input. The last
stage's output is the logits of a softmax cross-entropy whose gradient is scaled by one over the whole
batch, so the summed microbatch gradients are the batch's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from reshard import schedule
from reshard.errors import ReshardError
from reshard.proto.errors import NotFoundError
from reshard.schedule import BACKWARD, FORWARD, Span, Timeline
from reshard.sequence import Op
from reshard.sharding import Sharding

__all__ = ["Dense", "Stage", "Pipeline", "StepResult", "PipelineError"]

log = logging.getLogger(__name__)


class PipelineError(ReshardError, ValueError):
    """A pipeline that cannot run as described: no stages, a stage without layers, weights that do not chain."""


@dataclass(frozen=True)
class Dense:
    """``x -> relu(x @ w)`` (without the relu when ``relu`` is False); ``weight`` names a (in, out) tensor
    already in the catalog, in whatever layout the stage's mesh should hold it."""

    weight: str
    relu: bool = True

    def __str__(self) -> str:
        return f"Dense({self.weight}{', relu' if self.relu else ''})"


@dataclass(frozen=True)
class Stage:
    """Layers on one mesh; ``activations`` lays out every (batch, features) activation and activation gradient
    of the stage on that mesh (e.g. ``Sharding(mesh, ("x", None))`` splits the batch)."""

    layers: tuple[Dense, ...]
    activations: Sharding

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise PipelineError("a stage needs at least one layer, e.g. Stage([Dense('w0')], activations)")
        if len(self.activations.spec) != 2:
            raise PipelineError(f"stage activations are (batch, features) matrices; {self.activations} has "
                                f"{len(self.activations.spec)} dims")


@dataclass(frozen=True)
class StepResult:
    """One training step: the batch's mean loss (before the update), the measured timeline, and the most
    activation bytes each stage held for backwards at once."""

    loss: float
    timeline: Timeline
    peak_activation_bytes: tuple[int, ...]

    def __str__(self) -> str:
        return f"loss {self.loss:.6g}; {self.timeline}"


class _Abort(Exception):
    """Another stage failed; this one stops where it waits."""


class Pipeline:
    """A model split into `Stage` s on their own meshes, trained with SGD under a pipeline schedule."""

    def __init__(self, client, stages: Sequence[Stage], *, lr: float, prefix: str = "pipe",
                 timeout_s: float = 120.0):
        self.client = client
        self.stages = tuple(stages)
        if not self.stages:
            raise PipelineError("a pipeline needs at least one stage")
        self.lr = lr
        self.prefix = prefix
        self.timeout_s = timeout_s
        infos = {layer.weight: client.info(layer.weight) for st in self.stages for layer in st.layers}
        self._weight_sharding = {w: t.sharding for w, t in infos.items()}
        self._itemsize = {w: np.dtype(t.dtype).itemsize for w, t in infos.items()}
        dims = [infos[layer.weight].shape for st in self.stages for layer in st.layers]
        for (w_in, w_out), (nxt, _) in zip(dims, dims[1:]):
            if w_out != nxt:
                raise PipelineError(f"layer weights do not chain: a ({w_in}, {w_out}) weight feeds one of "
                                    f"{nxt} inputs")
        self.features = (dims[0][0],) + tuple(d[1] for d in dims)  # activation widths, input to logits

    # -- names -------------------------------------------------------------------------------------

    def _h(self, i: int, j: int, k: int) -> str:
        return f"{self.prefix}.s{i}.h{j}.m{k}"

    def _z(self, i: int, j: int, k: int) -> str:
        return f"{self.prefix}.s{i}.z{j}.m{k}"

    def _out(self, i: int, k: int) -> str:
        """Stage i's output: the next stage's input, or the logits."""
        return self._h(i + 1, 0, k) if i + 1 < len(self.stages) else f"{self.prefix}.logits.m{k}"

    def input_name(self, k: int) -> str:
        return self._h(0, 0, k)

    def labels_name(self, k: int) -> str:
        return f"{self.prefix}.labels.m{k}"

    # -- one step ----------------------------------------------------------------------------------

    def step(self, kind: str, inputs: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> StepResult:
        """Put the microbatches (``inputs[k]``: (rows, features), ``labels[k]``: one-hot (rows, classes)), run
        one step of ``schedule.build(kind, n, len(inputs))`` and apply SGD; returns the loss and the timeline."""
        m = len(inputs)
        if len(labels) != m:
            raise PipelineError(f"{m} input microbatches but {len(labels)} label microbatches")
        ops = schedule.build(kind, len(self.stages), m)
        for k in range(m):
            self._replace(self.input_name(k), inputs[k], self.stages[0].activations)
            self._replace(self.labels_name(k), labels[k], self.stages[-1].activations)
        rows = [len(x) for x in inputs]
        run = _StepRun(self, kind, ops, rows)
        timeline = run.go()
        losses = [float(self.client.get(f"{self.prefix}.loss.m{k}")) for k in range(m)]
        per_row = [sum(self._layer_bytes(i, j, 1) for j in range(len(st.layers))) for i, st in
                   enumerate(self.stages)]
        peak_bytes = tuple(p * max(rows) * b for p, b in zip(timeline.peak_activations, per_row))
        return StepResult(sum(losses) / sum(rows), timeline, peak_bytes)

    def _replace(self, name: str, array: np.ndarray, sharding: Sharding) -> None:
        """Put ``array`` as ``name``, in place of last step's microbatch."""
        try:
            self.client.delete(name)
        except NotFoundError:
            pass
        self.client.put(name, array, sharding)

    def _layer_bytes(self, i: int, j: int, rows: int) -> int:
        """Bytes layer j of stage i keeps for its backward: its input, and its pre-activation under a relu."""
        layer = self.stages[i].layers[j]
        first = sum(len(st.layers) for st in self.stages[:i]) + j
        kept = self.features[first] + (self.features[first + 1] if layer.relu else 0)
        return rows * kept * self._itemsize[layer.weight]

    # -- the ops -----------------------------------------------------------------------------------

    def _wait(self, job) -> None:
        job.result(timeout=self.timeout_s)

    def forward(self, i: int, k: int) -> None:
        self._wait(self.client.compute_many(self.forward_ops(i, k)))

    def forward_ops(self, i: int, k: int) -> list[Op]:
        """Stage i's forward of microbatch k: every layer's einsum and relu, and on the last stage the loss, as
        the ops of one job."""
        st, ops = self.stages[i], []
        last = len(st.layers) - 1
        for j, layer in enumerate(st.layers):
            out = self._out(i, k) if j == last else self._h(i, j + 1, k)
            pre = self._z(i, j, k) if layer.relu else out
            ops.append(Op.einsum("bi,io->bo", self._h(i, j, k), layer.weight, out=pre, out_sharding=st.activations))
            if layer.relu:
                ops.append(Op.apply("relu", pre, out=out))
        if i == len(self.stages) - 1:
            p = self.prefix
            ops.append(Op.apply("softmax_xent", self._out(i, k), self.labels_name(k), out=f"{p}.rowloss.m{k}",
                                axis=1))
            ops.append(Op.apply("sum", f"{p}.rowloss.m{k}", out=f"{p}.loss.m{k}", dims=[0]))
        return ops

    def backward(self, i: int, k: int, total_rows: int) -> None:
        self._wait(self.client.compute_many(self.backward_ops(i, k, total_rows)))

    def backward_ops(self, i: int, k: int, total_rows: int) -> list[Op]:
        """Stage i's backward of microbatch k as the ops of one job: the loss gradient on the last stage, then
        per layer, last first, the relu's gradient, the weight's gradient (added to the step's sum from the
        second microbatch on) and the input's gradient (none for stage 0's input)."""
        st, p, ops = self.stages[i], self.prefix, []
        dy = f"{p}.s{i}.dy.m{k}"
        if i == len(self.stages) - 1:
            ops.append(Op.apply("softmax_xent_grad", self._out(i, k), self.labels_name(k), out=dy, axis=1,
                                scale=1.0 / total_rows))
        for j in reversed(range(len(st.layers))):
            layer = st.layers[j]
            if layer.relu:
                dz = f"{p}.s{i}.dz{j}.m{k}"
                ops.append(Op.apply("relu_grad", self._z(i, j, k), dy, out=dz))
            else:
                dz = dy
            grad = f"{p}.grad.{layer.weight}"
            if k == 0:
                ops.append(Op.einsum("bi,bo->io", self._h(i, j, k), dz, out=grad,
                                     out_sharding=self._weight_sharding[layer.weight]))
            else:
                into = f"{p}.gradk.{layer.weight}"
                ops.append(Op.einsum("bi,bo->io", self._h(i, j, k), dz, out=into,
                                     out_sharding=self._weight_sharding[layer.weight]))
                ops.append(Op.apply("add", grad, into, out=grad))
            if i > 0 or j > 0:  # stage 0's input needs no gradient
                dy = self.input_grad(i, k) if j == 0 else f"{p}.s{i}.dh{j}.m{k}"
                ops.append(Op.einsum("bo,io->bi", dz, layer.weight, out=dy, out_sharding=st.activations))
        return ops

    def input_grad(self, i: int, k: int) -> str:
        """Where stage i puts the gradient of its input; resharded to stage i-1 it becomes its ``dy``."""
        return f"{self.prefix}.s{i - 1}.dy.m{k}"

    def update(self, i: int) -> None:
        for layer in self.stages[i].layers:
            grad = f"{self.prefix}.grad.{layer.weight}"
            self._wait(self.client.apply("axpy", layer.weight, grad, out=layer.weight, alpha=self.lr))

    # -- estimates ---------------------------------------------------------------------------------

    def transfer_estimates(self, rows: int, dtype: str = "float32") -> tuple[float, ...]:
        """The planner's estimate, in seconds, of each boundary's activation reshard for ``rows`` rows."""
        out = []
        for i in range(len(self.stages) - 1):
            width = self.features[sum(len(st.layers) for st in self.stages[:i + 1])]
            plan = self.client.plan((rows, width), self.stages[i + 1].activations, dtype=dtype,
                               src=self.stages[i].activations)
            out.append(plan.estimate_seconds)
        return tuple(out)

    def predict(self, kind: str, microbatches: int, forward_s, backward_s, transfer_s=None,
                rows: Optional[int] = None) -> Timeline:
        """``schedule.simulate`` for this pipeline; ``transfer_s`` defaults to the planner's estimates for
        microbatches of ``rows`` rows."""
        if transfer_s is None:
            if rows is None:
                raise PipelineError("predict needs transfer_s, or rows= to ask the planner for its estimates")
            transfer_s = self.transfer_estimates(rows)
        return schedule.simulate(kind, len(self.stages), microbatches, forward_s, backward_s, transfer_s)


class _StepRun:
    """One step's threads, transfers and spans."""

    def __init__(self, pipe: Pipeline, kind: str, ops, rows: Sequence[int]):
        self.pipe, self.kind, self.ops, self.rows = pipe, kind, ops, rows
        n, m = len(pipe.stages), len(rows)
        # (op, consumer stage, microbatch) -> resolved when that stage's input has arrived
        self.arrivals: dict[tuple[str, int, int], Future] = {}
        for i in range(n):
            for k in range(m):
                if i > 0:
                    self.arrivals[(FORWARD, i, k)] = Future()
                if i < n - 1:
                    self.arrivals[(BACKWARD, i, k)] = Future()
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.failed = threading.Event()
        self.errors: list[BaseException] = []
        self.held = [0] * n
        self.peak = [0] * n
        self.t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, stage: int, op: str, k: int, start: float, end: float) -> None:
        with self.lock:
            self.spans.append(Span(stage, op, k, start, end))

    def go(self) -> Timeline:
        n = len(self.pipe.stages)
        waiters = ThreadPoolExecutor(min(64, max(2, 2 * (n - 1) * len(self.rows))),
                                     thread_name_prefix="reshard-pipeline-transfer")
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.stage, args=(i, waiters), name=f"reshard-pipeline-stage{i}")
                   for i in range(n)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            waiters.shutdown(wait=True)
        if self.errors:
            raise self.errors[0]
        end = max(s.end_s for s in self.spans)
        spans = tuple(sorted(self.spans, key=lambda s: (s.stage, s.start_s, s.op)))
        return Timeline(self.kind, n, len(self.rows), end, tuple(self.peak), spans)

    def send(self, op: str, stage: int, k: int, waiters: ThreadPoolExecutor) -> None:
        """Start the reshard of what ``stage`` just produced for microbatch ``k`` toward its consumer."""
        pipe = self.pipe
        to = stage + 1 if op == FORWARD else stage - 1
        name = pipe._out(stage, k) if op == FORWARD else pipe.input_grad(stage, k)
        start = self.now()
        job = pipe.client.reshard(name, pipe.stages[to].activations)
        arrived = self.arrivals[(op, to, k)]

        def wait() -> None:
            try:
                pipe._wait(job)
            except BaseException as e:
                arrived.set_exception(e)
                raise
            self.record(stage, f"send {op}", k, start, self.now())
            arrived.set_result(None)

        waiters.submit(wait)

    def receive(self, op: str, stage: int, k: int) -> None:
        arrived = self.arrivals[(op, stage, k)]
        if arrived.done():
            arrived.result()
            return
        start = self.now()
        deadline = time.monotonic() + self.pipe.timeout_s
        while not arrived.done():
            if self.failed.is_set():
                raise _Abort()
            if time.monotonic() > deadline:
                raise TimeoutError(f"stage {stage} waited {self.pipe.timeout_s:g}s for {op}{k}")
            try:
                arrived.result(timeout=0.05)
            except TimeoutError:
                continue
        arrived.result()
        self.record(stage, "wait", k, start, self.now())

    def stage(self, i: int, waiters: ThreadPoolExecutor) -> None:
        pipe, n, total = self.pipe, len(self.pipe.stages), sum(self.rows)
        try:
            for op, k in self.ops[i]:
                if op == FORWARD:
                    if i > 0:
                        self.receive(FORWARD, i, k)
                    self.held[i] += 1
                    self.peak[i] = max(self.peak[i], self.held[i])
                    start = self.now()
                    pipe.forward(i, k)
                    self.record(i, FORWARD, k, start, self.now())
                    if i < n - 1:
                        self.send(FORWARD, i, k, waiters)
                else:
                    if i < n - 1:
                        self.receive(BACKWARD, i, k)
                    start = self.now()
                    pipe.backward(i, k, total)
                    self.record(i, BACKWARD, k, start, self.now())
                    self.held[i] -= 1
                    if i > 0:
                        self.send(BACKWARD, i, k, waiters)
                if self.failed.is_set():
                    raise _Abort()
            start = self.now()
            pipe.update(i)
            self.record(i, "update", -1, start, self.now())
        except _Abort:
            log.debug("stage %d stops: another stage failed", i)
        except BaseException as e:
            log.warning("pipeline stage %d failed: %s", i, e)
            with self.lock:
                self.errors.append(e)
            self.failed.set()
