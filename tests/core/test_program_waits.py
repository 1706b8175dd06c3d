"""Programs whose moves wait for compute steps (quantize on the way, issue 41): validating them holds memory that
grows with the moves, not with the square of the steps, and their estimate is never below what all their moves'
loads take together."""

from __future__ import annotations

import tracemalloc

import pytest

from reshard import Mesh, Sharding, Topology
from reshard.cost import HostCache, move_phase_loads
from reshard.errors import PlanValidationError
from reshard.many import plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.plans import Transfer
from reshard.program import MOVE, Program, Step, TensorDecl, TileRef

ONE = Sharding(Mesh.from_hosts({"r": 1}, ["h0"], 1), (None, None))  # h0/0 holds the whole tensor
TOPOLOGY = Topology(nic_gbps=8.0, intra_host_gbps=80.0, memory_gb_per_s=4.0)
QUANTIZED = "q"


def _moves_as_one_phase(program: Program, topology: Topology) -> float:
    """What the program's moves take on their links all at once: no schedule of them is shorter."""
    hosts = HostCache()
    (load,) = move_phase_loads(((0, s.transfer, program.tensor(s.tensor).itemsize) for s in program.steps
                                if s.kind == MOVE), hosts)
    return load.seconds(topology, hosts)[0]


def _quantized(rows: int) -> Program:
    """``rows`` moves of "x" from h0/0 that wait for nothing, a compute step that makes "y" there from "x", then
    ``rows`` moves of what it made that wait for it: a quantized weight's steps, listed after other tensors'."""
    x, y = TensorDecl("x", (rows, 64), "float32", src=ONE), TensorDecl("y", (rows, 64), "float32")
    steps = [Step.move(k, Transfer(((k, k + 1), (0, 64)), "h0/0", ("h1/0",), "p2p"), tensor="x")
             for k in range(rows)]
    whole = ((0, rows), (0, 64))
    steps.append(Step.compute(rows, "copy", "h0/0", [TileRef("x", "src", whole)], TileRef("y", QUANTIZED, whole)))
    steps += [Step.move(rows + 1 + k, Transfer(((k, k + 1), (0, 64)), "h0/0", ("h1/0",), "p2p"), after=[rows],
                        tensor="y", role=QUANTIZED) for k in range(rows)]
    return Program((x, y), tuple(steps), "custom", TOPOLOGY)


def test_validating_moves_that_wait_for_a_late_step_holds_memory_linear_in_the_moves():
    # A bit set per step up to its latest ancestor held rows**2 / 8 bytes here (20 MiB, 2.5 MiB now): 1.75 GiB for
    # the quantized two-layer Kimi-like program, 14.6 GiB for four layers.
    rows = 12_000
    program = _quantized(rows)
    tracemalloc.start()
    try:
        program.validate()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20, f"validate peaked at {peak / 2**20:.1f} MiB"
    # A move that no longer waits for the step that made its box is refused as before.
    steps = list(program.steps)
    late = rows + 2
    steps[late] = Step.move(late, steps[late].transfer, tensor="y", role=QUANTIZED)
    with pytest.raises(PlanValidationError, match=rf"step #{late} move y:q .*: device h0/0 does not hold "
                                                  r"y:q\[1:2, 0:64\] at the start"):
        Program(program.tensors, tuple(steps), "custom", TOPOLOGY).validate()


def test_moves_after_a_compute_step_share_the_links_of_the_moves_still_running():
    program = _quantized(4).validate()
    bound = _moves_as_one_phase(program, TOPOLOGY)
    first = 4 * 64 * 4 / 1e9  # the first four rows through h0's NIC at 8 Gbit/s
    assert bound == pytest.approx(2 * first)
    # The copy takes a few microseconds, so the moves that wait for it start while the first ones still run on
    # the same NIC; priced as if each depth had the links to itself, the program took first + the copy.
    estimates = program.step_estimates()
    copy = estimates[4]
    assert copy.finish < first
    late = estimates[5]
    assert late.start == copy.finish and late.finish == pytest.approx(2 * first)
    assert late.bottleneck == "NIC send of h0, shared with moves of earlier depths"
    assert program.estimate() == max(e.finish for e in estimates) >= bound
    assert program.estimate_seconds == program.estimate()


def test_a_quantize_on_the_way_estimate_is_never_below_its_moves_as_one_phase():
    train = Mesh.grid({"host": 2, "gpu": 4}, 4, "train")
    serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "serve", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    for topology in (Topology.gpu_hosts(nics=2), TOPOLOGY):
        program = plan_many(case.tensors, topology, scales=case.scales, dtypes=case.serve_dtypes)
        bound = _moves_as_one_phase(program, topology)
        assert program.estimate() >= bound * (1 - 1e-12), (program.estimate(), bound)
        assert program.estimate() == max(e.finish for e in program.step_estimates())
