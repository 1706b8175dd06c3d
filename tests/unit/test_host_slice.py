"""A program cut per host (`reshard.host_slice`, issue 41: each agent gets only its part): a host's slice holds the
steps it takes part in and no other, and what its agent works out from it (`HostLayout`: its tasks in their order
with their depths and dependencies, its stream numbers, buckets, bytes, tiles and staging) is what it works out
from the whole program, on a quantized MoE state dict (runs of steps), a bucketed dense one, and einsum programs
with compute and reduce steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from reshard import Mesh, Sharding, Topology, plan_einsum
from reshard.errors import PlanValidationError
from reshard.host_slice import HostCut, ProgramSlice, StepNotHere, read_slice, step_hosts
from reshard.many import plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.program import TensorDecl
from reshard.proto.errors import InvalidArgumentError
from reshard.server.agent.buckets import bucket_moves
from reshard.server.agent.programs import HostLayout, load_program
from reshard.server.agent.task_graph import host_tasks
from tests.core.test_einsum import CASES
from tests.core.test_many import _state_dict


def _programs():
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    yield plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)
    yield plan_many(_state_dict(num_layers=4))
    for case in list(CASES.values())[:6]:
        yield plan_einsum(*case[:2], "c", case[2])


def _described(layout: HostLayout) -> list:
    return [(t.step.id, t.role, t.depth, t.hop, t.peer, t.deps, t.local, t.rank, t.step.kind,
             t.step.transfer if t.step.kind == "move" else None, layout.streams[t.step.id], layout.dtypes[t.step.id])
            for t in layout.tasks]


def _bucketed(layout: HostLayout) -> dict:
    return {i: (b.step.transfer, b.nbytes, [(p[0], p[1], p[2], p[3]) for p in b.parts])
            for i, b in layout.buckets.items()}


def test_a_hosts_slice_holds_its_steps_alone_and_its_layout_is_the_whole_programs():
    for program in _programs():
        cut = HostCut(program.validate())
        whole = len(program.dumps())
        for host in sorted(cut.hosts):
            text = cut.text(host)
            part, ident = load_program(text)
            assert isinstance(part, ProgramSlice) and ident == part.id == program.id
            mine = [s.id for s in program.steps if host in step_hosts(s)]
            assert np.flatnonzero(part.steps.present).tolist() == mine
            assert [s.id for s in part.steps] == mine and [s for s in part.steps] == [program.steps[i] for i in mine]
            full, sliced = HostLayout(program, host), HostLayout(part, host)
            assert _described(sliced) == _described(full)
            assert sliced.depths == full.depths and sliced.calls_peers == full.calls_peers
            assert _bucketed(sliced) == _bucketed(full)
            assert sliced.num_streams == full.num_streams and sliced.bytes_total == full.bytes_total
            assert [t.name for t in sliced.here] == [t.name for t in full.here]
            assert sliced.staged == full.staged and sliced.tile_plans == full.tile_plans
            assert sliced.num_committed == full.num_committed and sliced.moves_only == full.moves_only
            assert sliced.bucket_buffers == full.bucket_buffers
            if len(cut.hosts) > 2:
                assert len(text) < whole, host


def test_a_slices_run_steps_are_made_when_asked_for_and_other_hosts_steps_are_not_there():
    program = next(_programs())
    assert program.runs  # the quantized state dict's weights move as runs of their layouts' steps
    cut = HostCut(program)
    host = "s2"
    part, _ = load_program(cut.text(host))
    assert part.steps._pending  # nothing made at reading
    HostLayout(part, host)
    other = next(s.id for s in program.steps if host not in step_hosts(s))
    with pytest.raises(StepNotHere, match=f"step {other} is not one of this host's steps"):
        part.steps[other]
    with pytest.raises(InvalidArgumentError, match="was handed host s2's slice"):
        HostLayout(part, "s3")


def test_a_broken_slice_is_refused_naming_what_is_wrong():
    program = next(_programs())
    data = json.loads(HostCut(program).text("s2"))
    run = next(k for k, e in enumerate(data["steps"]) if "like" in e)

    def broken(**change):
        return {**data, **change}

    with pytest.raises(PlanValidationError, match="a run repeats earlier steps"):
        steps = list(data["steps"])
        steps[run] = {**steps[run], "like": steps[run]["at"]}
        read_slice(broken(steps=steps))
    after = next((k for k, e in enumerate(data["steps"]) if k > run and "like" not in e), None)
    if after is not None:  # a step written out inside the run before it
        with pytest.raises(PlanValidationError, match="not after the runs before it"):
            steps = list(data["steps"])
            steps[after] = {**steps[after], "id": steps[run]["at"]}
            read_slice(broken(steps=steps))
    with pytest.raises(PlanValidationError, match="columns of one length"):
        read_slice(broken(standing={**data["standing"], "rank": data["standing"]["rank"][1:]}))
    with pytest.raises(PlanValidationError, match="not 'program_slice'"):
        read_slice(broken(kind="plan"))
    with pytest.raises(PlanValidationError, match="must list steps of the slice"):
        read_slice(broken(buckets=[[len(program.steps) + 5]]))


TRAIN = Mesh.grid({"host": 2, "gpu": 2}, 2, "t")
SERVE = Mesh.grid({"host": 3, "gpu": 2}, 2, "s")


def _quantizing():
    """Rows over the training devices to: every serving device (broadcast chains over hosts), rows over each
    serving host's devices, and a bf16 weight quantized on the way (gathers, quantize computes, fp8 moves)."""
    rows = Sharding(TRAIN, (("host", "gpu"), None))
    return plan_many([
        TensorDecl("big", (256, 256), "float32", rows, Sharding(SERVE, (None, None))),
        TensorDecl("rows", (256, 64), "float32", rows, Sharding(SERVE, ("gpu", None))),
        TensorDecl("w", (256, 256), "bfloat16", rows, Sharding(SERVE, ("gpu", None))),
        TensorDecl("w_s", (2, 2), "float32", None),
        *(TensorDecl(f"norm{i}", (16,), "float32", Sharding(TRAIN, (None,)), Sharding(SERVE, (None,)))
          for i in range(4)),
    ], Topology(nic_gbps=10.0), scales={"w": "w_s"}, dtypes={"w": "float8_e4m3fn"})


def test_a_hosts_slice_holds_the_steps_its_agent_runs_their_tensors_and_buckets():
    program = _quantizing()
    assert program.buckets and any(s.kind == "compute" for s in program.steps)
    cut = HostCut(program)
    buckets = bucket_moves(program)
    hosts = sorted({d.split("/")[0] for d in TRAIN.devices + SERVE.devices})
    assert sorted(cut.hosts) == hosts
    for host in hosts:
        data = json.loads(cut.text(host))
        # what the agent's task graph makes tasks of on this host, a bucket's members with their lead
        ran = set()
        for task in host_tasks(program, host, buckets):
            ran |= set(buckets[task.step.id].ids) if task.step.id in buckets else {task.step.id}
        part = read_slice(data)
        assert set(np.flatnonzero(part.steps.present).tolist()) == ran, host
        named = {t for i in ran for t in program.steps[i].named()}
        staged = {t.name for t in program.tensors if t.dst is not None and host in t.dst.mesh.hosts}
        assert {t.name for t in part.tensors} == named | staged
        assert all(program.tensor(t.name) == t for t in part.tensors)
        assert all(b[0] in ran and set(b) <= ran for b in part.buckets)
    # every bucket is in the slices of its hosts
    assert {b for h in hosts for b in read_slice(json.loads(cut.text(h))).buckets} == set(program.buckets)
