"""A program's JSON text and id, written piece by piece, are byte for byte what ``json.dumps`` of its dicts wrote.

`Program.dumps` and `Program.id` write each move's text directly (issue 41: serialising a Kimi-like state dict's
program cost more than planning it). Every program here is checked against the plain definition: ``json.dumps`` of
`Program.to_json`, and `reshard.plans.content_id` of `Program._canonical`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import STRATEGIES, Mesh, Sharding, Topology, plan, plan_einsum
from reshard.cases import n_to_m_cases, one_to_m_cases, overlap_cases
from reshard.einsum import plan_apply
from reshard.many import ManyProgram, plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.partial_plan import reshard_program
from reshard.plans import Transfer, content_id
from reshard.program import SRC, Program, Step, TensorDecl, TileRef, _json_text_chunks
from tests.core.test_einsum import CASES as EINSUM_CASES
from tests.core.test_many import _state_dict as small_state_dict
from tests.core.test_plan_speed import _state_dict as long_route_state_dict
from tests.core.test_planner_properties import problems


def _assert_written_as_json_dumps(program: Program) -> None:
    fresh = dataclasses.replace(program)  # nothing cached: the id and the text are written here
    for canonical, want in ((True, json.dumps(fresh._canonical(), sort_keys=True, separators=(",", ":"))),
                            (False, json.dumps(fresh._canonical()))):
        assert "".join(_json_text_chunks(fresh._json_fields(canonical), canonical)) == want
    assert fresh.id == content_id(fresh._canonical())
    assert fresh.dumps() == json.dumps(fresh.to_json())


def test_the_paper_suites_programs():
    for suite in (n_to_m_cases, one_to_m_cases, overlap_cases):
        for case in suite():
            for strategy in STRATEGIES:
                _assert_written_as_json_dumps(Program.from_plan(plan(case.shape, case.dtype, case.src, case.dst,
                                                                     Topology(nic_gbps=10.0), strategy)))


@pytest.mark.parametrize("name", sorted(EINSUM_CASES))
def test_einsum_programs_with_kernels_reduces_and_moves(name):
    equation, inputs, out_sharding = EINSUM_CASES[name][:3]
    _assert_written_as_json_dumps(plan_einsum(equation, inputs, "c", out_sharding))


def test_partial_reshards_and_an_applied_kernel():
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"])
    other = Mesh.from_hosts({"x": 2, "y": 2}, ["o0", "o1"])
    for src, dst in ((Sharding(mesh, (None, None), ("x",)), Sharding(other, (None, None))),
                     (Sharding(mesh, ("x", None), ("y",)), Sharding(mesh, (None, "x"), ("y",))),
                     (Sharding(mesh, (None, None), ("x", "y")), Sharding(other, ("x", "y")))):
        _assert_written_as_json_dumps(reshard_program((8, 6), "float32", src, dst))
    a = TensorDecl("a", (8, 6), "float32", Sharding(mesh, ("x", None)))
    b = TensorDecl("b", (8, 6), "float32", Sharding(mesh, (None, "y")))
    _assert_written_as_json_dumps(plan_apply("add", [a, b], "c"))


@pytest.mark.parametrize("strategy", ["auto", "broadcast", "send_recv"])
def test_state_dicts_with_buckets(strategy):
    _assert_written_as_json_dumps(plan_many(small_state_dict(), strategy=strategy))
    _assert_written_as_json_dumps(plan_many(long_route_state_dict(), Topology.gpu_hosts(), strategy=strategy,
                                            bucket_bytes=2**20))


def test_a_moe_state_dict_with_scales():
    train, serve = Mesh.grid({"host": 4, "gpu": 2}, 2, "t"), Mesh.grid({"host": 2, "gpu": 2}, 2, "s")
    small = moe_state_dict(SMALL_MOE, train, serve, ep_devices=2)
    program = plan_many(small.tensors, Topology.gpu_hosts(nics=2), scales=small.scales)
    assert program.buckets and any(t.name.endswith("scale_inv") for t in program.tensors)
    _assert_written_as_json_dumps(program)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(STRATEGIES))
def test_random_plans_programs(problem, strategy):
    shape, src, dst, topology = problem
    _assert_written_as_json_dumps(Program.from_plan(plan(shape, "float32", src, dst, topology, strategy)))


def test_what_a_program_may_hold_that_planners_do_not_write():
    """Names JSON escapes, roles, dependencies, a route that only a broadcast writes, boxes and receivers shared
    between steps or equal in different objects, a strategy of any text: each written as json.dumps writes it."""
    box = ((0, 4), (0, 16))
    receivers = ("h1/0", "h1/1")
    tensors = (TensorDecl("gr\u00e4d \"q\"\n", (8, 16), "float32"), TensorDecl("\U0001f600", (8, 16), "bfloat16"))
    steps = (
        Step.move(0, Transfer(box, "h0/0", receivers, "broadcast", route=("h1",)), tensor=tensors[0].name),
        Step.move(1, Transfer(box, "h0/0", tuple(receivers), "p2p", route=("ignored",)), tensor=tensors[1].name,
                  role="reduced"),
        Step.move(2, Transfer(((0, 4), (0, 16)), "h1/0", ("h0/\u00e9",), "local", phase=3), after=[1, 0],
                  tensor=tensors[0].name, role=SRC),
        Step.compute(3, "einsum", "h0/0", [TileRef(tensors[0].name, "dst", box)], TileRef("\U0001f600", "o", box),
                     after=[2], params={"equation": "ij->ij", "\u00fc": "\u00e9"}),
        Step.reduce(4, "sum", ["h0/0", "h1/0"], TileRef(tensors[1].name, SRC, box), TileRef("\U0001f600", "r", box),
                    result="shard", dim=1, after=[3]),
        Step.move(5, Transfer(box, "h0/0", receivers, "broadcast", route=("h1",)), after=[4],
                  tensor=tensors[1].name),
    )
    for strategy in ("", "custom \u2013 \"quoted\"", "auto"):
        _assert_written_as_json_dumps(Program(tensors, steps, strategy, Topology(nic_gbps=8.0)))
        _assert_written_as_json_dumps(ManyProgram(tensors, steps, strategy, buckets=((0, 5), (1, 2))))
    _assert_written_as_json_dumps(Program((), ()))
    _assert_written_as_json_dumps(ManyProgram((), ()))
