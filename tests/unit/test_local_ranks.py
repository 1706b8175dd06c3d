"""The order an active transport's agent makes its tiles in (`reshard.server.agent.task_graph.local_ranks`): each
task that calls no peer ranks at the place, in the lanes' order, of the first unit that waits for it, directly or
through other local tasks, so on a quantized MoE state dict the tiles the first streams carry are quantized first,
and the tiles no stream carries come last. Checked against a walk written the other way round: for each unit, every
local task it waits for, then the least place among them."""

from __future__ import annotations

from reshard import Mesh
from reshard.many import plan_many
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.server.agent.programs import HostLayout


def _quantized_program():
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    return plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)


def _expected_ranks(layout: HostLayout) -> list[int]:
    """Each task's rank by brute force: per unit in the lanes' order, the local tasks it waits for (their closure)."""
    tasks = layout.tasks
    by_step: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        by_step.setdefault(t.step.id, []).append(i)
    units = [unit for _, _, depth_units in layout.depths for _, unit in depth_units]
    ranks = [len(units) if t.local else 0 for t in tasks]
    for place in reversed(range(len(units))):  # later units first: an earlier one overwrites
        seen: set[int] = set()
        frontier = [a for i in units[place] for a in tasks[i].deps]
        while frontier:
            for i in by_step.get(frontier.pop(), []):
                if tasks[i].local and i not in seen:
                    seen.add(i)
                    frontier.extend(tasks[i].deps)
        for i in seen:
            ranks[i] = place
    return ranks


def test_a_senders_quantize_steps_rank_by_the_first_stream_that_carries_their_tiles():
    program = _quantized_program()
    hosts = sorted(program.hosts())
    checked = 0
    for host in hosts:
        layout = HostLayout(program, host)
        ranks = [t.rank for t in layout.tasks]
        assert ranks == _expected_ranks(layout), host
        computes = [t for t in layout.tasks if t.step.kind == "compute"]
        assert all(t.local for t in computes)
        if not computes:
            continue  # a serving host: it only receives
        checked += 1
        units = sum(len(u) for _, _, u in layout.depths)
        quantized = [t for t in computes if t.step.kernel == "fp8_quantize_scaled"]
        # the quantize steps spread over the lanes' order (not all at once after every scale, as readiness would
        # have them), and each ranks no later than the stream that carries its tile
        assert len({t.rank for t in quantized}) > 1 and min(t.rank for t in quantized) < units
        for t in quantized:
            waiting = [p for p, (_, unit) in enumerate(u for _, _, d in layout.depths for u in d)
                       if any(t.step.id in layout.tasks[i].deps for i in unit)]
            assert waiting and t.rank <= min(waiting)
        # a local task nothing waits for (a tile that stays on this host) ranks after every unit
        ends = [t for t in layout.tasks if t.local and not any(t.step.id in o.deps for o in layout.tasks)]
        assert all(t.rank == units for t in ends)
    assert checked >= 2  # both training hosts quantize
