"""An agent builds only the buckets its host sends, receives or forwards (`bucket_moves(program, host)`): a
state dict's program packs a million moves, and building every host's buckets was half of an agent's
`HostLayout` of the Kimi-K2-like program (issue 41: an agent never parses another host's steps). Its tasks, in
their order, are the ones it derives knowing every bucket; its stream numbers come from a column (a run's counts
are its template's) and its steps' dtypes are worked out when asked for."""

from __future__ import annotations

import math

from reshard import Mesh
from reshard.cost import sender_bytes
from reshard.many import plan_many
from reshard.mesh import host_of
from reshard.moe import SMALL_MOE, moe_state_dict
from reshard.proto.layout import np_dtype
from reshard.routes import stream_count
from reshard.server.agent.buckets import BYTES, bucket_moves
from reshard.server.agent.programs import HostLayout
from reshard.server.agent.staging import staged_bytes, tile_plan
from reshard.server.agent.task_graph import host_tasks
from tests.core.test_many import _state_dict


def _programs():
    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    yield plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes)
    yield plan_many(_state_dict(num_layers=4))


def _hosts(program) -> set[str]:
    return {host_of(d) for t in program.tensors for s in (t.src, t.dst) if s is not None
            for d in s.mesh.require_devices()}


def _described(tasks):
    return [(t.step.id, t.role, t.depth, t.hop, t.peer, t.deps, t.step.transfer if t.step.kind == "move" else None)
            for t in tasks]


def test_a_hosts_buckets_are_those_it_takes_part_in_and_its_tasks_are_as_with_every_bucket():
    for program in _programs():
        every = bucket_moves(program)
        assert len(every) == len(program.buckets) > 0
        fewer = 0
        for host in sorted(_hosts(program)):
            mine = bucket_moves(program, host)
            assert set(mine) <= set(every)
            fewer += len(mine) < len(every)
            tasks = host_tasks(program, host)
            assert _described(tasks) == _described(host_tasks(program, host, every))
            # every bucket among its tasks is one it built, and the layout's streams and dtypes are every host's
            assert {t.step.id for t in tasks if t.step.id in every} <= set(mine)
            layout = HostLayout(program, host)
            assert set(layout.buckets) == set(mine)
            assert all(layout.dtypes[g[0]] == BYTES for g in program.buckets)
        assert fewer  # some host takes part in fewer than all


def test_a_layouts_stream_numbers_and_dtypes_are_those_worked_out_step_by_step():
    # over every step (a run's stream counts copied from its template's), and dtypes worked out when asked
    for program in _programs():
        leads = {g[0] for g in program.buckets}
        layout = HostLayout(program, sorted(_hosts(program))[0])
        n = 0
        for s in program.steps:
            assert layout.streams[s.id] == layout.streams.get(s.id) == n
            n += stream_count(s.kind, s.transfer, len(s.devices))
            name = BYTES if s.id in leads else program.tensor(
                s.tensor if s.kind == "move" else (s.inputs or (s.output,))[0].tensor).dtype
            assert layout.dtypes[s.id] == name and layout.dtype_pairs[s.id] == (name, np_dtype(name))
        assert layout.num_streams == n and layout.streams.get(len(program.steps), 7) == 7


def test_a_layouts_bytes_tiles_and_plans_are_those_worked_out_tensor_by_tensor():
    # worked out once per layout (tensors of one layout share them) and from columns, as every host needs them
    for program in _programs():
        committed = [t for t in program.tensors if t.dst is not None]
        for host in sorted(_hosts(program)):
            layout = HostLayout(program, host)
            assert layout.bytes_total == sum(
                sender_bytes([s.transfer], program.tensor(s.tensor).itemsize, host) for s in program.steps
                if s.kind == "move" and host_of(s.transfer.sender) == host)
            assert layout.moves_only == all(s.kind == "move" and not s.after for s in program.steps)
            assert layout.staged == staged_bytes(committed, host)
            for t in committed:
                tiles = {d: b for d, b in t.dst.tiles(t.shape).items() if host_of(d) == host}
                assert layout.dst_tiles[t.name] == tiles
                assert (layout.tile_plans[t.name] == tile_plan(t, tiles)) if tiles else t.name not in layout.tile_plans


def _tasks_step_by_step(program, host, buckets):
    """`host_tasks` as it was written before its columns, every step of the program read one by one: by depth,
    moves round-robin over (sender host, first peer) pairs (`interleaved`), then the other steps by id."""
    from collections import defaultdict

    from reshard.routes import hop_targets, interleaved, receiving_hops
    from reshard.server.agent.task_graph import Task

    lead = {i: g[0] for g in getattr(program, "buckets", ()) for i in g}
    by_depth = defaultdict(list)
    for s in program.steps:
        if lead.get(s.id, s.id) == s.id:
            by_depth[program.depths[s.id]].append(buckets[s.id].step if s.id in buckets else s)
    out = []
    for d in sorted(by_depth):
        moves = {s.id: s for s in by_depth[d] if s.kind == "move"}
        for i, t in interleaved([(s.id, s.transfer) for s in moves.values()]):
            if host_of(t.sender) == host:
                out.append(Task(moves[i], "send", d))
            out += [Task(moves[i], "recv", d, hop, hop_targets(t, hop, host)[2]) for hop in receiving_hops(t, host)]
        out += [Task(s, s.kind, d) for s in by_depth[d]
                if s.kind != "move" and any(host_of(dev) == host for dev in s.participants())]
    here = {t.step.id for t in out}
    for t in out:
        if t.role != "recv":
            t.deps = tuple(sorted({lead.get(a, a) for a in t.step.after} & here))
    return out


def test_a_hosts_tasks_from_columns_are_those_read_step_by_step_and_leave_other_hosts_runs_unmade():
    from reshard import plan_einsum
    from reshard.program import RunSteps
    from tests.core.test_einsum import CASES

    einsums = [plan_einsum(*case[:2], "c", case[2]) for case in CASES.values()]  # computes, reduces and moves
    for program in [*_programs(), *einsums]:
        every = bucket_moves(program)
        for host in sorted(_hosts(program)):
            assert _described(host_tasks(program, host, every)) == \
                _described(_tasks_step_by_step(program, host, every))
    # a quantized program's runs (`RunSteps`): a host makes those it takes part in, no other
    program = next(_programs())
    host = sorted(_hosts(program))[-1]
    tasks = host_tasks(program, host)
    assert isinstance(program.steps, RunSteps)
    made = {i for i, s in enumerate(program.steps.items) if s is not None}
    assert {t.step.id for t in tasks} <= made and len(made) < len(program.steps)


def test_a_buckets_members_are_read_from_columns_as_the_steps_say_and_make_no_run():
    from reshard.program import RunSteps

    program = next(_programs())
    steps = program.steps
    assert isinstance(steps, RunSteps)
    unmade = sum(s is None for s in steps.items)
    buckets = {host: bucket_moves(program, host) for host in sorted(_hosts(program))}
    assert sum(s is None for s in steps.items) == unmade  # no run made for its members
    for mine in buckets.values():
        for bucket in mine.values():
            for m in bucket.members:
                s = steps[m.id]  # made now, to compare
                assert (m.id, m.tensor, m.transfer, m.after, m.role) == (s.id, s.tensor, s.transfer, s.after, s.role)
    assert sum(s is None for s in steps.items) < unmade


def test_a_post_stages_only_the_tiles_it_may_land_in_and_leaves_the_small_ones_for_after():
    # `Run.stage_for` stages a bucket's members whose tiles a post lands a box in (`HostLayout.landed_later`); a
    # tile under the recycler's least size is reached through the bucket's buffer, staged after the first posts
    from reshard import Sharding, TensorDecl
    from reshard.server.transport.buffers import RECYCLE_MIN_BYTES

    train = Mesh.from_hosts({"tp": 2}, ["t0", "t1"], 1)
    serve = Mesh.from_hosts({"tp": 2}, ["s0", "s1"], 1)
    decls = [TensorDecl(f"w{i}", (256, 256), "float32", Sharding(train, ("tp", None)), Sharding(serve, ("tp", None)))
             for i in range(3)]
    decls += [TensorDecl(f"n{i}", (256,), "float32", Sharding(train, (None,)), Sharding(serve, (None,)))
              for i in range(3)]
    layout = HostLayout(plan_many(decls), "s0")
    assert layout.staged_later == {d.name for d in decls}  # every tile here is received alone
    big = {d.name for d in decls if max(
        math.prod(hi - lo for lo, hi in t) for t in layout.dst_tiles[d.name].values()) * 4 >= RECYCLE_MIN_BYTES}
    assert layout.landed_later == big == {"w0", "w1", "w2"}
