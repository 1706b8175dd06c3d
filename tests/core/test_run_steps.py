"""A state dict quantized on the way keeps its runs' steps unmade (`reshard.program.RunSteps`) until something asks
for them: a planner validates, hashes, prices and writes such a program by its templates, and making the 3.4
million steps of issue 41's 61-layer case was half of planning it. Made when asked for, they are the very steps a
program written out in full holds."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from reshard import Mesh, Sharding
from reshard.many import program_from_json
from reshard.plans import Transfer
from reshard.program import MOVE, Program, RunSteps, Step, TensorDecl
from tests.core.test_run_checks import _quantized


def test_a_planner_validates_hashes_prices_and_writes_a_quantized_program_without_making_its_runs():
    program = _quantized()
    steps = program.steps
    assert isinstance(steps, RunSteps)
    unmade = sum(s is None for s in steps.items)
    assert unmade > len(steps) / 2  # most steps are in runs, not made
    program.validate()
    ident, estimate, text = program.id, program.estimate_seconds, program.dumps()
    program.transfers_of(range(len(steps)))  # a move's transfer, read from its template's step
    assert sum(s is None for s in steps.items) == unmade
    # the same figures from the same steps made one by one (a tuple of them: no runs, every step read)
    whole = dataclasses.replace(program, steps=tuple(steps))
    assert sum(s is None for s in steps.items) == 0
    assert whole.__dict__.get("_runs") is None and whole.validate() is whole
    assert (whole.id, whole.estimate_seconds) == (ident, estimate)
    assert whole == program and hash(whole) == hash(program)
    # and the text reads back into the same steps
    assert program_from_json(text).steps == whole.steps


def test_run_steps_read_as_a_tuple_of_the_steps():
    program = _quantized()
    made = tuple(_quantized().steps)  # another plan of the same state dict, every step made
    steps = program.steps
    first, count = program.__dict__["_runs"][-1][:2]
    # one step of a run makes that run alone
    assert steps[first + 1] == made[first + 1]
    assert all(s is not None for s in steps.items[first:first + count])
    assert sum(s is None for s in steps.items) > 0
    assert steps[-1] == made[-1] and steps[-len(made)] == made[0]
    assert steps[first - 3:first + 2] == made[first - 3:first + 2] and isinstance(steps[0:2], tuple)
    assert steps[::-7] == made[::-7]
    with pytest.raises(IndexError):
        steps[len(made)]
    assert len(steps) == len(made) and list(steps) == list(made) and steps == made and made == steps
    assert [s.id for s in steps] == list(range(len(made)))


def test_threads_asking_for_one_run_get_the_same_steps():
    program = _quantized()
    steps = program.steps
    pending = [first for first, _, _, _ in program.__dict__["_runs"] if steps.items[first] is None]
    got: list[list[Step]] = [[], []]
    barrier = threading.Barrier(2)

    def read(k: int) -> None:
        barrier.wait()
        got[k] = [steps[i] for i in pending]

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a is b for a, b in zip(*got)) and len(got[0]) == len(pending)


def test_a_run_whose_template_is_itself_in_a_run_is_made_after_it():
    mesh = Mesh.grid({"x": 2}, 1, "m")
    t = Transfer(((0, 4),), mesh.devices[0], (mesh.devices[1],), "p2p")
    items = [Step.move(0, t, tensor="a"), Step.move(1, t, after=(0,), tensor="a"), None, None, None, None]
    # steps 2-3 repeat 0-1 as "b"; steps 4-5 repeat 2-3 (in a run, not made yet) as "c"
    runs = [(2, 2, 0, (("a", "b"),)), (4, 2, 2, (("b", "c"),))]
    steps = RunSteps(items, runs)
    assert steps[5].tensor == "c" and steps[5].after == (4,) and steps[5].id == 5
    assert [s.tensor for s in steps] == ["a", "a", "b", "b", "c", "c"]
    assert all(s.kind == MOVE and s.transfer is t for s in steps)
    assert isinstance(Program((), steps).steps, RunSteps)  # kept as it is, not made into a tuple
    # a program's columns follow such a run to the steps outside runs
    decls = tuple(TensorDecl(n, (4,), "float32", Sharding(mesh, (None,)), Sharding(mesh, (None,))) for n in "abc")
    program = Program(decls, RunSteps(items[:2] + [None] * 4, runs))._with_runs(runs)
    assert program._repeated.tolist() == [False, False, True, True, True, True]
    assert program._template_index.tolist() == [0, 1, 0, 1, 0, 1]
    assert program.depths == (0, 1, 0, 1, 0, 1) == Program(decls, tuple(steps)).depths
    assert program.transfers_of([5]) == [t] and program.moves()[2] == ["a", "a", "b", "b", "c", "c"]
