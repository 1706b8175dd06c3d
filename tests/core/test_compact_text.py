"""The compact text of a state dict's program (`reshard.program.Run`): `plan_many` notes which tensors' steps are
another's of their layout renamed, `Program.dumps` writes those as runs and each tensor by its layout, and
`program_from_json` reads the same program back, id for id. Issue 41: the 61-layer Kimi-K2-like program is 919 MiB
written step by step, more than an agent takes in one message (64 MiB); written so, 53.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from reshard import Mesh, Sharding
from reshard.errors import PlanValidationError
from reshard.many import ManyProgram, plan_many, program_from_json
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.program import MOVE, Program, TensorDecl
from tests.core.test_many import _state_dict


def _round_trip(program: Program) -> dict:
    """Read ``program``'s text back; the same program, id for id; the text as JSON."""
    text = program.dumps()
    back = program_from_json(text)
    assert type(back) is type(program)
    assert back.tensors == program.tensors and back.steps == program.steps
    assert getattr(back, "buckets", ()) == getattr(program, "buckets", ())
    assert back.id == program.id  # the canonical text: every step written out
    assert back.validate() is back
    return json.loads(text)


def test_a_state_dicts_layers_are_written_as_runs_of_the_first_layers_steps():
    program = plan_many(_state_dict(num_layers=6))
    data = _round_trip(program)
    runs = [e for e in data["steps"] if "like" in e]
    # each layer but the first repeats the first's five tensors' steps, renamed; each tensor names its layout
    names = [t["name"] for t in data["tensors"]]
    assert len(runs) == 5 * 5
    for e in runs:
        (a, b), = e["rename"]
        assert names[a].startswith("layers.0.") and names[a].split(".")[-1] == names[b].split(".")[-1]
    assert len(data["layouts"]) == 6 and all(set(t) == {"name", "layout"} for t in data["tensors"])
    written = sum(1 for e in data["steps"] if "like" not in e) + sum(e["count"] for e in runs)
    assert written == len(program.steps)
    whole = json.dumps(program.to_json())
    assert len(program.dumps()) < len(whole) / 3
    # a copy made otherwise (no runs noted) writes every step, and reads back the same program
    plain = dataclasses.replace(program)
    assert plain.dumps() == whole and program_from_json(whole) == program


def test_a_quantized_moe_state_dicts_runs_rename_the_weight_its_scale_and_the_weight_as_held():
    train = Mesh.grid({"host": 2, "gpu": 4}, 4, "train")
    serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "serve", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    program = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes).validate()
    data = _round_trip(program)
    renames = [e["rename"] for e in data["steps"] if "like" in e]
    assert any(len(r) == 3 for r in renames)  # fp8 weight, its scale, and the bf16 weight as held
    assert any(s["kind"] != MOVE for s in data["steps"] if "like" not in s)  # the first of a layout: its computes


def test_runs_that_name_what_is_not_there_are_refused_naming_the_entry():
    data = json.loads(plan_many(_state_dict(num_layers=2)).dumps())
    at = next(i for i, e in enumerate(data["steps"]) if "like" in e)
    run = data["steps"][at]
    for change, message in (({"like": at + 5}, "not all steps written before it"),
                            ({"count": 0}, "not all steps written before it"),
                            ({"rename": [[0, len(data["tensors"])]]}, "rename is a list of .tensor, tensor. pairs"),
                            ({"rename": {"layers.0.qkv": "x"}}, "field 'rename' must be a JSON array")):
        bad = {**data, "steps": [*data["steps"][:at], {**run, **change}, *data["steps"][at + 1:]]}
        with pytest.raises(PlanValidationError, match=f"steps entry {at} .*{message}"):
            program_from_json(bad, check_id=False)
    bad = {**data, "tensors": [{**data["tensors"][0], "layout": len(data["layouts"])}, *data["tensors"][1:]]}
    with pytest.raises(PlanValidationError, match="tensor 0 names layout .* the program lists"):
        program_from_json(bad, check_id=False)


def test_a_run_whose_steps_wait_outside_it_is_refused():
    mesh = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)
    src, dst = Sharding(mesh, ("x",)), Sharding(mesh, (None,))
    program = plan_many([TensorDecl("u", (8,), "float32", src, dst), TensorDecl("v", (8,), "float32", src, dst)])
    data = json.loads(program.dumps())
    assert [e for e in data["steps"] if "like" in e] == [{"like": 0, "count": 2, "rename": [[0, 1]]}]
    # a run of step 1 alone, which waits for step 0: its copy would wait for the wrong step
    steps = [data["steps"][0], {**data["steps"][1], "after": [0]}, {"like": 1, "count": 1, "rename": [[0, 1]]}]
    with pytest.raises(PlanValidationError, match="waits for step 0, outside the run"):
        ManyProgram.from_json({**data, "steps": steps, "buckets": []}, check_id=False)
