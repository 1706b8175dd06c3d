"""Pipeline schedules: hand-written orders for small cases, the invariants every schedule keeps, and the
simulated step times of issue 14's must-show 2."""

from __future__ import annotations

import itertools
import json

import pytest

from reshard import schedule
from reshard.errors import InvalidScheduleError


def _ops(text: str) -> list[tuple[str, int]]:
    return [(tok[0], int(tok[1:])) for tok in text.split()]


# (kind, stages, microbatches): one line per stage, written from the rule by hand.
TABLES = {
    ("gpipe", 2, 3): ["F0 F1 F2 B0 B1 B2",
                      "F0 F1 F2 B0 B1 B2"],
    ("1f1b", 4, 1): ["F0 B0"] * 4,
    ("1f1b", 2, 4): ["F0 F1 B0 F2 B1 F3 B2 B3",
                     "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("1f1b", 3, 5): ["F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
                     "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
                     "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"],
    # m = 2 is below stage 0's warm-up of 3: it runs both forwards, then both backwards.
    ("1f1b", 3, 2): ["F0 F1 B0 B1",
                     "F0 F1 B0 B1",
                     "F0 B0 F1 B1"],
    ("eager-1f1b", 2, 4): ["F0 F1 F2 B0 F3 B1 B2 B3",
                           "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("eager-1f1b", 3, 2): ["F0 F1 B0 B1",
                           "F0 F1 B0 B1",
                           "F0 B0 F1 B1"],
    ("eager-1f1b", 3, 6): ["F0 F1 F2 F3 F4 B0 F5 B1 B2 B3 B4 B5",
                           "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
                           "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"],
    # The columns of the tick table in cross-mesh-resharding-alpa.md section 7 (n = 4, m = 8).
    ("eager-1f1b", 4, 8): ["F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7",
                           "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 B4 B5 B6 B7",
                           "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                           "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"],
    ("eager-1f1b", 4, 3): ["F0 F1 F2 B0 B1 B2",
                           "F0 F1 F2 B0 B1 B2",
                           "F0 F1 F2 B0 B1 B2",
                           "F0 B0 F1 B1 F2 B2"],
}


@pytest.mark.parametrize("case", sorted(TABLES), ids=lambda c: f"{c[0]}-n{c[1]}-m{c[2]}")
def test_build_matches_the_hand_written_order(case):
    assert schedule.build(*case) == [_ops(line) for line in TABLES[case]]


@pytest.mark.parametrize("kind", schedule.KINDS)
def test_every_schedule_runs_each_op_once_forward_first_and_finishes(kind):
    for n, m in itertools.product(range(1, 7), range(1, 11)):
        built = schedule.build(kind, n, m)
        assert len(built) == n
        for i, ops in enumerate(built):
            assert sorted(ops) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)]), (n, m, i)
            assert [k for op, k in ops if op == "F"] == list(range(m))
            assert [k for op, k in ops if op == "B"] == list(range(m))
            assert all(ops.index(("F", k)) < ops.index(("B", k)) for k in range(m))
            assert ops.index(("B", 0)) == schedule.warmup(kind, n, m, i)
        # A stage that waited forever would trip simulate's deadlock check.
        sim = schedule.simulate(kind, n, m, 1.0, 2.0, 0.5)
        assert sim.peak_activations == tuple(schedule.warmup(kind, n, m, i) for i in range(n))
        assert len(sim.spans) == 2 * n * m + 2 * (n - 1) * m


def test_simulate_by_hand_two_stages():
    # 1F1B, n=2, m=2, forward 1, backward 2, transfer 1 (times in units):
    # stage 0: F0 0-1, F1 1-2;  sends F0 1-2, F1 2-3
    # stage 1: F0 2-3, B0 3-5 (its own loss), F1 5-6, B1 6-8;  sends B0 5-6, B1 8-9
    # stage 0: B0 6-8, B1 9-11
    sim = schedule.simulate("1f1b", 2, 2, 1, 2, 1)
    assert sim.iteration_s == 11
    got = {(s.stage, s.op, s.microbatch): (s.start_s, s.end_s) for s in sim.spans}
    assert got == {
        (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "send F", 0): (1, 2), (0, "send F", 1): (2, 3),
        (1, "F", 0): (2, 3), (1, "B", 0): (3, 5), (1, "F", 1): (5, 6), (1, "B", 1): (6, 8),
        (1, "send B", 0): (5, 6), (1, "send B", 1): (8, 9),
        (0, "B", 0): (6, 8), (0, "B", 1): (9, 11),
    }


def test_a_boundary_carries_one_transfer_at_a_time_each_way():
    # GPipe, n=2, m=3, forward 1, backward 1, transfer 2: the activations queue on the boundary
    # (sent 1-3, 3-5, 5-7), so stage 1 runs F at 3, 5, 7 and B 8-11; the gradients queue too
    # (9-11, 11-13, 13-15) and stage 0's last backward ends at 16, not at 12 as unlimited links would give.
    sim = schedule.simulate("gpipe", 2, 3, 1, 1, 2)
    assert sim.iteration_s == 16
    sends = sorted((s.op, s.start_s, s.end_s) for s in sim.spans if s.op.startswith("send"))
    assert sends == [("send B", 9, 11), ("send B", 11, 13), ("send B", 13, 15),
                     ("send F", 1, 3), ("send F", 3, 5), ("send F", 5, 7)]


def test_eager_gain_over_1f1b_rises_with_the_transfer_time():
    """Must-show 2: n = 4, m = 16, backward = 2 x forward."""
    gains = []
    for transfer, expected in [(0.5, 1.2), (1.0, 1.35), (2.0, 1.5)]:
        one = schedule.simulate("1f1b", 4, 16, 1.0, 2.0, transfer)
        eager = schedule.simulate("eager-1f1b", 4, 16, 1.0, 2.0, transfer)
        gains.append(one.iteration_s / eager.iteration_s)
        assert gains[-1] == pytest.approx(expected, rel=0.03), (transfer, one, eager)
        assert one.peak_activations[0] == 4
        assert eager.peak_activations[0] == 7
    assert gains == sorted(gains) and len(set(gains)) == 3
    # Without transfers the two orders take the same time: 3 units per microbatch plus the fill and drain.
    assert (schedule.simulate("1f1b", 4, 16, 1, 2, 0).iteration_s
            == schedule.simulate("eager-1f1b", 4, 16, 1, 2, 0).iteration_s == 16 * 3 + 3 * 3)


def test_per_stage_and_per_boundary_times():
    sim = schedule.simulate("1f1b", 3, 1, [1, 2, 3], [1, 1, 1], [0.5, 0.25])
    # F: 0-1, send 1-1.5, 1.5-3.5, send 3.5-3.75, 3.75-6.75; B: 6.75-7.75, send -8, 8-9, send -9.5, 9.5-10.5
    assert sim.iteration_s == 10.5


@pytest.mark.parametrize("args, message", [
    (("zb-h1", 4, 8), "schedule kind 'zb-h1' is not known; choose one of gpipe, 1f1b, eager-1f1b"),
    (("1f1b", 0, 8), "stages is 0; a pipeline needs a positive integer number of stages"),
    (("1f1b", 4, True), "microbatches is True; a pipeline needs a positive integer number of microbatches"),
    (("gpipe", 4, 2.0), "microbatches is 2.0; a pipeline needs"),
])
def test_build_refuses_bad_arguments(args, message):
    with pytest.raises(InvalidScheduleError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        schedule.build(*args)
    assert issubclass(InvalidScheduleError, ValueError)


@pytest.mark.parametrize("times, message", [
    ((1, 2, [1, 2]), r"transfer_s has 2 values; give one number or one per boundary \(3\)"),
    ((1, [2, 2], 0), r"backward_s has 2 values; give one number or one per stage \(4\)"),
    ((-1, 2, 0), "forward_s has -1; times are finite numbers of seconds, zero or more"),
    ((1, float("nan"), 0), "backward_s has nan; times are finite"),
    ((1, 2, "1"), "transfer_s has '1'; times are finite"),
])
def test_simulate_refuses_bad_times(times, message):
    with pytest.raises(InvalidScheduleError, match=message):
        schedule.simulate("1f1b", 4, 8, *times)


def test_simulation_prints_a_summary():
    sim = schedule.simulate("eager-1f1b", 4, 16, 1.0, 2.0, 1.0)
    assert str(sim) == "eager-1f1b n=4 m=16: 63 s per step, peak activations per stage (7, 5, 3, 1)"


def test_a_timeline_round_trips_through_json_and_refuses_a_bad_span():
    sim = schedule.simulate("eager-1f1b", 3, 4, 1.0, 2.0, 0.5)
    assert schedule.Timeline.from_json(json.loads(json.dumps(sim.to_json()))) == sim
    assert sim.seconds(0, "F") == 4.0 and sim.seconds(2, "B") == 8.0
    bad = sim.to_json() | {"spans": [[3, "F", 0, 0.0, 1.0]]}
    with pytest.raises(InvalidScheduleError,
                       match=r"timeline span 0 is \[3, 'F', 0, 0.0, 1.0\]; it needs 0 <= stage < 3"):
        schedule.Timeline.from_json(bad)
    with pytest.raises(InvalidScheduleError, match="timeline lacks the field 'kind'"):
        schedule.Timeline.from_json({})


def test_median_times_read_back_what_simulate_was_given():
    sim = schedule.simulate("eager-1f1b", 3, 5, [1.0, 1.5, 2.0], [2.0, 3.0, 4.0], [0.5, 0.75])
    assert schedule.median_times(sim) == ((1.0, 1.5, 2.0), (2.0, 3.0, 4.0), (0.5, 0.75))
    one = schedule.simulate("1f1b", 1, 2, 1.0, 2.0, [])
    with pytest.raises(InvalidScheduleError, match="the timeline has no backward on stage 0 to take a time from"):
        schedule.median_times(schedule.Timeline("1f1b", 1, 2, 1.0, (1,), one.spans[:1]))
