"""Pipeline training across meshes (issue 14, must-show 3): a 4-stage MLP, each stage on its own host's mesh
with its own layouts, trains under GPipe, 1F1B and eager-1F1B on real agents; every step's loss equals a
one-process numpy run of the same model and microbatches to 1e-5 relative."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Mesh, Sharding, schedule
from reshard.client.pipeline import Dense, Pipeline, PipelineError, Stage

WIDTHS = (16, 24, 16, 20, 12, 10)  # input, four hidden, classes: five weights over four stages
ROWS, MICROBATCHES, STEPS, LR = 6, 4, 3, 0.5
RELU = (True, True, True, True, False)  # the last layer gives the logits


def _meshes():
    return [Mesh.from_hosts({"x": 2}, [f"host{i}"], 2) for i in range(4)]


def _layouts():
    """(activations, weight layouts) per stage: batch split, replicated, weights split either way."""
    m = _meshes()
    return [
        (Sharding(m[0], ("x", None)), [Sharding(m[0], (None, None))]),
        (Sharding(m[1], (None, None)), [Sharding(m[1], (None, "x"))]),
        (Sharding(m[2], ("x", None)), [Sharding(m[2], ("x", None))]),
        (Sharding(m[3], ("x", None)), [Sharding(m[3], (None, None)), Sharding(m[3], (None, "x"))]),
    ]


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    weights = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in zip(WIDTHS, WIDTHS[1:])]
    batches = []
    for _ in range(STEPS):
        xs = [rng.standard_normal((ROWS, WIDTHS[0])).astype(np.float32) for _ in range(MICROBATCHES)]
        ys = [np.eye(WIDTHS[-1], dtype=np.float32)[rng.integers(0, WIDTHS[-1], ROWS)] for _ in range(MICROBATCHES)]
        batches.append((xs, ys))
    return weights, batches


def _numpy_losses(weights, batches) -> list[float]:
    """The same model and microbatches in one process: gradients summed over microbatches in order."""
    weights = [w.copy() for w in weights]
    losses = []
    for xs, ys in batches:
        total = sum(len(x) for x in xs)
        grads = [np.zeros_like(w) for w in weights]
        loss = 0.0
        for x, y in zip(xs, ys):
            hs, zs = [x], []
            for w, relu in zip(weights, RELU):
                zs.append(hs[-1] @ w)
                hs.append(np.maximum(zs[-1], 0) if relu else zs[-1])
            shifted = hs[-1] - hs[-1].max(1, keepdims=True)
            log_p = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
            loss += float(-(y * log_p).sum())
            dy = (np.exp(log_p) - y) / total
            for j in reversed(range(len(weights))):
                dz = np.where(zs[j] > 0, dy, 0) if RELU[j] else dy
                grads[j] += hs[j].T @ dz
                dy = dz @ weights[j].T
        losses.append(loss / total)
        weights = [w - LR * g for w, g in zip(weights, grads)]
    return losses


# Each schedule on every transport costs make test 3 s a case: it runs each schedule on one transport, in turn, and
# make bench (pytest -m slow) the rest.
@pytest.mark.transports_in_turn
@pytest.mark.parametrize("kind", schedule.KINDS)
def test_a_four_stage_mlp_trains_as_numpy_does(client, kind):
    weights, batches = _data()
    prefix = f"pipe_{kind.replace('-', '_')}"
    stages, w = [], 0
    for activations, layouts in _layouts():
        layers = []
        for layout in layouts:
            name = f"{prefix}.w{w}"
            client.put(name, weights[w], layout)
            layers.append(Dense(name, relu=RELU[w]))
            w += 1
        stages.append(Stage(layers, activations))
    pipe = Pipeline(client, stages, lr=LR, prefix=prefix)
    results = [pipe.step(kind, xs, ys) for xs, ys in batches]
    want = _numpy_losses(weights, batches)
    got = [r.loss for r in results]
    assert got == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]

    timeline = results[-1].timeline
    warm = [schedule.warmup(kind, 4, MICROBATCHES, i) for i in range(4)]
    assert timeline.peak_activations == tuple(warm)
    # Each stage ran its schedule's ops in order, one at a time, then its update.
    for i, ops in enumerate(schedule.build(kind, 4, MICROBATCHES)):
        mine = [s for s in timeline.spans if s.stage == i and s.op in ("F", "B", "update")]
        assert [(s.op, s.microbatch) for s in mine] == ops + [("update", -1)]
        assert all(a.end_s <= b.start_s for a, b in zip(mine, mine[1:]))
    # Every boundary carried each microbatch's activation forward and its gradient back, once.
    sends = sorted((s.op, s.stage, s.microbatch) for s in timeline.spans if s.op.startswith("send"))
    assert sends == sorted([("send F", i, k) for i in range(3) for k in range(MICROBATCHES)]
                           + [("send B", i, k) for i in range(1, 4) for k in range(MICROBATCHES)])
    # Stage 1 keeps a 16- and a 24-wide float32 row for each held microbatch of 6 rows.
    assert results[-1].peak_activation_bytes[1] == warm[1] * ROWS * (16 + 24) * 4


def test_a_pipeline_refuses_weights_that_do_not_chain(client):
    mesh = _meshes()[0]
    client.put("pipe_bad.w0", np.zeros((4, 5), np.float32), Sharding(mesh, (None, None)))
    client.put("pipe_bad.w1", np.zeros((6, 3), np.float32), Sharding(mesh, (None, None)))
    with pytest.raises(PipelineError, match=r"layer weights do not chain: a \(4, 5\) weight feeds one of 6 inputs"):
        Pipeline(client, [Stage([Dense("pipe_bad.w0")], Sharding(mesh, ("x", None))),
                          Stage([Dense("pipe_bad.w1")], Sharding(mesh, ("x", None)))], lr=0.1, prefix="pipe_bad")


def test_a_failing_stage_stops_the_step_instead_of_hanging_it(client):
    weights, batches = _data(1)
    prefix = "pipe_fail"
    stages = []
    for i, (activations, layouts) in enumerate(_layouts()[:2]):
        name = f"{prefix}.w{i}"
        client.put(name, weights[i], layouts[0])
        stages.append(Stage([Dense(name)], activations))
    pipe = Pipeline(client, stages, lr=LR, prefix=prefix, timeout_s=60)
    xs, ys = batches[0]
    # The logits are 16 wide but the labels 10: the last stage's loss fails, and the first stage, waiting for
    # gradients that never come, stops too.
    with pytest.raises(Exception, match="softmax_xent") as info:
        pipe.step("eager-1f1b", xs, ys)
    assert not isinstance(info.value, TimeoutError)
    # The planner's estimate of each boundary's reshard is what predict uses when no transfer time is given.
    (estimate,) = pipe.transfer_estimates(ROWS)
    assert 0 < estimate < 1
    assert pipe.predict("1f1b", 4, 0.01, 0.02, rows=ROWS) == schedule.simulate("1f1b", 2, 4, 0.01, 0.02, estimate)
