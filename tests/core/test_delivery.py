"""The columnar proof of a program's deliveries (`reshard.delivery`): it proves what the planner makes, refuses what
`check_delivery` would refuse, and `Program.validate` then raises `check_delivery`'s own message."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from reshard import Mesh, Program, Sharding, TensorDecl
from reshard.delivery import delivered, delivered_by_pattern, delivered_in_passes
from reshard.errors import PlanValidationError
from reshard.many import plan_many
from reshard.plans import METHODS, Transfer, check_delivery
from reshard.routes import HostCache

TRAIN = Mesh.from_hosts({"tp": 8}, [f"t{i}" for i in range(4)], 2)
SERVE = Mesh.from_hosts({"dp": 2, "tp": 4}, [f"i{i}" for i in range(4)], 2)


def _decls() -> list[TensorDecl]:
    """Tensors between two meshes (replicated destinations: broadcasts) and one on the same mesh (held pieces)."""
    return [
        TensorDecl("embed", (1003, 64), "float32", Sharding(TRAIN, ("tp", None)), Sharding(SERVE, ("tp", None))),
        # one receiver a piece (no replicas): p2p moves
        TensorDecl("qkv", (64, 192), "bfloat16", Sharding(TRAIN, (None, "tp")), Sharding(SERVE, (None, ("dp", "tp")))),
        TensorDecl("norm", (64,), "float32", Sharding(TRAIN, (None,)), Sharding(SERVE, (None,))),
        TensorDecl("bias", (13,), "float32", Sharding(TRAIN, ("tp",)), Sharding(SERVE, ("tp",))),
        TensorDecl("flip", (40, 24), "float32", Sharding(TRAIN, ("tp", None)), Sharding(TRAIN, (None, "tp"))),
        TensorDecl("copy", (8, 16), "float32", Sharding(TRAIN, (None, None)), Sharding(TRAIN, (None, "tp"))),
    ]


def _program() -> Program:
    many = plan_many(_decls(), bucket_bytes=0)
    return Program(tensors=many.tensors, steps=many.steps)


def _proof(program: Program) -> dict[str, bool]:
    reshard = list(program.tensors)
    at = {t.name: k for k, t in enumerate(reshard)}
    ok = delivered(reshard, [at[s.tensor] for s in program.steps], [s.transfer for s in program.steps], METHODS,
                   HostCache())
    return dict(zip((t.name for t in reshard), ok.tolist()))


def _with(program: Program, steps) -> Program:
    return Program(tensors=program.tensors, steps=tuple(replace(s, id=i) for i, s in enumerate(steps)))


def _plain_message(program: Program, name: str) -> str:
    """What `check_delivery` alone says of tensor ``name``'s moves."""
    decl = program.tensor(name)
    moves = [(s.id, s.transfer) for s in program.steps if s.tensor == name]
    with pytest.raises(PlanValidationError) as e:
        check_delivery(decl.shape, decl.src, decl.dst, moves, before=lambda i, j: False,
                       where=lambda i, t: f"step {program.steps[i]}",
                       when=lambda i, t: "at the start (it depends on no step)")
    return str(e.value)


def test_the_columns_prove_a_planned_state_dict():
    program = _program().validate()
    assert _proof(program) == {t.name: True for t in program.tensors}
    assert any(s.transfer.method == "broadcast" for s in program.steps)
    assert any(s.transfer.method == "local" for s in program.steps if s.tensor == "flip")
    assert not any(s.tensor == "copy" for s in program.steps)  # every device holds its tile


def _first(program: Program, name: str, method: str | None = None) -> int:
    return next(s.id for s in program.steps if s.tensor == name and (method is None or s.transfer.method == method))


def _change(name: str, of_method: str | None = None, **fields):
    def edit(program: Program) -> list:
        steps = list(program.steps)
        i = _first(program, name, of_method)
        steps[i] = replace(steps[i], transfer=replace(steps[i].transfer, **fields))
        return steps
    return edit


def _drop(name: str):
    def edit(program: Program) -> list:
        i = _first(program, name)
        return [s for s in program.steps if s.id != i]
    return edit


def _twice(name: str):
    def edit(program: Program) -> list:
        return [*program.steps, program.steps[_first(program, name)]]
    return edit


def _held_again(program: Program) -> list:
    """A move of t0/0's destination tile of ``copy``, which its replicated source tile already holds."""
    decl = program.tensor("copy")
    again = replace(program.steps[0], tensor="copy",
                    transfer=Transfer(decl.dst.tile(decl.shape, "t0/0"), "t0/1", ("t0/0",), "local"))
    return [*program.steps, again]


def _elsewhere(program: Program) -> list:
    """The first p2p move of ``qkv`` sent to a destination device whose tile does not hold its box."""
    steps = list(program.steps)
    i = _first(program, "qkv", "p2p")
    t, decl = steps[i].transfer, program.tensor("qkv")
    other = next(d for d, tile in decl.dst.tiles(decl.shape).items() if tile[1][1] <= t.box[1][0] or
                 t.box[1][1] <= tile[1][0])
    steps[i] = replace(steps[i], transfer=replace(t, receivers=(other,)))
    return steps


def _split(program: Program) -> list:
    """A valid program whose first p2p move of ``qkv`` is cut in two: not the expected pieces, still exact."""
    steps = list(program.steps)
    i = _first(program, "qkv", "p2p")
    t = steps[i].transfer
    (a, b), rest = t.box[0], t.box[1:]
    mid = (a + b) // 2
    return steps[:i] + [replace(steps[i], transfer=replace(t, box=((a, mid), *rest))),
                        replace(steps[i], transfer=replace(t, box=((mid, b), *rest)))] + steps[i + 1:]


BAD = [
    ("method", _change("qkv", method="carrier"), "is not one of"),
    ("outside", _change("qkv", box=((0, 65), (0, 48))), "is empty or outside"),
    ("empty", _change("qkv", box=((3, 3), (0, 48))), "is empty or outside"),
    ("dims", _change("norm", box=((0, 64), (0, 1))), "is empty or outside"),
    ("repeated receiver", _change("qkv", "p2p", receivers=("i0/0", "i0/0")), "receivers must be distinct"),
    ("sender receives", _change("flip", "local", receivers=("t0/0",), sender="t0/0"), "receivers must be distinct"),
    ("local across hosts", _change("flip", "local", receivers=("t1/0",)), "must stay on host"),
    ("p2p with a route", _change("qkv", "p2p", route=("i0",)), "only broadcasts have a route"),
    ("wrong route", _change("embed", "broadcast", route=("i3",)), "must list each receiving host"),
    ("not a destination device", _change("qkv", "p2p", receivers=("t3/1",)), "is not a device of the destination"),
    ("outside the receiver's tile", _elsewhere, "is not inside receiver"),
    ("sender lacks the box", _change("qkv", "p2p", sender="t3/1"), "does not hold box"),
    ("missing piece", _drop("embed"), "misses"),
    ("piece twice", _twice("qkv"), "held or received twice"),
    ("held piece moved again", _held_again, "held or received twice"),
]


@pytest.mark.parametrize("case, edit, rule", BAD, ids=[c[0] for c in BAD])
def test_a_bad_tensor_is_left_to_check_delivery_which_names_the_problem(case, edit, rule):
    program = _program()
    bad = _with(program, edit(program))
    proof = _proof(bad)
    (name,) = [n for n, good in proof.items() if not good]
    assert all(good for n, good in proof.items() if n != name)
    with pytest.raises(PlanValidationError) as e:
        bad.validate()
    assert str(e.value) == _plain_message(bad, name)
    assert rule in str(e.value)


def test_a_valid_program_the_columns_cannot_prove_passes_check_delivery():
    program = _program()
    split = _with(program, _split(program))
    assert _proof(split) == {t.name: t.name != "qkv" for t in program.tensors}
    split.validate()


def test_a_tensor_without_moves_is_left_to_check_delivery():
    # A tensor with no moves at all: its destination tiles, from another mesh, miss every element.
    program = _program()
    steps = [s for s in program.steps if s.tensor != "bias"]
    bad = _with(program, steps)
    assert _proof(bad)["bias"] is False
    with pytest.raises(PlanValidationError, match="misses"):
        bad.validate()
    assert np.all([v for n, v in _proof(bad).items() if n != "bias"])


@pytest.mark.parametrize("per_pass", [1, 7, 40, 10**9])
@pytest.mark.parametrize("case, edit", [(c[0], c[1]) for c in BAD] + [("valid", lambda p: list(p.steps))],
                         ids=[c[0] for c in BAD] + ["valid"])
def test_passes_of_bounded_deliveries_prove_what_one_pass_proves(case, edit, per_pass):
    # A pass per tensor or two (1, 7), a few (40), one (10**9): the same verdicts, and validate raises the same.
    program = _program()
    bad = _with(program, edit(program))
    reshard = list(bad.tensors)
    at = {t.name: k for k, t in enumerate(reshard)}
    tensor_of, transfers = [at[s.tensor] for s in bad.steps], [s.transfer for s in bad.steps]
    one = delivered(reshard, tensor_of, transfers, METHODS, HostCache())
    assert delivered_in_passes(reshard, tensor_of, transfers, METHODS, HostCache(), per_pass).tolist() == one.tolist()


def _copies(n: int) -> Program:
    """``_decls()`` ``n`` times over (``name#i``): tensors of one layout each, moved alike where the planner's loads
    allow (a state dict's layers)."""
    decls = [replace(d, name=f"{d.name}#{i}") for i in range(n) for d in _decls()]
    many = plan_many(decls, bucket_bytes=0)
    return Program(tensors=many.tensors, steps=many.steps)


def _verdicts(program: Program, prove) -> list[bool]:
    reshard = list(program.tensors)
    at = {t.name: k for k, t in enumerate(reshard)}
    return prove(reshard, [at[s.tensor] for s in program.steps], [s.transfer for s in program.steps], METHODS,
                 HostCache()).tolist()


COPY_EDITS = [  # (case, edit, the tensor it breaks)
    ("repeated receiver", _change("qkv#3", "p2p", receivers=("i0/0", "i0/0")), "qkv#3"),
    ("sender receives", _change("flip#3", "local", receivers=("t0/0",), sender="t0/0"), "flip#3"),
    ("p2p with a route", _change("qkv#3", "p2p", route=("i0",)), "qkv#3"),
    ("wrong route", _change("embed#3", "broadcast", route=("i3",)), "embed#3"),
    ("not a destination device", _change("qkv#3", "p2p", receivers=("t3/1",)), "qkv#3"),
    ("sender lacks the box", _change("qkv#3", "p2p", sender="t3/1"), "qkv#3"),
    ("missing piece", _drop("embed#3"), "embed#3"),
    ("piece twice", _twice("qkv#3"), "qkv#3"),
    ("valid", lambda p: list(p.steps), None),
]


@pytest.mark.parametrize("case, edit, broken", COPY_EDITS, ids=[c[0] for c in COPY_EDITS])
def test_proving_each_pattern_once_gives_every_tensors_verdict(case, edit, broken):
    # Five copies of each tensor: the copies share patterns, so one of each is proved; an edit to one copy makes
    # it a pattern of its own (or breaks a link rule, checked for every transfer), and only it fails.
    program = _copies(5)
    bad = _with(program, edit(program))
    got = _verdicts(bad, delivered_by_pattern)
    assert got == _verdicts(bad, delivered)
    assert [t.name for t, good in zip(bad.tensors, got) if not good] == ([broken] if broken else [])
    if broken is None:
        bad.validate()
    else:
        with pytest.raises(PlanValidationError):
            bad.validate()


def test_copies_of_a_layout_share_their_patterns(monkeypatch):
    # what makes proving each pattern once pay: the 30 tensors' moves fall into fewer patterns, one tensor of each
    # proved
    import reshard.delivery as module

    program = _copies(5)
    proved = []

    def counting(decls, *args, **kw):
        proved.append(len(decls))
        return delivered_in_passes(decls, *args, **kw)

    monkeypatch.setattr(module, "delivered_in_passes", counting)
    assert all(_verdicts(program, delivered_by_pattern))
    assert proved and proved[0] < len(program.tensors)
