"""Validation checked as columns (`delivered`, `ManyProgram`'s buckets) names the same problems as step by step,
and proves a program whose transfers share no objects (one read back from its JSON) as one planned in memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from reshard.delivery import delivered, link_numbers
from reshard.errors import PlanValidationError
from reshard.many import ManyProgram, plan_many, program_from_json
from reshard.plans import METHODS, Transfer
from reshard.routes import HostCache

from tests.core.test_many import _state_dict


def _packed() -> ManyProgram:
    return plan_many(_state_dict(2), bucket_bytes=64 * 1024)


def test_a_program_read_back_from_its_json_is_proven_by_the_columns():
    program = _packed()
    again = program_from_json(program.dumps())
    assert again.id == program.id and again.buckets == program.buckets
    # Read back, no two transfers share a receivers tuple or a string: links are told apart by value.
    reshard = list(again.tensors)
    at = {t.name: k for k, t in enumerate(reshard)}
    moves = [s for s in again.steps if s.kind == "move"]
    ok = delivered(reshard, [at[s.tensor] for s in moves], [s.transfer for s in moves], METHODS, HostCache())
    assert ok.all()
    assert again.validate() is again


def test_link_numbers_are_equal_exactly_for_equal_paths():
    a = Transfer(((0, 1),), "h0/0", ("h1/0", "h1/1"), "broadcast", route=("h1",))
    same = Transfer(((1, 2),), "h0/" + "0", tuple(["h1/0", "h1/1"]), "broadcast", route=("h" + "1",))
    other = [replace(a, sender="h0/1"), replace(a, receivers=("h1/1", "h1/0")), replace(a, method="p2p"),
             replace(a, route=("h2",))]
    numbers = link_numbers([a, same, *other]).tolist()
    assert numbers[0] == numbers[1] and len(set(numbers[1:])) == 5


def test_a_bucketed_step_at_another_depth_than_its_bucket_is_refused_naming_the_rule():
    """A bucket waits for all its members wait for: one member waiting for a step the others do not wait for puts
    it a depth deeper, where it could wait for another member, so the bucket is refused."""
    program = _packed()
    group = next(b for b in program.buckets if b[0] > 0)
    i = group[1]
    steps = list(program.steps)
    steps[i] = replace(steps[i], after=(0,))
    changed = replace(program, steps=tuple(steps))
    with pytest.raises(PlanValidationError, match=rf"bucket {program.buckets.index(group)} \(steps .*\): step #{i} "
                       rf".* is at dependency depth 1, but step #{group[0]} .* at 0; a bucket waits for everything "
                       rf"its members wait for, so its members share a depth"):
        changed.validate()


def test_a_bucket_whose_members_all_wait_at_one_depth_is_proven():
    program = _packed()
    group = next(b for b in program.buckets if b[0] > 0)
    steps = list(program.steps)
    for i in group:
        steps[i] = replace(steps[i], after=(0,))
    changed = replace(program, steps=tuple(steps))
    assert changed.validate() is changed and {changed.depths[i] for i in group} == {1}


def test_a_bucket_naming_a_step_outside_the_program_is_refused_naming_the_rule():
    program = _packed()
    group = program.buckets[0]
    n = len(program.steps)
    for outside in (n, -1):
        with pytest.raises(PlanValidationError, match=rf"step {outside} is not a step of this program \(ids "
                           rf"0..{n - 1}\)"):
            replace(program, buckets=((group[0], outside),)).validate()
