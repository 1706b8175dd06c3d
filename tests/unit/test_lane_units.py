"""A route's moves run as two units on the active transports' lanes where they carry more than two small units'
bytes (`reshard.server.agent.task_graph.lane_units`): moves dealt in turn, so a route's next move need not wait
until the last one's relay has left the chain's last hop; and every host still derives the same units in the same
order (the deadlock argument of the module's docstring)."""

from __future__ import annotations

import numpy as np

from reshard import Mesh, Sharding, TensorDecl
from reshard.many import plan_many
from reshard.mesh import host_of
from reshard.program import MOVE
from reshard.server.agent.buckets import bucket_moves
from reshard.server.agent.task_graph import (ROUTE_UNITS, SMALL_UNIT_BYTES, _route, _task_peers, host_tasks,
                                             lane_units)


def test_a_large_routes_moves_are_dealt_into_two_units_the_same_on_every_host():
    train = Mesh.from_hosts({"tp": 4}, [f"t{i}" for i in range(4)], 1)
    infer = Mesh.from_hosts({"dp": 2, "tp": 2}, [f"i{i}" for i in range(4)], 1)
    decls = []
    for i in range(12):  # 1 MiB row-split matrices (a route's moves: 3 MiB and more), and small norms
        decls += [TensorDecl(f"w{i}", (2048, 256), "float16", Sharding(train, ("tp", None)),
                             Sharding(infer, ("tp", None))),
                  TensorDecl(f"n{i}", (256,), "float32", Sharding(train, (None,)), Sharding(infer, (None,)))]
    program = plan_many(decls, bucket_bytes=64 * 1024)
    buckets = bucket_moves(program)

    def nbytes(step):
        return buckets[step.id].nbytes if step.id in buckets else \
            int(np.prod([hi - lo for lo, hi in step.transfer.box])) * program.tensor(step.tensor).itemsize

    hosts = sorted({host_of(d) for d in train.devices + infer.devices})
    seqs = {}
    split = 0
    for h in hosts:
        calling = [t for t in host_tasks(program, h, buckets) if t.depth == 0 and _task_peers(t, h)]
        units = lane_units(calling, nbytes)
        assert sorted(id(t) for u in units for t in u) == sorted(id(t) for t in calling)  # each task once
        routes: dict[tuple, list] = {}
        for t in calling:
            routes.setdefault(_route(t.step.transfer), []).append(t)
        for route, moves in routes.items():
            mine = [u for u in units if _route(u[0].step.transfer) == route]
            if sum(nbytes(t.step) for t in moves) >= ROUTE_UNITS * SMALL_UNIT_BYTES and len(moves) > 1:
                assert [[id(t) for t in u] for u in mine] == [[id(t) for t in moves[k::2]] for k in range(2)]
                split += 1
            else:
                assert [[id(t) for t in u] for u in mine] == [[id(t) for t in moves]]
        sizes = [sum(nbytes(t.step) for t in u if t.step.kind == MOVE) for u in units]
        assert sizes == sorted(sizes, reverse=True)  # largest first
        seqs[h] = [tuple(t.step.id for t in u) for u in units]
    assert split  # the case has routes large enough to split
    for h1 in hosts:  # any two hosts hold the units they share as the same steps, in the same order
        for h2 in hosts:
            shared = set(seqs[h1]) & set(seqs[h2])
            assert [u for u in seqs[h1] if u in shared] == [u for u in seqs[h2] if u in shared], (h1, h2)
            ids1 = {i for u in seqs[h1] for i in u}
            assert not [u for u in seqs[h2] if set(u) & ids1 and u not in shared], (h1, h2)
