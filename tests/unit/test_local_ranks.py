"""The order an active transport's agent makes its tiles in (`reshard.server.agent.task_graph.local_ranks`): each
task that calls no peer ranks at the place, in the lanes' order, of the first unit that waits for it, directly or
through other local tasks, the units of large routes in the lanes' order before those of small routes, so on a
quantized MoE state dict the tiles the first streams carry are quantized first, the block scales only the small
routes carry after every tile a large route carries, and the tiles no stream carries come last. Checked against a
walk written the other way round: for each unit, every local task it waits for, then the least place among them."""

from __future__ import annotations

from reshard import Mesh
from reshard.many import plan_many
from reshard.moe import SMALL_MOE, MoeConfig, moe_state_dict
from reshard.server.agent.programs import HostLayout


def _quantized_program():
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    return plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)


def _order(layout: HostLayout) -> list[list[int]]:
    """The units, large routes' in the lanes' order, then small routes' in theirs."""
    units = [unit for _, _, depth_units in layout.depths for small, unit in depth_units if not small]
    return units + [unit for _, _, depth_units in layout.depths for small, unit in depth_units if small]


def _expected_ranks(layout: HostLayout, units: list[list[int]] | None = None) -> list[int]:
    """Each task's rank by brute force: per unit in `_order` (or ``units``), the local tasks it waits for (their
    closure)."""
    tasks = layout.tasks
    by_step: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        by_step.setdefault(t.step.id, []).append(i)
    units = _order(layout) if units is None else units
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
        order = _order(layout)
        for t in quantized:
            waiting = [p for p, unit in enumerate(order) if any(t.step.id in layout.tasks[i].deps for i in unit)]
            assert waiting and t.rank <= min(waiting)
        # a local task nothing waits for (a tile that stays on this host) ranks after every unit
        ends = [t for t in layout.tasks if t.local and not any(t.step.id in o.deps for o in layout.tasks)]
        assert all(t.rank == units for t in ends)
    assert checked >= 2  # both training hosts quantize


def test_a_tile_a_large_route_carries_is_not_quantized_after_every_block_scale():
    """Tiles of a megabyte and more (hidden 1024): the experts travel on large routes, their block scales (a depth
    earlier, after their fp8_scales steps) on small ones. Ranked in the lanes' order alone, most block scales of a
    host came before its first quantize, and the links waited for them."""
    config = MoeConfig(num_layers=2, num_experts=8, hidden=1024, intermediate=1024, dense_intermediate=2048,
                       vocab=1024, num_heads=16, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
                       qk_rope_head_dim=64, v_head_dim=64)
    train, serve = Mesh.grid({"host": 2, "gpu": 2}, 2, "t"), Mesh.grid({"host": 2, "gpu": 2}, 2, "s", first_host=2)
    case = moe_state_dict(config, train, serve, ep_devices=2)
    program = plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)
    checked = 0
    for host in sorted(program.hosts()):
        layout = HostLayout(program, host)
        computes = [t for t in layout.tasks if t.step.kind == "compute"]
        if not computes:
            continue
        checked += 1
        assert [t.rank for t in layout.tasks] == _expected_ranks(layout), host
        # fewer block scales are made before the first quantized tile than the lanes' order alone would make
        lanes = _expected_ranks(layout, [unit for _, _, d in layout.depths for _, unit in d])
        early = []
        for ranks in ([t.rank for t in layout.tasks], lanes):
            first = min(r for t, r in zip(layout.tasks, ranks) if t.step.kernel == "fp8_quantize_scaled")
            early.append(sum(r <= first for t, r in zip(layout.tasks, ranks) if t.step.kernel == "fp8_scales"))
        assert 0 < early[0] < early[1], host
    assert checked >= 2
