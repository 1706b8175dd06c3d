"""The cost model's estimate, made fast, is the float it was: bit for bit what the per-flow implementation gave.

`Program.estimate` and `reshard.cost.phase_loads` add up a move's flows per group of like transfers (issue 41: the
estimate of a Kimi-like state dict's program cost as much as planning it). A program's text carries its estimate
and plan ids hash that text, so every program here is checked against the old code, kept below as the reference:
`_old_phase_loads` (a `Flow` per link of every transfer, added up in transfer order) and `_old_estimate` (the
latest finish of what `Program.step_estimates` computed, with one rule added since, written apart from the one in
`reshard.program`: a link still busy with an earlier depth's moves when a later depth's start carries the later
bytes after them, so an estimate is never below the moves' loads together; without such overlaps it is the old
formula unchanged).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Mesh, Sharding, Topology, plan, plan_einsum
from reshard.cases import n_to_m_cases, one_to_m_cases, overlap_cases
from reshard.cost import HostCache, PhaseLoad, phase_loads, transfer_flows
from reshard.errors import PlanValidationError
from reshard.many import ManyProgram, plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.partial_plan import reshard_program
from reshard.plans import Transfer
from reshard.program import MOVE, Program, Step, TensorDecl, TileRef
from reshard.routes import hops
from tests.core.test_einsum import CASES as EINSUM_CASES
from tests.core.test_many import _state_dict as small_state_dict
from tests.core.test_plan_speed import _state_dict as long_route_state_dict
from tests.core.test_planner_properties import problems

# -- the reference: the code as it was before issue 41 ------------------------------------------------------------


def _old_phase_loads(transfers, itemsize: int, hosts: HostCache | None = None) -> list[PhaseLoad]:
    hosts = hosts if hosts is not None else HostCache()
    phases: dict[int, PhaseLoad] = {}
    for t in transfers:
        load = phases.get(t.phase)
        if load is None:
            load = phases[t.phase] = PhaseLoad(t.phase)
        load.add(transfer_flows(t, itemsize, hosts))
    return [phases[p] for p in sorted(phases)]


def _old_loads(program: Program, hosts: HostCache) -> list[PhaseLoad]:
    depths = program.depths
    levels: dict[int, PhaseLoad] = {}
    for s in program.steps:
        if s.kind == MOVE:
            load = levels.get(depths[s.id])
            if load is None:
                load = levels[depths[s.id]] = PhaseLoad(depths[s.id])
            load.add(transfer_flows(s.transfer, program.tensor(s.tensor).itemsize, hosts))
    return [levels[d] for d in sorted(levels)]


def _old_estimate(program: Program, topology: Topology | None = None) -> float:
    """``max(e.finish for e in program.step_estimates(topology))`` as `step_estimates` computed it, plus the rule
    for links still busy from an earlier depth (the module docstring)."""
    topo = topology or program.topology
    hosts = HostCache()
    depths = program.depths
    loads = {load.phase: load for load in _old_loads(program, hosts)}
    levels = {depth: load.seconds(topo, hosts) for depth, load in loads.items()}
    free: dict[tuple, float] = {}  # per link, when it is done with the moves of the depths before (issue 41)
    by_depth: dict[int, list[Step]] = defaultdict(list)
    for s in program.steps:
        by_depth[depths[s.id]].append(s)
    finish = [0.0] * len(program.steps)
    for depth in sorted(by_depth):
        steps = by_depth[depth]
        moves = [s for s in steps if s.kind == MOVE]
        if moves:
            secs, _ = levels[depth]
            start = max((finish[a] for s in moves for a in s.after), default=0.0)
            end = start + secs
            load = loads[depth]
            for kind, links in (("send", load.send), ("recv", load.recv), ("in", load.dev_in), ("out", load.dev_out)):
                for node, nbytes in links.items():
                    rate = (topo.nic_bytes_per_s(node) if kind in ("send", "recv")
                            else topo.intra_bytes_per_s(hosts[node]))
                    busy = free.get((kind, node), 0.0)
                    free[kind, node] = max(busy, start) + nbytes / rate
                    if busy > start:
                        end = max(end, free[kind, node])
            for s in moves:
                finish[s.id] = end
        for s in steps:
            if s.kind == MOVE:
                continue
            secs, _ = program._seconds(s, topo, hosts)
            start = max((finish[a] for a in s.after), default=0.0)
            finish[s.id] = start + secs
    return max(finish, default=0.0)


# -- checks --------------------------------------------------------------------------------------------------------


def _as_lists(loads: list[PhaseLoad]) -> list:
    # Key order included: on a tie, the first busiest link in a load's dicts is the one a summary names.
    return [(p.phase, list(p.send.items()), list(p.recv.items()), list(p.dev_in.items()), list(p.dev_out.items()))
            for p in loads]


def _same(got, want) -> bool:
    # repr writes the shortest text that reads back as the same double, so equal text is equal bits.
    return type(got) is type(want) and repr(got) == repr(want)


def _assert_estimates_as_before(program: Program, *topologies: Topology) -> None:
    for topology in (None, *topologies):
        want = _old_estimate(program, topology)
        assert _same(program.estimate(topology), want)
    moves = [s.transfer for s in program.steps if s.kind == MOVE]
    for itemsize in (1, 2, 4):
        assert _as_lists(phase_loads(moves, itemsize)) == _as_lists(_old_phase_loads(moves, itemsize))


def _assert_plan_as_before(p, *topologies: Topology) -> None:
    _assert_estimates_as_before(Program.from_plan(p), *topologies)
    if not p._columnar:
        want = sum(load.seconds(p.topology, HostCache())[0] for load in _old_phase_loads(p.transfers, p.itemsize))
        assert _same(p.estimate(), want)


SLOW_HOST = Topology(nic_gbps=10.0, intra_host_gbps=40.0, host_nic_gbps={"h1": 2.5, "t0": 1.0, "i1": 3.0})


def test_the_paper_suites():
    for suite in (n_to_m_cases, one_to_m_cases, overlap_cases):
        for case in suite():
            for strategy in STRATEGIES:
                p = plan(case.shape, case.dtype, case.src, case.dst, Topology(nic_gbps=10.0), strategy)
                _assert_plan_as_before(p, SLOW_HOST, Topology.gpu_hosts())


@pytest.mark.parametrize("name", sorted(EINSUM_CASES))
def test_einsum_programs_with_kernels_reduces_and_moves(name):
    equation, inputs, out_sharding = EINSUM_CASES[name][:3]
    _assert_estimates_as_before(plan_einsum(equation, inputs, "c", out_sharding), SLOW_HOST)


def test_partial_reshards():
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"])
    other = Mesh.from_hosts({"x": 2, "y": 2}, ["o0", "o1"])
    for src, dst in ((Sharding(mesh, (None, None), ("x",)), Sharding(other, (None, None))),
                     (Sharding(mesh, ("x", None), ("y",)), Sharding(mesh, (None, "x"), ("y",))),
                     (Sharding(mesh, (None, None), ("x", "y")), Sharding(other, ("x", "y")))):
        for topology in (SLOW_HOST, Topology(nic_gbps=1.0, intra_host_gbps=1.0)):
            _assert_estimates_as_before(reshard_program((8, 6), "float32", src, dst), topology)


@pytest.mark.parametrize("strategy", ["auto", "broadcast", "send_recv"])
def test_state_dicts_of_many_dtypes(strategy):
    _assert_estimates_as_before(plan_many(small_state_dict(), strategy=strategy), SLOW_HOST)
    _assert_estimates_as_before(plan_many(long_route_state_dict(), Topology.gpu_hosts(), strategy=strategy,
                                          bucket_bytes=2**20), SLOW_HOST)


def test_a_moe_state_dict_with_scales():
    train, serve = Mesh.grid({"host": 4, "gpu": 2}, 2, "t"), Mesh.grid({"host": 2, "gpu": 2}, 2, "s")
    small = moe_state_dict(SMALL_MOE, train, serve, ep_devices=2)
    program = plan_many(small.tensors, Topology.gpu_hosts(nics=2), scales=small.scales)
    _assert_estimates_as_before(program, Topology.gpu_hosts(), SLOW_HOST)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES))
def test_random_plans(problem, strategy):
    shape, src, dst, topology = problem
    _assert_plan_as_before(plan(shape, "float32", src, dst, topology, strategy), SLOW_HOST)


DEVICES = [f"h{h}/{d}" for h in range(3) for d in range(3)]
HOSTS = ["h0", "h1", "h2", "h3"]  # h3 holds no device: a route may name a host without receivers


@st.composite
def programs(draw):
    """Programs no planner writes: moves of every method with routes that repeat or miss hosts, empty boxes,
    boxes, receivers and senders shared between moves, reduces of both algorithms, dependencies at random."""
    tensors = (TensorDecl("a", (64, 64), "float32"), TensorDecl("b", (64, 64), "bfloat16"),
               TensorDecl("c", (64, 64), "uint8"))
    boxes = [((0, 4), (0, 16)), ((4, 4), (0, 64)), ((0, 64), (0, 64)), ((3, 17), (5, 6))]
    steps = []
    for i in range(draw(st.integers(0, 40))):
        after = draw(st.lists(st.integers(0, i - 1), max_size=3)) if i and draw(st.booleans()) else []
        box = draw(st.sampled_from(boxes))
        tensor = draw(st.sampled_from(tensors)).name
        if draw(st.integers(0, 5)) == 0:
            devices = draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=4, unique=True))
            steps.append(Step.reduce(i, "sum", devices, TileRef(tensor, "src", box), TileRef(tensor, "r", box),
                                     result=draw(st.sampled_from(["replicate", "shard"])),
                                     algorithm=draw(st.sampled_from(["ring", "chain"])), dim=0, after=after))
            continue
        method = draw(st.sampled_from(["p2p", "broadcast", "local"]))
        sender = draw(st.sampled_from(DEVICES))
        receivers = tuple(draw(st.lists(st.sampled_from(DEVICES), min_size=1, max_size=5, unique=True)))
        route = tuple(draw(st.lists(st.sampled_from(HOSTS), max_size=4))) if method == "broadcast" else ()
        steps.append(Step.move(i, Transfer(box, sender, receivers, method, phase=draw(st.integers(0, 2)),
                                           route=route), after=after, tensor=tensor))
    return Program(tensors, tuple(steps), "custom", draw(st.sampled_from([SLOW_HOST, Topology.gpu_hosts()])))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs(program):
    _assert_estimates_as_before(program, Topology(nic_gbps=1.0, intra_host_gbps=1.0))


@pytest.mark.slow  # the same at length, in make bench: 200 more programs, 15 s of make test's 2 cores
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_random_programs_long(program):
    _assert_estimates_as_before(program, Topology(nic_gbps=1.0, intra_host_gbps=1.0))


def test_a_program_with_sums_past_a_doubles_mantissa():
    """Bytes added as Python ints stay exact where a double would round: boxes of 2**52 elements."""
    tensors = (TensorDecl("big", (2**26, 2**26), "float64"),)
    box = ((0, 2**26), (0, 2**26))
    steps = [Step.move(i, Transfer(box, "h0/0", ("h1/0",), "p2p"), tensor="big") for i in range(3)]
    steps.append(Step.move(3, Transfer(((0, 1), (0, 1)), "h0/0", ("h1/0",), "p2p"), tensor="big"))
    _assert_estimates_as_before(Program(tensors, tuple(steps)), SLOW_HOST)


def test_an_undeclared_tensor_is_named_as_before():
    decl = TensorDecl("a", (4, 4), "float32")
    program = Program((decl,), (Step.move(0, Transfer(((0, 4), (0, 4)), "h0/0", ("h1/0",), "p2p"), tensor="b"),))
    with pytest.raises(PlanValidationError) as old:
        _old_estimate(program)
    with pytest.raises(PlanValidationError) as new:
        program.estimate()
    assert str(new.value) == str(old.value) and "tensor 'b' is not declared by the program" in str(new.value)


@contextmanager
def _counting(function):
    """How many times ``function`` runs inside the block, read from the interpreter's profile hook."""
    code, calls = function.__code__, [0]

    def hook(frame, event, arg):
        if event == "call" and frame.f_code is code:
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def test_like_transfers_share_their_flows():
    """A state dict's program sends many boxes along the same few paths: the estimate works out each path's hops
    and flows once, not once per move (the old estimate did it 3,000 times here, and made a `Flow` per link of
    each)."""
    tensors = tuple(TensorDecl(f"w{i}", (1024, 64), "bfloat16") for i in range(100))
    paths = [("h0/0", ("h1/0",), "p2p", ()), ("h0/1", ("h1/0", "h1/1", "h2/0"), "broadcast", ("h1", "h2")),
             ("h0/0", ("h0/1", "h0/2"), "local", ())]
    steps = []
    for t in tensors:
        for row in range(10):
            for sender, receivers, method, route in paths:
                box = ((row * 100, row * 100 + 7 + row), (0, 64))
                steps.append(Step.move(len(steps), Transfer(box, sender, receivers, method, route=route),
                                       tensor=t.name))
    program = ManyProgram(tensors, tuple(steps), "custom", topology=Topology.gpu_hosts(nics=2))
    want = _old_estimate(program)
    with _counting(hops) as calls:
        got = program.estimate()
    assert _same(got, want)
    assert calls[0] == len(paths)
    moves = [s.transfer for s in steps]
    with _counting(hops) as calls:
        loads = phase_loads(moves, 2)
    assert calls[0] == len(paths)
    assert _as_lists(loads) == _as_lists(_old_phase_loads(moves, 2))
