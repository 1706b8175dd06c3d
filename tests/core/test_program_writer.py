"""`Program.id` and `Program.dumps` write a state dict's moves a chunk at a time, not a step at a time, and steps
holding values that chunked writing leaves to the per-step writer still come out as ``json.dumps`` writes them.

Issue 41: the text and id of a Kimi-like program cost more than a second each while the interpreter ran once per
move; `reshard.program._StepWriter` writes a chunk of moves column by column in C and runs Python code only for
values first seen. `tests/core/test_program_text.py` pins the bytes on every kind of program.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from reshard import Mesh, Topology
from reshard.many import plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.plans import Transfer, content_id
from reshard.program import (_FORM_REPEATS, _STEPS_PER_CHUNK, DST, Program, Step, TensorDecl, TileRef,
                             _json_text_chunks, _run_step_chunks, _step_chunks, decl_with)
from tests.core.test_many import _state_dict


def _python_calls(work) -> int:
    """How many Python functions ``work()`` calls (C functions are not counted)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def _assert_as_json_dumps(program: Program) -> None:
    """The text `dumps` writes before its estimate (which odd values here would not survive) and the id."""
    for canonical, want in ((True, json.dumps(program._canonical(), sort_keys=True, separators=(",", ":"))),
                            (False, json.dumps(program._canonical()))):
        assert "".join(_json_text_chunks(program._json_fields(canonical), canonical)) == want
    assert dataclasses.replace(program).id == content_id(program._canonical())


def test_a_moe_programs_moves_cost_python_calls_per_chunk_and_value_not_per_step():
    train, serve = Mesh.grid({"host": 8, "gpu": 4}, 4, "t"), Mesh.grid({"host": 4, "gpu": 4}, 4, "s")
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    # send/recv: a step per receiver, steps that repeat their values (auto sends this case's small boxes as chains,
    # a few steps of many values each)
    program = plan_many(case.tensors, Topology.gpu_hosts(nics=4), scales=case.scales, strategy="send_recv")
    steps = len(list(program.steps))  # every run's steps made (`RunSteps`): the writer's calls alone are counted
    assert steps > _STEPS_PER_CHUNK
    for canonical in (True, False):
        fields = program._json_fields(canonical)
        calls = _python_calls(lambda: "".join(_json_text_chunks(fields, canonical)))
        # Python runs per value first seen (about 0.5 calls a step here, where values are few per step); before
        # issue 41's second pass, about 3.4 a step.
        assert calls < steps, (canonical, calls, steps)
    _assert_as_json_dumps(program)
    # (a copy: plan_many's own writes its compact text, tests/core/test_compact_text.py)
    assert dataclasses.replace(program).dumps() == json.dumps(program.to_json())


def test_values_written_one_step_at_a_time_come_out_as_json_dumps_writes_them_amid_chunked_moves():
    tensors = (TensorDecl("w", (8, 8), "float32"),)

    class Name(str):
        pass

    # True == 1 and (False, True) == (0, 1), but not in JSON: a cache by value must not take one for the other.
    odd = [
        Transfer(((False, True), (0, 8)), "a/0", ("b/0",), "p2p"),
        Transfer(((0, 1), (0, 8)), "a/0", ["b/0"], "p2p"),
        Transfer(((0, 1), (0, 8)), Name("a/0"), (Name("b/0"),), "broadcast", route=(Name("b"),)),
        Transfer(([0, 1], (0, 8)), "a/0", ("b/0", "b/1"), "broadcast", route=("b",)),
        Transfer(((0, 1), (0, 8)), "a/\u00e9", ("b/\"0\"",), "p2p"),
    ]
    plain = Transfer(((0, 1), (0, 8)), "a/0", ("b/0",), "p2p")
    steps = []
    for i in range(3 * _STEPS_PER_CHUNK):
        if i % 997 < len(odd):
            steps.append(Step.move(i, odd[i % 997], tensor="w"))
        elif i % 1999 == 0:
            steps.append(Step.move(i, plain, after=(i - 1, i - 2), tensor="w", role=DST))
        else:
            steps.append(Step.move(i, plain, tensor=Name("w") if i % 2 else "w"))
    steps.append(Step.move(len(steps), plain, after=(3,), tensor="w"))
    _assert_as_json_dumps(Program(tensors, tuple(steps)))
    # Chunks of moves alone, with a box of bools and the same box in ints, each seen first.
    for first, second in ((plain, odd[0]), (odd[0], plain)):
        chunk = [Step.move(i, second if i % 2 else first, tensor="w") for i in range(2 * _STEPS_PER_CHUNK)]
        _assert_as_json_dumps(Program(tensors, tuple(chunk)))


def test_compute_steps_are_written_from_remembered_pieces_as_json_dumps_writes_them():
    # a small MoE quantized on the way: compute steps (fp8 scales and quantize, copies) amid moves
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    program = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)
    assert {s.kind for s in program.steps} == {"move", "compute"}
    _assert_as_json_dumps(program)
    steps = len(program.steps)
    for canonical in (True, False):
        calls = _python_calls(lambda: "".join(_step_chunks(program.steps, canonical)))
        # about 9 a step (a compute: its refs, names and after, each text made once per object); through the
        # encoder and to_json, about 16
        assert calls < 11 * steps, (canonical, calls, steps)
    # odd values: names that are str subclasses, a box of bools beside the same box in ints, params
    w = TensorDecl("w", (4, 4), "float32")

    class Name(str):
        pass

    one, true = {"k": 1}, {"k": True}
    odd = [Step.compute(0, "copy", "a/0", [TileRef("w", "src", ((0, 4), (0, 4)))],
                        TileRef("w", "dst", ((0, 4), (0, 4))), params=one),
           Step.compute(1, Name("copy"), Name("a/0"), [TileRef(Name("w"), "src", ((0, 2), (0, 4)))],
                        TileRef("w", "dst", ((0, 2), (0, 4))), after=[0], params=true),
           Step.compute(2, "copy", "a/0", [TileRef("w", "src", ((False, True), (0, 4)))],
                        TileRef("w", "dst", ((0, 1), (0, 4))), params=one)]
    made = Program((w,), tuple(odd))
    _assert_as_json_dumps(made)


def test_a_programs_runs_are_written_into_its_id_from_their_templates_texts():
    """`Program.id` writes a run's steps from its template's text with the ids, afters and names filled in
    (`reshard.program._RunText`): the same text as every step written out, so the same id as the program without
    its runs."""
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    quantized = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)
    # the same with names that a format string or JSON would take for their own: braces, quotes, a backslash,
    # non-ASCII

    def renamed(name: str) -> str:
        return name.replace("layers.", 'la{0}"y\\e{x}rs\u00e9.')

    odd = plan_many([decl_with(t, name=renamed(t.name)) for t in case.tensors],
                    scales={renamed(w): renamed(s) for w, s in case.scales.items()},
                    dtypes={renamed(k): v for k, v in case.serve_dtypes.items()})
    # and runs of moves alone, repeated often enough to be written from a form (`_FORM_REPEATS`)
    layers = plan_many(_state_dict(num_layers=2 + _FORM_REPEATS))
    for program in (quantized, odd, layers):
        assert program._repeated is not None and program._repeated.any()
        assert "".join(_run_step_chunks(program.steps, program._ordered_runs())) == \
            "".join(_step_chunks(program.steps, canonical=True))
        assert program.id == dataclasses.replace(program).id == content_id(program._canonical())
