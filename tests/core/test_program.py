"""Programs as data: plans become programs of moves, compute and reduce steps validate, JSON, estimates.

Broken programs are made by editing one step of a good program, so each test
shows that `Program.validate` catches exactly that fault and names it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import (
    STRATEGIES,
    Mesh,
    Plan,
    PlanValidationError,
    Program,
    Sharding,
    Step,
    TensorDecl,
    TileRef,
    Topology,
    Transfer,
    plan,
)
from reshard.program import DST, SRC

from tests.core.test_planner_properties import problems

SHAPE = (8, 6)
SRC_SHARDING = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["s0", "s1"]), ("x", None))
# Both devices of a destination host want the same tile, so local_allgather forwards in a phase 1.
DST_ONE_HOST = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, ["d0", "d1"]), ("x", None))
TOPOLOGY = Topology(nic_gbps=8.0, intra_host_gbps=80.0, memory_gb_per_s=4.0)


def _program(strategy="local_allgather") -> Program:
    return Program.from_plan(plan(SHAPE, "float32", SRC_SHARDING, DST_ONE_HOST, strategy=strategy)).validate()


def _edit(p: Program, index: int, **changes) -> Program:
    steps = list(p.steps)
    steps[index] = dataclasses.replace(steps[index], **changes)
    return dataclasses.replace(p, steps=tuple(steps))


# -- from plans ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES))
def test_every_plan_becomes_a_valid_program_whose_depths_are_its_phases(problem, strategy):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy)
    prog = Program.from_plan(p).validate()
    assert [s.id for s in prog.steps] == list(range(len(p.transfers)))
    assert list(prog.depths) == [t.phase for t in p.transfers]
    assert all(not s.after for s, t in zip(prog.steps, p.transfers) if t.phase == 0)
    assert prog.to_plan().transfers == p.transfers
    assert prog.to_plan().id == p.id
    assert prog.estimate() == p.estimate()
    assert [load.phase for load in prog.loads()] == [load.phase for load in p.loads()]


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(STRATEGIES))
def test_program_json_round_trip_and_stable_id(problem, strategy):
    shape, src, dst, topology = problem
    p = plan(shape, "float32", src, dst, topology, strategy=strategy)
    prog = Program.from_plan(p)
    assert Program.from_plan(plan(shape, "float32", src, dst, topology, strategy=strategy)).id == prog.id
    for data in (prog.to_json(), json.loads(prog.dumps()), prog.dumps()):
        q = Program.from_json(data)
        assert q == prog and q.id == prog.id
        assert q.estimate() == prog.estimate()
    # Plan JSON v1, as Plan.to_json writes it, reads as the program made from the plan.
    for data in (p.to_json(), p.dumps()):
        assert Program.from_json(data) == prog


def test_step_waits_for_the_steps_that_feed_its_sender():
    prog = _program()
    p = prog.to_plan()
    for s, t in zip(prog.steps, p.transfers):
        if t.phase == 1:
            # A gather forwards the piece its sender received in phase 0, and only that.
            feeders = [j for j, u in enumerate(p.transfers) if t.sender in u.receivers and u.box == t.box]
            assert s.after == tuple(feeders) and len(feeders) == 1
    assert max(prog.depths) == 1


def test_json_has_the_documented_shape():
    data = _program().to_json()
    assert (data["kind"], data["version"], data["strategy"]) == ("program", 1, "local_allgather")
    assert set(data) == {"kind", "version", "strategy", "tensors", "steps", "estimate_seconds", "topology", "id"}
    assert data["tensors"][0]["name"] == "tensor" and set(data["tensors"][0]) == {"name", "shape", "dtype", "src", "dst"}
    move = data["steps"][-1]
    assert set(move) == {"id", "kind", "after", "tensor", "box", "sender", "receivers", "method"}
    assert move["kind"] == "move" and move["after"]


def test_tampered_json_is_rejected():
    data = _program().to_json()
    data["steps"][0]["box"] = [[0, 1], [0, 6]]
    with pytest.raises(PlanValidationError, match=f"claims id {data['id']} but its content hashes to [0-9a-f]{{64}}"):
        Program.from_json(data)


def test_json_of_another_version_or_kind_is_rejected():
    data = _program().to_json()
    with pytest.raises(PlanValidationError, match="program JSON version 2 is not supported"):
        Program.from_json({**data, "version": 2})
    with pytest.raises(PlanValidationError, match="neither a program .* nor a plan"):
        Program.from_json({"kind": "job"})
    del data["tensors"]
    with pytest.raises(PlanValidationError, match="lacks the field 'tensors'"):
        Program.from_json(data)


def test_id_changes_with_content_and_str_is_one_line():
    a, b = _program("local_allgather"), _program("send_recv")
    assert a.id != b.id
    text = str(a)
    assert "\n" not in text and text.startswith(f"Program {a.id[:12]} local_allgather: float32[8,6]")
    assert "P('x', None) -> P('x', None)" in text and "moves" not in text and "2 deep" in text
    assert a.summary().splitlines()[0] == text


# -- validation of the graph and of moves ---------------------------------------------------------------


def test_a_dependency_cycle_is_rejected():
    prog = _program()
    last = len(prog.steps) - 1
    first_dep = prog.steps[last].after[0]
    broken = _edit(prog, first_dep, after=(last,))
    with pytest.raises(PlanValidationError, match=f"cycle {first_dep} -> {last} -> {first_dep}.*break the cycle"):
        broken.validate()


def test_an_unknown_or_later_dependency_is_rejected():
    prog = _program()
    n = len(prog.steps)
    with pytest.raises(PlanValidationError, match=rf"step #0 .* depends on \[{n + 3}\], which are not steps "
                                                  rf"of this program \(ids 0..{n - 1}\)"):
        _edit(prog, 0, after=(n + 3,)).validate()
    with pytest.raises(PlanValidationError, match=r"step #0 .* depends on the later steps \[1\]; list every step"):
        _edit(prog, 0, after=(1,)).validate()


def test_ids_must_be_positions():
    prog = _program()
    with pytest.raises(PlanValidationError, match="listed at position 0; a step's id is its position"):
        _edit(prog, 0, id=7).validate()


def test_a_sender_must_hold_its_box_once_its_dependencies_are_done():
    prog = _program()
    gather = next(s for s in prog.steps if s.after)
    # A phase-1 gather that no longer waits for the step delivering its piece.
    with pytest.raises(PlanValidationError, match=rf"step #{gather.id} move .*: sender {gather.transfer.sender} does "
                                                  r"not hold box .* at the start \(it depends on no step\)"):
        _edit(prog, gather.id, after=()).validate()
    # Waiting on some other phase-0 step is no better, although that step ran earlier.
    other = next(i for i in range(len(prog.steps)) if i not in gather.after and not prog.steps[i].after)
    with pytest.raises(PlanValidationError, match=rf"when its dependencies \[{other}\] are done"):
        _edit(prog, gather.id, after=(other,)).validate()


def test_moves_must_still_cover_every_destination_tile():
    prog = _program()
    broken = dataclasses.replace(prog, steps=prog.steps[:-1])
    with pytest.raises(PlanValidationError, match=r"destination device d\d/\d .* misses \d+ of its"):
        broken.validate()


def test_a_step_sets_only_the_fields_of_its_kind():
    t = Transfer(((0, 1),), "a/0", ("a/1",), "local")
    with pytest.raises(PlanValidationError, match=r"step 3: a move step uses only \['transfer', 'tensor', 'role'\], "
                                                  r"but sets \['kernel'\]"):
        Step(3, "move", transfer=t, tensor="x", kernel="copy")
    with pytest.raises(PlanValidationError, match="kind 'send' is not one of"):
        Step(3, "send")


# -- compute and reduce ---------------------------------------------------------------------------------------

DEVS = ("h0/0", "h0/1", "h1/0", "h1/1")
G = Sharding(Mesh.from_hosts({"r": 4}, ["h0", "h1"], 2), (None, None))  # every device holds all of "grad"


def _general(*steps, tensors=None) -> Program:
    tensors = tensors or (
        TensorDecl("grad", (8, 16), "float32", src=G),
        TensorDecl("total", (8, 16), "float32"),
    )
    return Program(tensors, steps, "custom", TOPOLOGY)


WHOLE = ((0, 8), (0, 16))
GRAD = TileRef("grad", SRC, WHOLE)
TOTAL = TileRef("total", "reduced", WHOLE)


def test_a_program_of_compute_reduce_and_moves_validates_round_trips_and_estimates():
    prog = _general(
        Step.compute(0, "copy", "h0/0", [GRAD], TileRef("grad", "partial", WHOLE)),
        Step.compute(1, "copy", "h1/0", [GRAD], TileRef("grad", "partial", WHOLE)),
        Step.reduce(2, "sum", ["h0/0", "h1/0"], TileRef("grad", "partial", WHOLE), TOTAL, after=[0, 1]),
        Step.move(3, Transfer(((0, 4), (0, 16)), "h1/0", ("h1/1",), "local"), after=[2], tensor="total"),
        Step.reduce(4, "max", DEVS, GRAD, TileRef("total", "max", WHOLE), result="shard", dim=0),
    ).validate()
    assert prog.depths == (0, 0, 1, 2, 0)
    again = Program.from_json(prog.dumps())
    assert again == prog and again.id == prog.id
    nbytes = 8 * 16 * 4
    est = prog.step_estimates()
    copy_s = 2 * nbytes / 4e9
    assert est[0].seconds == est[1].seconds == pytest.approx(copy_s)
    # Two members on different hosts: a ring all-reduce sends 2(n-1)/n * b = b each way over the NICs.
    assert est[2].start == pytest.approx(copy_s)
    assert est[2].seconds == pytest.approx(nbytes / 1e9) and est[2].bottleneck.startswith("NIC")
    assert est[3].start == pytest.approx(est[2].finish)
    assert est[3].seconds == pytest.approx(nbytes / 2 / 10e9)
    assert prog.estimate() == pytest.approx(est[3].finish)
    # The all-reduce sends b from h0; the 4-member ring of the reduce-scatter crosses from h0 once, with 3/4 b.
    assert prog.host_bytes()["h0"]["bytes_out"] == nbytes + 3 * nbytes // 4
    assert "2 compute" in str(prog) and "tensors grad, total" in str(prog)
    # Member i of the reduce-scatter ends with rows 2i..2i+2, so a later step can read them there.
    _general(*prog.steps, Step.compute(5, "copy", "h1/1", [TileRef("total", "max", ((6, 8), (0, 16)))],
                                       TileRef("total", "out", ((0, 2), (0, 16))), after=[4])).validate()
    with pytest.raises(PlanValidationError, match=r"device h1/1 does not hold total:max\[4:6, 0:16\]"):
        _general(*prog.steps, Step.compute(5, "copy", "h1/1", [TileRef("total", "max", ((4, 6), (0, 16)))],
                                           TileRef("total", "out", ((0, 2), (0, 16))), after=[4])).validate()


@pytest.mark.parametrize("n, result, algorithm, nic_bytes", [
    (4, "replicate", "ring", 2 * 3 / 4),
    (4, "shard", "ring", 3 / 4),
    (2, "replicate", "ring", 1.0),
    (3, "replicate", "chain", 4.0),  # two hops to the last member, two hops back, one after another
    (3, "shard", "chain", 2 + 2 / 3),  # two hops, then the last member sends two pieces of b/3
])
def test_reduce_estimates_on_hand_examples(n, result, algorithm, nic_bytes):
    hosts = [f"n{i}" for i in range(n)]
    devs = [f"{h}/0" for h in hosts]
    g = Sharding(Mesh.from_hosts({"r": n}, hosts, 1), (None, None))
    tensors = (TensorDecl("g", (12, 10), "float64", src=g), TensorDecl("out", (12, 10), "float64"))
    box = ((0, 12), (0, 10))
    step = Step.reduce(0, "sum", devs, TileRef("g", SRC, box), TileRef("out", DST, box), result=result,
                       algorithm=algorithm, dim=0 if result == "shard" else None)
    prog = Program(tensors, (step,), "custom", TOPOLOGY).validate()
    b = 12 * 10 * 8
    assert prog.estimate() == pytest.approx(nic_bytes * b / 1e9)


def test_a_reduce_on_one_host_uses_the_intra_host_link():
    step = Step.reduce(0, "sum", ["h0/0", "h0/1"], GRAD, TOTAL)
    prog = _general(step).validate()
    assert prog.estimate() == pytest.approx(8 * 16 * 4 / 10e9)
    assert prog.host_bytes() == {"h0": {"bytes_out": 0, "bytes_in": 0, "local_bytes": 2 * 8 * 16 * 4}}


def test_a_compute_with_a_mismatched_shape_is_rejected():
    step = Step.compute(0, "copy", "h0/0", [GRAD], TileRef("total", "out", ((0, 8), (0, 8))))
    with pytest.raises(PlanValidationError, match=r"step #0 compute copy on h0/0: .* kernel 'copy' makes a tile of "
                                                  r"shape \(8, 16\) from input shapes \[\(8, 16\)\], but the output "
                                                  r"box \[0:8, 0:8\] has shape \(8, 8\); give the output a box"):
        _general(step).validate()


@pytest.mark.parametrize("change, message", [
    (dict(kernel="conv2d"), r"kernel 'conv2d' is not one of \[.*'copy'.*\]; use one of those or add it"),
    (dict(device="h0"), r"device id 'h0' has no host"),
    (dict(inputs=()), r"kernel 'copy' reads 1 input tile\(s\) and writes one output; the step names 0 input"),
    (dict(inputs=(TileRef("nope", SRC, WHOLE),)), r"tensor 'nope' is not declared by the program"),
    (dict(inputs=(TileRef("grad", SRC, ((0, 9), (0, 16))),)), r"input grad:src\[0:9, 0:16\] is not a box of"),
    (dict(inputs=(TileRef("total", "partial", WHOLE),)), r"device h0/0 does not hold total:partial\[0:8, 0:16\] "
                                                          r"at the start"),
    (dict(params=(("scale", "2"),)), r"copy takes no parameters; got \['scale'\]"),
])
def test_compute_rules(change, message):
    step = dataclasses.replace(Step.compute(0, "copy", "h0/0", [GRAD], TileRef("total", "out", WHOLE)), **change)
    with pytest.raises(PlanValidationError, match=message):
        _general(step).validate()


@pytest.mark.parametrize("change, message", [
    (dict(devices=("h0/0", "h1/0", "h0/0")), r"devices \['h0/0', 'h1/0', 'h0/0'\] name \['h0/0'\] more than once; "
                                              r"each member of the group holds one set of addends"),
    (dict(devices=()), "a group of at least one device"),
    (dict(op="mean"), r"op 'mean' is not one of \['sum', 'max'\]"),
    (dict(result="gather"), r"result 'gather' is not one of \['replicate', 'shard'\]"),
    (dict(algorithm="tree"), r"algorithm 'tree' is not one of \['ring', 'chain'\]"),
    (dict(result="shard"), r"a reduce-scatter \(result 'shard'\) cuts its box along a dim 0..1; dim is None"),
    (dict(dim=1), r"dim 1 applies to result 'shard' only"),
    (dict(inputs=(TileRef("grad", SRC, ((0, 0), (0, 16))),), output=TileRef("total", "r", ((0, 0), (0, 16)))),
     r"the reduced box \[0:0, 0:16\] is empty; drop the step"),
    (dict(output=TileRef("total", "r", ((0, 4), (0, 16)))), r"output box \[0:4, 0:16\] differs from the input box"),
    (dict(devices=("h0/0", "h2/0")), r"device h2/0 does not hold grad:src\[0:8, 0:16\] at the start"),
])
def test_reduce_rules(change, message):
    step = dataclasses.replace(Step.reduce(0, "sum", ["h0/0", "h1/0"], GRAD, TOTAL), **change)
    with pytest.raises(PlanValidationError, match=message):
        _general(step).validate()


def test_a_free_move_needs_its_box_held_and_a_move_only_program_of_one_reshard_tensor_is_a_plan():
    move = Step.move(0, Transfer(((0, 4), (0, 16)), "h0/0", ("h1/0",), "p2p"), tensor="total")
    with pytest.raises(PlanValidationError, match=r"step #0 move total p2p .*: device h0/0 does not hold box "
                                                  r"\[0:4, 0:16\] of 'total' at the start"):
        _general(move).validate()
    with pytest.raises(PlanValidationError, match="only a program of moves is a plan; this one has"):
        dataclasses.replace(_program(), steps=(*_program().steps, Step.reduce(8, "sum", ["d0/0"], GRAD, TOTAL)
                                               )).to_plan()
    with pytest.raises(PlanValidationError, match=r"name the one tensor of a reshard program.*\['grad', 'total'\]"):
        _general().shape


def test_a_move_reads_the_role_it_names():
    reduce = Step.reduce(0, "sum", ["h0/0", "h1/0"], GRAD, TOTAL)
    half = ((0, 4), (0, 16))
    move = Step.move(1, Transfer(half, "h1/0", ("h1/1",), "local"), after=[0], tensor="total", role="reduced")
    prog = _general(reduce, move).validate()
    data = prog.to_json()
    assert data["steps"][1]["role"] == "reduced" and "role" not in _program().to_json()["steps"][0]
    again = Program.from_json(prog.dumps())
    assert again == prog and again.id == prog.id and again.steps[1].role == "reduced"
    assert str(move).startswith("#1 move total:reduced local [0:4, 0:16] h1/0 -> h1/1")
    # Role "src", the default, reads whatever the sender holds; any other role only that role's buffers.
    _general(reduce, dataclasses.replace(move, role=SRC)).validate()
    with pytest.raises(PlanValidationError, match=r"step #1 move total:max .*: device h1/0 does not hold "
                                                  r"total:max\[0:4, 0:16\] when its dependencies \[0\] are done"):
        _general(reduce, dataclasses.replace(move, role="max")).validate()
    # A reshard tensor's sender is checked in the role it names too, beside the plan's rules: a phase-1 gather
    # forwards from its destination tile what phase 0 delivered there, which a phase-0 sender has not.
    prog = _program()
    gather = next(s for s in prog.steps if s.after)
    _edit(prog, gather.id, role=DST).validate()
    first = prog.steps[0]
    with pytest.raises(PlanValidationError, match=rf"step #0 move tensor:dst .*: device {first.transfer.sender} "
                                                  r"does not hold tensor:dst\[.*\] at the start"):
        _edit(prog, 0, role=DST).validate()


def test_topology_json_without_memory_bandwidth_reads_with_the_default():
    old = {"nic_gbps": 25.0, "intra_host_gbps": 100.0, "host_nic_gbps": {}, "host_intra_gbps": {}}
    topo = Topology.from_json(old)
    assert topo.memory_gb_per_s == 20.0 and topo.memory_bytes_per_s("any") == 20e9
    assert Topology.from_json(TOPOLOGY.to_json()) == TOPOLOGY
    with pytest.raises(ValueError, match="memory_gb_per_s is 0; bandwidths must be positive numbers of GB/s"):
        Topology(memory_gb_per_s=0)


def test_plan_json_v1_from_a_file_reads_as_a_program():
    p = plan(SHAPE, "float32", SRC_SHARDING, DST_ONE_HOST, strategy="auto")
    assert isinstance(Program.from_json(p.dumps()), Program)
    assert Program.from_json(p.dumps()).to_plan() == Plan.from_json(p.dumps())
