"""A program's runs (`reshard.program.Run`) let `Program.validate` check a template's steps once for every run that
repeats it (`Program._repeated`): issue 41's 61-layer state dict quantized on the way holds 3.4 million steps, most
of them runs of a few hundred templates. Where a run's tensors are declared otherwise than its template's, or a
step outside the runs waits for one inside, every step is checked, as without runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reshard import Mesh, Sharding
from reshard.errors import PlanValidationError
from reshard.many import plan_many, program_from_json
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.program import COMPUTE, Program, Step, TensorDecl, TileRef


def _quantized():
    train = Mesh.grid({"host": 2, "gpu": 4}, 4, "train")
    serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "serve", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    return plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)


def test_a_quantized_state_dicts_runs_are_checked_by_their_templates_and_pass_as_every_step_does():
    program = _quantized()
    repeated = program._repeated
    assert repeated is not None and repeated.mean() > 0.5  # most steps repeat a template
    assert program.validate() is program
    # the same program without its runs: every step checked, the same verdict; and the columns a run copies from
    # its template (kinds, tensors renamed, roles, depths, link ids) are what each step says
    plain = dataclasses.replace(program)
    assert plain.__dict__.get("_runs") is None and plain._repeated is None
    plain.validate()
    assert plain._columns == program._columns and plain.depths == program.depths
    assert (plain._link_ids == program._link_ids).all() and (plain._src_moves == program._src_moves).all()
    # the estimate, which times a run's steps by its template's
    assert plain.estimate_seconds == program.estimate_seconds == max(e.finish for e in program.step_estimates())
    # and read back from its compact text, the runs come with it
    back = program_from_json(program.dumps())
    assert back._repeated is not None and (back._repeated == repeated).all()
    back.validate()


def _compact(program) -> dict:
    data = json.loads(program.dumps())
    assert any("like" in e for e in data["steps"])
    return data


def test_a_bad_template_step_is_found_though_the_runs_that_repeat_it_are_not_checked():
    data = _compact(_quantized())
    templates = {(e["like"], e["count"]) for e in data["steps"] if "like" in e}
    # a compute step of a template that runs repeat (steps before the first run keep their ids): its output box
    # made one row too tall
    at = next(i for i, e in enumerate(data["steps"]) if "like" not in e and e["kind"] == COMPUTE
              and any(like <= i < like + count for like, count in templates))
    step = data["steps"][at]
    box = [list(b) for b in step["output"]["box"]]
    box[0][1] += 1
    bad = {**data, "steps": [*data["steps"][:at], {**step, "output": {**step["output"], "box": box}},
                             *data["steps"][at + 1:]]}
    program = program_from_json(bad, check_id=False)
    assert program._repeated is not None
    with pytest.raises(PlanValidationError, match=f"step #{at} .* makes a tile of shape"):
        program.validate()


def test_a_run_renaming_to_a_tensor_declared_otherwise_is_checked_step_by_step():
    data = _compact(_quantized())
    run = next(e for e in data["steps"] if "like" in e)
    target = run["rename"][0][1]
    was = data["tensors"][target]["layout"]
    shape = data["layouts"][was]["shape"]
    other = next(k for k, lay in enumerate(data["layouts"]) if lay["shape"] != shape)
    tensors = [*data["tensors"][:target], {**data["tensors"][target], "layout": other}, *data["tensors"][target + 1:]]
    program = program_from_json({**data, "tensors": tensors}, check_id=False)
    assert program._repeated is None  # the shortcut does not apply: every step is checked, and a run's is wrong
    with pytest.raises(PlanValidationError, match="is not a box of tensor"):
        program.validate()


def test_a_step_outside_the_runs_that_waits_for_a_step_in_one_turns_the_shortcut_off():
    mesh = Mesh.from_hosts({"x": 2}, ["a", "b"], 1)
    src, dst = Sharding(mesh, ("x",)), Sharding(mesh, (None,))
    program = plan_many([TensorDecl("u", (8,), "float32", src, dst), TensorDecl("v", (8,), "float32", src, dst)])
    runs = program.__dict__["_runs"]
    assert program._repeated is not None
    # the same steps, and a copy on device a that waits for v's moves (a run's): what the run writes is read
    last = program.steps[-1]
    extra = Step.compute(len(program.steps), "copy", "a0", [TileRef("v", "dst", ((0, 8),))],
                         TileRef("w", "dst", ((0, 8),)), after=[last.id])
    w = TensorDecl("w", (8,), "float32", None, Sharding(mesh, (None,)))
    made = Program((*program.tensors, w), (*program.steps, extra), program.strategy, program.topology)._with_runs(runs)
    assert made._repeated is None


def test_runs_noted_after_columns_were_worked_out_are_read_by_them():
    program = _quantized()
    plain = dataclasses.replace(program)
    assert plain._repeated is None and plain._columns == program._columns  # worked out without runs
    plain._with_runs(program.__dict__["_runs"])
    assert plain._repeated is not None and (plain._repeated == program._repeated).all()
    assert plain.dumps() == program.dumps()  # the compact text, no longer the one written step by step
