"""Split-einsum programs run for real on the agents' runtime (several hosts in one process).

`reshard.einsum.plan_einsum` plans; the hosts of `tests.unit.test_runtime.Hosts` run the
program over the in-memory transport (a few fixed cases also over a gloo group); the
result read back from the hosts' stores must equal ``numpy.einsum``, exactly: the values
are small integers in float64. A Partial result is read back as the sum of its addends.
The traffic tests count what each host put on the network for the reductions, against
the ring's 2(n-1)/n (all-reduce) and (n-1)/n (reduce-scatter) of a tile, and that
nothing moves when the inputs' layouts already line up.
"""

from __future__ import annotations

import itertools
import string

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from reshard import Mesh, Sharding
from reshard.einsum import EinsumError, plan_einsum
from reshard.program import MOVE, REDUCE, TensorDecl

from .test_runtime import HOSTS, Hosts, gloo, hosts  # noqa: F401 - the fixtures run both transports

_NAMES = itertools.count()

# (axes, hosts, devices per host): 1- and 2-axis meshes, several devices on one host or one per host
MESHES = [
    ({"x": 2}, HOSTS[:2], 1),
    ({"x": 3}, HOSTS[:3], 1),
    ({"x": 4}, HOSTS[:2], 2),
    ({"x": 2, "y": 2}, HOSTS[:2], 2),
    ({"x": 2, "y": 2}, HOSTS, 1),
    ({"x": 2, "y": 3}, HOSTS[1:4], 2),
    ({"y": 2, "x": 2}, HOSTS[2:4], 2),
]
NAMED = ["ij,jk->ik", "bij,bjk->bik", "i,j->ij", "ijk,jkl->il", "ij,jk->k", "ab,bc->ca", "ij,ij->ij", "ik,jk->ij"]


def _mesh(i: int) -> Mesh:
    axes, names, per_host = MESHES[i]
    return Mesh.from_hosts(axes, list(names), per_host)


@st.composite
def equations(draw) -> str:
    """Two-input equations: every letter in one input or both, in the output or summed."""
    if draw(st.booleans()):
        return draw(st.sampled_from(NAMED))
    letters = string.ascii_lowercase[:draw(st.integers(2, 4))]
    where = {c: draw(st.sampled_from(["a", "b", "ab"])) for c in letters}
    a = [c for c in letters if "a" in where[c]]
    b = [c for c in letters if "b" in where[c]]
    assume(a and b)
    out = [c for c in letters if draw(st.booleans())] or [letters[0]]
    a, b, out = (draw(st.permutations(x)) for x in (a, b, out))
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}"


@st.composite
def specs(draw, mesh: Mesh, ndim: int):
    """A valid spec: each axis splits at most one dim, some dims over two axes."""
    free = list(mesh.axis_names)
    spec = []
    for _ in range(ndim):
        take = draw(st.integers(0, min(2, len(free))))
        axes = draw(st.permutations(free))[:take] if take else []
        free = [a for a in free if a not in axes]
        spec.append(tuple(axes) or None)
    return spec


@st.composite
def problems(draw):
    eq = draw(equations())
    operands, out = eq.split("->")[0].split(","), eq.split("->")[1]
    sizes = {c: draw(st.integers(1, 7)) for c in set("".join(operands))}
    m = draw(st.integers(0, len(MESHES) - 1))
    meshes = [m, draw(st.sampled_from([m, m, draw(st.integers(0, len(MESHES) - 1))]))]
    shardings = []
    for k, ls in zip(meshes, operands):
        spec = draw(specs(_mesh(k), len(ls)))
        free = [a for a in _mesh(k).axis_names if all(e is None or a not in e for e in spec)]
        partial = draw(st.sampled_from([(), (), *((a,) for a in free)]))  # a pending sum over an unused axis
        shardings.append(Sharding(_mesh(k), spec, partial=partial))
    kind = draw(st.sampled_from(["none", "none", "same mesh", "scatter", "partial", "other mesh"]))
    out_sharding = None
    if kind == "scatter" and meshes[0] == meshes[1]:
        # the inputs' splits of the output dims, and the axes of a summed dim moved onto one output dim
        splits = {c: axes for ls, sh in zip(operands, shardings) for c, axes in zip(ls, sh.dim_axes(len(ls)))}
        spec = [list(splits[c]) for c in out]
        summed = [a for c in splits if c not in out for a in splits[c]]
        spec[draw(st.integers(0, len(out) - 1))] += summed
        flat = [a for e in spec for a in e]
        if len(flat) == len(set(flat)):
            out_sharding = Sharding(shardings[0].mesh, [tuple(e) or None for e in spec])
    elif kind == "same mesh":
        out_sharding = Sharding(shardings[0].mesh, draw(specs(shardings[0].mesh, len(out))))
    elif kind == "partial":
        mesh = shardings[0].mesh
        axis = draw(st.sampled_from(mesh.axis_names))
        spec = [None if e is None else tuple(a for a in e if a != axis) or None for e in draw(specs(mesh, len(out)))]
        out_sharding = Sharding(mesh, spec, partial=(axis,))
    elif kind == "other mesh":
        mesh = _mesh(draw(st.integers(0, len(MESHES) - 1)))
        out_sharding = Sharding(mesh, draw(specs(mesh, len(out))))
    return eq, operands, out, sizes, shardings, out_sharding


@pytest.fixture(scope="module")
def memory_hosts():
    h = Hosts()
    yield h
    h.close()


def _values(shape, rng) -> np.ndarray:
    return rng.integers(-4, 5, shape).astype(np.float64)


def _operands(eq: str, sizes: dict[str, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [_values(tuple(sizes[c] for c in ls), rng) for ls in eq.split("->")[0].split(",")]


def run_einsum(cluster: Hosts, eq: str, arrays: list[np.ndarray], shardings: list[Sharding], out_sharding=None,
               **kw):
    """Put the inputs, plan, run and commit; returns (program, {host: run}, the output read back)."""
    return run_planned(cluster, arrays, shardings, lambda decls, out: plan_einsum(eq, decls, out, out_sharding, **kw))


def run_planned(cluster: Hosts, arrays: list[np.ndarray], shardings: list[Sharding], make):
    """Put the inputs, plan with ``make(input decls, output name)``, run and commit; as `run_einsum`."""
    k = next(_NAMES)
    decls = []
    for i, (a, s) in enumerate(zip(arrays, shardings)):
        name = f"in{k}_{i}"
        put_addends(cluster, name, a, s, np.random.default_rng(k))
        decls.append(TensorDecl(name, a.shape, "float64", s))
    program = make(decls, f"out{k}")
    job, runs = cluster.start(program.dumps(), f"out{k}")
    cluster.finish(job, runs)
    decl = program.tensor(f"out{k}")
    return program, runs, read_back(cluster, f"out{k}", decl.dst, decl.shape)


def put_addends(cluster: Hosts, name: str, array: np.ndarray, sharding: Sharding, rng) -> None:
    """Commit ``array`` in ``sharding``; along its partial axes, as random integer addends that sum to it."""
    mesh = sharding.mesh
    index = [mesh.axis_index(a) for a in sharding.partial]
    corners = list(itertools.product(*(range(mesh.shape[i]) for i in index)))
    addends = {c: rng.integers(-4, 5, array.shape).astype(array.dtype) for c in corners[1:]}
    addends[corners[0]] = array - sum(addends.values(), np.zeros_like(array))
    cluster.put(name, {dev: (addends[tuple(mesh.coords(pos)[i] for i in index)][tuple(slice(*r) for r in box)].copy(),
                             box)
                       for pos, (dev, box) in enumerate(sharding.tiles(array.shape).items())})


def read_back(cluster: Hosts, name: str, sharding: Sharding, shape) -> np.ndarray:
    """The committed tensor: replicas must agree; addends along partial axes are summed."""
    mesh = sharding.mesh
    split = {a for axes in sharding.spec for a in axes}
    replica = [i for i, a in enumerate(mesh.axis_names) if a not in split and a not in sharding.partial]
    out = np.zeros(shape)
    first: dict[tuple, np.ndarray] = {}
    for pos, (dev, box) in enumerate(sharding.tiles(shape).items()):
        tile = cluster.stores[dev.split("/")[0]].get(name, 2, dev).array
        coords = mesh.coords(pos)
        key = tuple(c for i, c in enumerate(coords) if i not in replica)
        held = first.setdefault(key, tile)
        assert np.array_equal(held, tile), f"replica {dev} of {name} differs from its peers"
        if all(coords[i] == 0 for i in replica):
            out[tuple(slice(lo, hi) for lo, hi in box)] += tile
    return out


# -- must show 1: results equal numpy.einsum ----------------------------------------------------------------


EINSUM_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]


@settings(max_examples=100, deadline=None, suppress_health_check=EINSUM_HEALTH)
@given(problems(), st.integers(0, 2**32 - 1))
def test_any_two_input_einsum_on_any_layouts_equals_numpy(memory_hosts, problem, seed):
    _einsum_equals_numpy(memory_hosts, problem, seed)


@pytest.mark.slow  # the same at length, in make bench: 300 more problems, 17 s of make test's 2 cores
@settings(max_examples=300, deadline=None, suppress_health_check=EINSUM_HEALTH)
@given(problems(), st.integers(0, 2**32 - 1))
def test_any_two_input_einsum_on_any_layouts_equals_numpy_long(memory_hosts, problem, seed):
    _einsum_equals_numpy(memory_hosts, problem, seed)


def _einsum_equals_numpy(memory_hosts, problem, seed) -> None:
    eq, operands, out, sizes, shardings, out_sharding = problem
    rng = np.random.default_rng(seed)
    arrays = [_values(tuple(sizes[c] for c in ls), rng) for ls in operands]
    want = np.einsum(eq, *arrays)
    summed = set("".join(operands)) - set(out)
    try:
        program, _, got = run_einsum(memory_hosts, eq, arrays, shardings, out_sharding)
    except EinsumError as e:
        # a pending sum needs a summed letter split over its axis, or a Partial input carried through
        assert out_sharding is not None and out_sharding.partial and not summed, e
        assert "Partial over" in str(e)
        event("Partial output refused")
        return
    for s in program.steps:
        event("move of the output" if s.kind == MOVE and program.tensor(s.tensor).dst is not None else
              "sum of a Partial input" if s.kind == REDUCE and program.tensor(s.inputs[0].tensor).src is not None
              else f"{s.kind} {s.result}" if s.kind == REDUCE else s.kind)
    event(f"{sum(bool(x.partial) for x in shardings)} Partial inputs")
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"{eq} on {program.einsum_layout}:\n{program.summary(60)}"


@pytest.mark.parametrize("eq, specs_, out_spec", [
    ("ij,jk->ik", [("x", "y"), ("y", None)], None),  # contracting dim split: all-reduce over y
    ("ij,jk->ik", [("x", "y"), ("y", None)], ("x", "y")),  # reduce-scatter onto k
    ("ij,jk->ik", [("x", "y"), (None, "x")], None),  # conflict: the planner moves an input
    ("bij,bjk->bik", [("x", None, "y"), ("x", "y", None)], None),
])
def test_fixed_cases_on_both_transports(hosts, eq, specs_, out_spec):
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2)
    arrays = _operands(eq, {"b": 3, "i": 5, "j": 7, "k": 6}, 1)
    out = Sharding(mesh, out_spec) if out_spec else None
    _, _, got = run_einsum(hosts, eq, arrays, [Sharding(mesh, s) for s in specs_], out)
    assert np.array_equal(got, np.einsum(eq, *arrays))


@pytest.mark.parametrize("eq, specs_", [
    ("ij->j", [("x", "y")]),  # one input: a sum over a split dim is a reduce
    ("ij->ji", [("x", "y")]),  # a transpose moves nothing
    ("ij,jk,kl->il", [("x", None), (None, "y"), ("y", None)]),  # three inputs: one local einsum each
])
def test_one_and_three_input_einsums(memory_hosts, eq, specs_):
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS), 1)
    arrays = _operands(eq, {"i": 7, "j": 5, "k": 6, "l": 3}, 8)
    program, _, got = run_einsum(memory_hosts, eq, arrays, [Sharding(mesh, s) for s in specs_])
    assert np.array_equal(got, np.einsum(eq, *arrays))
    assert not [s for s in program.steps if s.kind == MOVE]


def test_float32_small_integers_are_exact_and_an_empty_tile_contributes_nothing(memory_hosts):
    # j = 3 over a 4-way axis: chunks 1, 1, 1, 0; the device with the empty chunk adds zeros
    mesh = Mesh.from_hosts({"x": 4}, list(HOSTS), 1)
    rng = np.random.default_rng(2)
    a, b = (rng.integers(-4, 5, s).astype(np.float32) for s in ((5, 3), (3, 6)))
    k = next(_NAMES)
    decls = []
    for i, (arr, spec) in enumerate(((a, (None, "x")), (b, ("x", None)))):
        memory_hosts.put_tensor(f"f{k}_{i}", arr, Sharding(mesh, spec))
        decls.append(TensorDecl(f"f{k}_{i}", arr.shape, "float32", Sharding(mesh, spec)))
    program = plan_einsum("ij,jk->ik", decls, f"f{k}")
    assert [s.device for s in program.steps if s.kind == "compute"] == list(mesh.devices)
    job, runs = memory_hosts.start(program.dumps(), f"f{k}")
    memory_hosts.finish(job, runs)
    got = memory_hosts.get(f"f{k}", program.tensor(f"f{k}").dst, (5, 6))
    assert got.dtype == np.float32 and np.array_equal(got, a @ b)


# -- must show 2: what the reductions send, and nothing when layouts line up --------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("out_spec, factor", [(None, lambda n: 2 * (n - 1) / n), (("x", None), lambda n: (n - 1) / n)])
def test_each_device_sends_and_receives_the_ring_share_of_its_tile(memory_hosts, n, out_spec, factor):
    mesh = Mesh.from_hosts({"x": n}, list(HOSTS[:n]), 1)  # one device per host: a host's NIC is its device's
    rows, cols = 12 * n, 10
    rng = np.random.default_rng(n)
    arrays = [_values((rows, 8), rng), _values((8, cols), rng)]
    out = Sharding(mesh, out_spec) if out_spec else None
    # pinned: for a reduce-scatter onto i the cost model would rather move these small inputs
    program, runs, got = run_einsum(memory_hosts, "ij,jk->ik", arrays,
                                    [Sharding(mesh, (None, "x")), Sharding(mesh, ("x", None))], out, layout={"j": "x"})
    assert np.array_equal(got, arrays[0] @ arrays[1])
    assert [s.kind for s in program.steps].count(MOVE) == 0
    tile = rows * cols * 8  # every device holds addends of the whole output
    for h in HOSTS[:n]:
        traffic = runs[h].traffic
        assert sum(traffic.bytes_out.values()) == factor(n) * tile
        assert sum(traffic.bytes_in.values()) == factor(n) * tile
        assert traffic.local_bytes == 0
    # the program's own figures, which the estimate prices, are the ones that ran
    assert {h: row["bytes_out"] for h, row in program.host_bytes().items()} == {h: factor(n) * tile
                                                                                for h in HOSTS[:n]}


def test_a_reduction_inside_a_host_stays_off_the_network(memory_hosts):
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2)  # y runs inside a host
    rng = np.random.default_rng(5)
    arrays = [_values((8, 6), rng), _values((6, 4), rng)]
    program, runs, got = run_einsum(memory_hosts, "ij,jk->ik", arrays,
                                    [Sharding(mesh, ("x", "y")), Sharding(mesh, ("y", None))])
    assert np.array_equal(got, arrays[0] @ arrays[1])
    tile = 4 * 4 * 8
    for h in HOSTS[:2]:
        assert sum(runs[h].traffic.bytes_out.values()) == 0
        assert runs[h].traffic.local_bytes == 2 * (2 * (2 - 1) / 2) * tile  # two members, each its ring share


@pytest.mark.parametrize("eq, specs_", [
    ("bij,bjk->bik", [("x", None, None), ("x", None, "y")]),  # batch and free dims: no reduction at all
    ("ij,jk->ik", [("x", None), (None, "y")]),
    ("i,j->ij", [("x",), ("y",)]),
])
def test_nothing_moves_when_the_layouts_line_up(memory_hosts, eq, specs_):
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS), 1)
    arrays = _operands(eq, {"b": 3, "i": 5, "j": 4, "k": 7}, 3)
    program, runs, got = run_einsum(memory_hosts, eq, arrays, [Sharding(mesh, s) for s in specs_])
    assert np.array_equal(got, np.einsum(eq, *arrays))
    assert {s.kind for s in program.steps} == {"compute"}
    assert all(s.kernel == "einsum" for s in program.steps)
    for run in runs.values():
        assert (sum(run.traffic.bytes_out.values()), run.traffic.local_bytes, run.traffic.sent) == (0, 0, 0)


def test_an_input_on_another_mesh_moves_and_only_it(memory_hosts):
    mesh = Mesh.from_hosts({"x": 2}, list(HOSTS[:2]), 1)
    far = Mesh.from_hosts({"x": 2}, list(HOSTS[2:]), 1)
    rng = np.random.default_rng(4)
    big, small = _values((40, 6), rng), _values((6, 3), rng)
    program, _, got = run_einsum(memory_hosts, "ij,jk->ik", [big, small],
                                 [Sharding(mesh, ("x", None)), Sharding(far, (None, None))])
    assert np.array_equal(got, big @ small)
    assert {s.tensor for s in program.steps if s.kind == MOVE} == {program.tensors[1].name}
    assert not [s for s in program.steps if s.kind == REDUCE]
    assert program.tensor(program.tensors[-1].name).dst.mesh == mesh


def test_an_output_that_replaces_a_stored_tensor_of_its_name_is_made_from_the_inputs_only(memory_hosts):
    """w = einsum(...) over an older w: the moves of the result read what the steps made, never the stored w."""
    mesh = Mesh.from_hosts({"x": 2}, list(HOSTS[:2]), 1)
    far = Mesh.from_hosts({"x": 2}, list(HOSTS[2:]), 1)
    a, b = _operands("ij,jk->ik", {"i": 6, "j": 4, "k": 5}, 9)
    k = next(_NAMES)
    inputs = [TensorDecl(f"a{k}", a.shape, "float64", Sharding(mesh, ("x", None))),
              TensorDecl(f"b{k}", b.shape, "float64", Sharding(mesh, (None, None)))]
    for x, d in zip((a, b), inputs):
        memory_hosts.put_tensor(d.name, x, d.src)
    memory_hosts.put_tensor(f"w{k}", np.full((6, 5), 99.0), Sharding(mesh, ("x", None)))  # the older w
    program = plan_einsum("ij,jk->ik", inputs, f"w{k}", Sharding(far, (None, "x")))
    assert any(s.kind == MOVE and s.tensor == f"w{k}" for s in program.steps)
    job, runs = memory_hosts.start(program.dumps(), f"w{k}")
    memory_hosts.finish(job, runs)
    assert np.array_equal(read_back(memory_hosts, f"w{k}", program.tensor(f"w{k}").dst, (6, 5)), a @ b)


def test_steps_wait_for_what_they_read():
    """A compute step waits for every move into its tiles; a reduce for every member's compute."""
    mesh = Mesh.from_hosts({"x": 2, "y": 2}, list(HOSTS[:2]), 2)
    a = TensorDecl("a", (6, 8), "float64", Sharding(mesh, ("x", "y")))
    b = TensorDecl("b", (8, 5), "float64", Sharding(mesh, (None, "x")))
    program = plan_einsum("ij,jk->ik", [a, b], "c")
    for s in program.steps:
        if s.kind == "compute" and s.kernel == "einsum":
            feeding = {m.id for m in program.steps if m.kind == MOVE and s.device in m.transfer.receivers}
            assert feeding <= set(s.after)
        if s.kind == REDUCE:
            members = {c.id for c in program.steps if c.kernel == "einsum" and c.device in s.devices}
            assert members <= set(s.after)


# -- the agents' kernels ------------------------------------------------------------------------------------


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


KERNEL_CASES = [
    # kernel, input shapes, params, reference
    ("einsum", [(3, 4), (4, 5)], {"equation": "ij,jk->ik"}, lambda a, b: a @ b),
    ("einsum", [(2, 3, 4), (2, 4, 5)], {"equation": "bij,bjk->bik"}, lambda a, b: a @ b),
    ("einsum", [(3,), (4,), (5,)], {"equation": "i,j,k->kij"}, lambda a, b, c: np.einsum("i,j,k->kij", a, b, c)),
    ("einsum", [(3, 0), (0, 5)], {"equation": "ij,jk->ik"}, lambda a, b: np.zeros((3, 5))),
    ("add", [(3, 4)] * 2, {}, np.add),
    ("sub", [(3, 4)] * 2, {}, np.subtract),
    ("mul", [(3, 4)] * 2, {}, np.multiply),
    ("scale", [(3, 4)], {"factor": "-0.5"}, lambda x: -0.5 * x),
    ("relu", [(3, 4)], {}, lambda x: np.maximum(x, 0)),
    ("relu_grad", [(3, 4)] * 2, {}, lambda x, g: np.where(x > 0, g, 0)),
    ("axpy", [(3, 4)] * 2, {"alpha": "0.25"}, lambda w, g: w - 0.25 * g),
    ("sum", [(3, 4, 5)], {"dims": "0,2"}, lambda x: x.sum(axis=(0, 2))),
    ("sum", [(3, 0)], {"dims": "1"}, lambda x: np.zeros(3)),
    ("max", [(3, 4, 5)], {"dims": "1"}, lambda x: x.max(axis=1)),
    ("max", [(3, 0)], {"dims": "1"}, lambda x: np.full(3, -np.inf)),
    ("softmax_xent", [(6, 5)] * 2, {}, lambda z, t: -(t * np.log(_softmax(z, 1))).sum(axis=1)),
    ("softmax_xent_grad", [(6, 5)] * 2, {"scale": "0.5"}, lambda z, t: 0.5 * (_softmax(z, 1) - t)),
    ("softmax_xent_grad", [(6, 5)] * 2, {"axis": "0"}, lambda z, t: _softmax(z, 0) - t),
    ("copy", [(3, 4)], {}, lambda x: x),
]


def _kernel_inputs(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kernel, shapes, params, reference", KERNEL_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(KERNEL_CASES)])
def test_kernels_compute_what_numpy_does(backend, kernel, shapes, params, reference):
    """numpy on CPU agents; torch where the buffers are torch tensors (CUDA agents: here on the CPU)."""
    from reshard.kernels import KERNELS as RULES
    from reshard.server.agent.kernels import KERNELS

    assert set(KERNELS) == set(RULES)  # every kernel the core accepts, the agents run
    xs = _kernel_inputs(shapes)
    want = np.asarray(reference(*xs), dtype=np.float64)
    assert want.shape == RULES[kernel].output_shape(tuple(shapes), params)
    out = np.full(want.shape, np.nan)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        xs, out = [torch.from_numpy(x) for x in xs], torch.from_numpy(out)
    KERNELS[kernel](xs, out, params)
    got = out.numpy() if backend == "torch" else out
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_cpu_agent_computes_bfloat16_tiles_in_float32_and_rounds_back():
    from reshard.server.agent.kernels import KERNELS

    torch = pytest.importorskip("torch")
    x = torch.tensor([[1.5, -2.25, 3.0], [0.1, 7.0, -0.5]], dtype=torch.bfloat16)
    bits = x.view(torch.int16).numpy().view(np.uint16)  # how a CPU agent holds bfloat16
    out = np.empty((3, 3), np.uint16)
    KERNELS["einsum"]([bits, bits], out, {"equation": "ij,ik->jk"})
    want = torch.einsum("ij,ik->jk", x.float(), x.float()).to(torch.bfloat16)
    assert np.array_equal(out, want.view(torch.int16).numpy().view(np.uint16))
