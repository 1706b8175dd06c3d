"""A repeated move is planned and read once: the planner's `ProgramCache` and the agent runtime's parsed programs."""

from __future__ import annotations

import json

from reshard import Mesh, Sharding, TensorDecl
from reshard.many import plan_many
from reshard.server.agent.runtime import Runtime
from reshard.server.agent.store import ShardStore
from reshard.server.common.contract import PROGRAMS_KEPT
from reshard.server.planner.jobs import ProgramCache
from reshard.server.transport.memory import MemoryNetwork, MemoryTransport

A = Mesh.from_hosts({"x": 2}, ["a0", "a1"], 1)
B = Mesh.from_hosts({"x": 2}, ["b0", "b1"], 1)


def _program(rows: int):
    return plan_many([TensorDecl("w", (rows, 8), "float32", Sharding(A, ("x", None)), Sharding(B, (None, "x")))])


def test_the_planner_keeps_the_most_recently_used_programs_with_their_json():
    cache = ProgramCache(2)
    programs = {rows: _program(rows) for rows in (4, 6, 8)}
    for rows in (4, 6):
        program, text = cache.put(rows, programs[rows])
        assert program is programs[rows] and text == programs[rows].dumps()
    assert cache.get(4)[0] is programs[4]  # 4 is now the most recent: 6 goes first
    cache.put(8, programs[8])
    assert cache.get(6) is None and cache.get(4)[0] is programs[4] and cache.get(8)[0] is programs[8]


def test_an_agent_reads_a_program_text_once_and_only_the_very_same_text_hits():
    network = MemoryNetwork()
    runtime = Runtime("b0", ShardStore(), {"grpc": MemoryTransport("b0", network)}, workers=2,
                      step_timeout_s=10.0)
    try:
        texts = [_program(rows).dumps() for rows in range(4, 4 + PROGRAMS_KEPT + 1)]
        first, ident = runtime._load(texts[0])
        assert runtime._load(texts[0])[0] is first and ident == first.id
        assert runtime._load(texts[0] + " ")[0] is not first  # another text is read again, even if it means the same
        for text in texts[1:]:
            runtime._load(text)
        assert runtime._load(texts[0])[0] is not first  # pushed out by PROGRAMS_KEPT newer texts
    finally:
        runtime.close()


def test_an_agent_keeps_program_text_up_to_its_byte_budget(monkeypatch):
    from reshard.server.agent import runtime as rt

    network = MemoryNetwork()
    runtime = Runtime("b0", ShardStore(), {"grpc": MemoryTransport("b0", network)}, workers=2,
                      step_timeout_s=10.0)
    try:
        texts = [_program(rows).dumps() for rows in (4, 6, 8)]
        monkeypatch.setattr(rt, "PROGRAMS_KEPT_BYTES", len(texts[0]) + len(texts[1]) + 10)
        first = runtime._load(texts[0])[0]
        runtime._load(texts[1])
        assert runtime._load(texts[0])[0] is first  # both fit
        runtime._load(texts[2])  # over the budget: the least recently used (texts[1]) goes
        assert runtime._load(texts[0])[0] is first
        assert runtime._programs_bytes == sum(entry[3] for entry in runtime._programs.values()) <= \
            rt.PROGRAMS_KEPT_BYTES
        monkeypatch.setattr(rt, "PROGRAMS_KEPT_BYTES", 1)
        newest = runtime._load(texts[1])[0]
        assert runtime._load(texts[1])[0] is newest and len(runtime._programs) == 1  # the newest is always kept
    finally:
        runtime.close()


def test_an_agent_works_out_a_programs_layout_once_and_each_run_counts_down_its_own_tasks():
    network = MemoryNetwork()
    runtime = Runtime("b0", ShardStore(), {"grpc": MemoryTransport("b0", network)}, workers=2,
                      step_timeout_s=10.0)
    try:
        program = _program(4)
        text, peers = program.dumps(), {h: h for h in ("a0", "a1", "b0", "b1")}
        runs = [runtime.prepare(f"job{i}", text, "w", 1, 2, peers) for i in range(2)]
        assert runs[0].layout is runs[1].layout  # worked out once for the program
        assert runs[0].tasks and all(a is not b and a.step is b.step for a, b in zip(runs[0].tasks, runs[1].tasks))
        assert [t.waiting for t in runs[1].tasks] == [len(t.deps) for t in runs[1].tasks]
        assert runs[0].layout.dst_tiles == {"w": {"b0/0": ((0, 4), (0, 4))}}
        other = runtime.prepare("job2", _program(6).dumps(), "w", 1, 2, peers)
        assert other.layout is not runs[0].layout
        for job in ("job0", "job1", "job2"):
            runtime.abort(job)
    finally:
        runtime.close()


def test_the_moves_the_planner_works_out_of_a_program_match_its_steps():
    from reshard.box import volume
    from reshard.cost import network_copies, sender_bytes
    from reshard.mesh import host_of
    from reshard.program import MOVE
    from reshard.server.planner.jobs import _Moves

    program = _program(8)
    moves = [(s.transfer, program.tensor(s.tensor).itemsize) for s in program.steps if s.kind == MOVE]
    made = _Moves.of(moves, {"b0"})
    assert len(made.network) == len(moves)
    assert made.hosts == {"a0", "a1", "b0", "b1"}
    for host in made.hosts:
        assert made.to_send.get(host, 0) == sender_bytes([t for t, _ in moves], 4, host)
    assert made.network_bytes == sum(volume(t.box) * n * network_copies(t) for t, n in moves) > 0
    assert made.network == [bool(network_copies(t)) for t, _ in moves]
    assert made.local_bytes == sum(volume(t.box) * n * sum(host_of(r) == host_of(t.sender) for r in t.receivers)
                                   for t, n in moves)


def test_the_state_store_saves_many_tensors_in_one_transaction_and_reads_them_back(tmp_path):
    from reshard.server.planner.catalog import TensorRecord, bumped
    from reshard.server.planner.state import StateStore

    store = StateStore(str(tmp_path / "state.db"))
    partial = Sharding(A, (None, None), partial=("x",))
    recs = [TensorRecord("t0", (8, 4), "float32", Sharding(A, ("x", None)), 1),
            TensorRecord('t1"\u00e9', (8,), "bfloat16", partial, 2, "torch", frozenset({"a1/0", "a0/1"})),
            TensorRecord("t2", (3, 5, 7), "float8_e4m3fn", Sharding(A, (None, ("x",))), 3)]
    # The text is json.dumps's to the character, escapes included, though written without it.
    assert [r.json_text() for r in recs] == [json.dumps(r.to_json()) for r in recs]
    store.save_tensors([(r.name, r.json_text()) for r in recs])
    moved = bumped(recs[1], Sharding(A, ("x",)))
    store.save_tensor(moved.name, moved.json_text())  # replaces, in place of the old version
    assert store.tensors() == [recs[0].to_json(), moved.to_json(), recs[2].to_json()]
    assert [TensorRecord.from_json(d) for d in store.tensors()] == [recs[0], moved, recs[2]]
    assert moved.version == 3 and moved.kind == "torch" and not moved.lost


def test_a_shardings_json_is_worked_out_once_and_each_caller_gets_its_own_dict():
    sharding = Sharding(A, ("x", None))
    first = sharding.to_json()
    first["partial"] = ["x"]  # a caller's own change stays its own
    assert sharding.to_json() == {"mesh": A.to_json(), "spec": [["x"], []]}
    assert Sharding.from_json(sharding.to_json()) == sharding
    assert Sharding(A, ("x", None)) == sharding and hash(Sharding(A, ("x", None))) == hash(sharding)


def test_a_program_is_validated_and_written_out_once_and_a_bad_one_fails_every_time():
    import dataclasses

    import pytest

    from reshard.program import PlanValidationError

    program = _program(4)
    assert program.validate() is program and program.__dict__.get("_valid")
    assert program.dumps() is program.dumps()  # the same string: written out once
    assert program == dataclasses.replace(program) and hash(program) == hash(dataclasses.replace(program))
    bad = dataclasses.replace(program, steps=program.steps[1:])  # a move left out: a tile goes short
    assert "_valid" not in bad.__dict__
    for _ in range(2):
        with pytest.raises(PlanValidationError):
            bad.validate()


def test_an_agent_takes_the_id_a_signed_text_claims_and_the_ticket_refuses_any_other_text():
    """An agent no longer works the id out of the program's content again: the planner's Prepare ticket signs the
    text's hash, so a text changed after signing is refused before it is read, and the id it claims stands."""
    import pytest

    from reshard.proto.errors import PermissionDeniedError
    from reshard.server.agent.programs import load_program
    from reshard.server.common.tickets import TicketCheck, new_secret, prepare_fields, sign

    program = _program(4)
    text = program.dumps()
    loaded, ident = load_program(text)
    assert ident == program.id and loaded.steps == program.steps
    unnamed = json.loads(text)
    del unnamed["id"]
    assert load_program(json.dumps(unnamed))[1] == program.id  # no claim: the content's id
    secret = new_secret()
    fields = ("job", "w", 1, 2, "grpc", 0, 0, {"b0": "b0"})
    ticket = sign(secret, "prepare", *prepare_fields(fields[0], text, *fields[1:]))
    check = TicketCheck("b0", secret)
    check.check(ticket, "prepare", *prepare_fields(fields[0], text, *fields[1:]), what="Prepare")
    altered = text.replace('"float32"', '"int32"', 1)
    with pytest.raises(PermissionDeniedError):
        check.check(ticket, "prepare", *prepare_fields(fields[0], altered, *fields[1:]), what="Prepare")


def test_the_planner_reads_a_layout_once_and_hands_out_one_object_for_it(monkeypatch):
    import pytest

    from reshard.errors import InvalidShardingError
    from reshard.server.common.config import PlannerConfig
    from reshard.server.planner import control

    planner = control.Planner(PlannerConfig(), agents=None)
    try:
        rows = Sharding(A, ("x", None))
        text = json.dumps(rows.to_json())
        first = planner._sharding(text, "sharding")
        assert first == rows and planner._sharding(text, "sharding") is first
        # Another text of the same layout (spaced otherwise) stands for the same object.
        assert planner._sharding(json.dumps(rows.to_json(), indent=1), "sharding") is first
        cols = planner._sharding(json.dumps(Sharding(A, (None, "x")).to_json()), "sharding")
        assert cols == Sharding(A, (None, "x")) and cols is not first
        # A bad text is refused every time it comes, and what was read stays.
        for _ in range(2):
            with pytest.raises(InvalidShardingError, match="destination sharding of 'w'"):
                planner._sharding(json.dumps({"mesh": A.to_json(), "spec": 3}), "destination sharding of 'w'")
        assert planner._sharding(text, "sharding") is first
        # Past LAYOUTS_KEPT texts the least recently read go; read again, each is an equal layout.
        monkeypatch.setattr(control, "LAYOUTS_KEPT", 2)
        planner._sharding(json.dumps(Sharding(A, ()).to_json()), "sharding")
        cols_text = json.dumps(Sharding(A, (None, "x")).to_json())
        assert len(planner._layouts) == 2 and text in planner._layouts and cols_text not in planner._layouts
        assert planner._sharding(text, "sharding") is first
        assert planner._sharding(cols_text, "sharding") == Sharding(A, (None, "x"))
        # A text too long to keep is read each time; the layouts it named are let go past 2 x LAYOUTS_KEPT.
        monkeypatch.setattr(control, "LAYOUT_TEXT_KEPT_BYTES", 10)
        for n in range(1, 7):
            planner._sharding(json.dumps(Sharding(Mesh.from_hosts({"y": n}, [f"b{i}" for i in range(n)], 1),
                                                  ("y",)).to_json()), "sharding")
        assert len(planner._layouts) == 2 and len(planner._by_layout) <= 2 * 2 + 1
    finally:
        planner.close()


def test_the_planners_moves_of_a_state_dict_are_counted_once_per_transfer_as_move_by_move():
    """`_Moves.of` works each distinct (transfer, item size) out once and counts it as often as it moves (a state
    dict's tensors share their layout's transfers): the same figures as reading every move, tensor by tensor."""
    from collections import defaultdict

    from reshard import Mesh
    from reshard.box import volume
    from reshard.cost import sender_bytes
    from reshard.many import plan_many
    from reshard.moe import SMALL_MOE, moe_state_dict
    from reshard.routes import hops
    from reshard.server.planner.jobs import _Moves
    from tests.core.test_many import _state_dict

    train, serve = Mesh.grid({"host": 2, "gpu": 4}, 4, "t"), Mesh.grid({"host": 2, "gpu": 4}, 4, "s", first_host=2)
    case = moe_state_dict(SMALL_MOE, train, serve, ep_devices=4)
    for program in (plan_many(case.tensors, scales=case.scales, dtypes=case.serve_dtypes),
                    plan_many(_state_dict(num_layers=4))):
        _, transfers, tensors, _ = program.moves()
        moves = [(t, program.tensor(n).itemsize) for t, n in zip(transfers, tensors)]
        assert len({id(t) for t in transfers}) < len(transfers) / 2  # moves share transfers
        made = _Moves.of(moves, set(), False, tensors)
        to_send, per_tensor, codec = defaultdict(int), defaultdict(int), {}
        for (t, itemsize), name in zip(moves, tensors):
            sender = t.sender.split("/")[0]
            to_send[sender] += sender_bytes([t], itemsize, sender)
            n, went = volume(t.box) * itemsize, hops(t)
            per_tensor[name] += n * len(went)
            if went:
                diffs, applies = codec.setdefault(name, (defaultdict(int), defaultdict(int)))
                diffs[sender] += n
                for hop in went:
                    applies[hop.dst] += n
        assert made.to_send == dict(to_send) and made.tensor_network == dict(per_tensor)
        assert made.tensor_codec == {n: (dict(d), dict(a)) for n, (d, a) in codec.items()}
        assert made.network == [bool(hops(t)) for t in transfers]
        assert made.network_bytes == sum(per_tensor.values()) > 0


def test_a_job_calls_the_hosts_its_moves_reach_first_the_most_reached_first():
    """`_Moves.receivers` lists the hosts a move's network hop reaches, by how many reach each; `receivers_first`
    puts them before the job's other hosts (a receiver's call starts the bytes: on nixl it posts where they land)."""
    from reshard.box import volume
    from reshard.program import MOVE
    from reshard.routes import hops
    from reshard.server.planner.jobs import _Moves, receivers_first

    program = _program(8)
    moves = [(s.transfer, program.tensor(s.tensor).itemsize) for s in program.steps if s.kind == MOVE]
    made = _Moves.of(moves, {"b0"})
    reached: dict[str, int] = {}
    for t, _ in moves:
        for hop in hops(t):
            reached[hop.dst] = reached.get(hop.dst, 0) + 1
    assert reached and all(volume(t.box) for t, _ in moves)
    assert made.receivers == tuple(sorted(reached, key=lambda h: (-reached[h], h)))
    hosts = sorted(made.hosts)
    ordered = receivers_first(hosts, made)
    assert sorted(ordered) == hosts
    assert ordered[:len(made.receivers)] == list(made.receivers)
    assert ordered[len(made.receivers):] == [h for h in hosts if h not in reached]
    assert receivers_first(["a0"], made) == ["a0"]  # hosts of the job only, none added
