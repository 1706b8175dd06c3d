"""The program page's data and drawing (`server/dashboard/program_view.py`), from programs that `plan_einsum`,
`plan_apply` and `reshard_program` make, and the page itself: the dashboard app over an in-memory source, served
on a loopback port.

The stages must come in the order the steps run: an input that does not line up with the layout moves before the
compute reads it, and the reductions follow the compute in their ring groups. A program read back from JSON has
no layout, and must still cut into the same stages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import httpx
import pytest

from reshard import Mesh, Plan, Sharding, plan_apply, plan_einsum, reshard_program
from reshard.program import Program, TensorDecl
from reshard.server.planner.jobs import DURATION_BUCKETS, Durations
from reshard.server.dashboard.app import create_app
from reshard.server.dashboard.program_view import program_view
from reshard.server.dashboard.source import serve_app

MESH = Mesh.from_hosts({"x": 2, "y": 2}, ["h0", "h1"], 2)
OTHER = Mesh.from_hosts({"x": 2}, ["h2", "h3"], 1)
FLOAT = 4


def _matmul_moving_x() -> Program:
    """x is split over (x, y) but the layout wants its contracted dim h whole: x moves, w lines up."""
    return plan_einsum("bh,hk->bk", [TensorDecl("x", (8, 6), "float32", Sharding(MESH, ("x", "y"))),
                                     TensorDecl("w", (6, 4), "float32", Sharding(MESH, (None, "y")))], "out")


def _contraction_over_y() -> Program:
    """The contracted letter j is split over y: each device holds partial sums of the whole output."""
    return plan_einsum("ij,jk->ik", [TensorDecl("a", (8, 6), "float32", Sharding(MESH, (None, "x"))),
                                     TensorDecl("b", (6, 4), "float32", Sharding(MESH, ("y", None)))], "c")


def _kinds(view) -> list[tuple[str, str]]:
    return [(s.kind, s.tensor) for s in view.stages]


def test_an_input_that_does_not_line_up_moves_first_and_says_why():
    program = _matmul_moving_x()
    view = program_view(program)
    assert view.layout == "{b: x, k: y} on (x=2, y=2)" and (view.kernel, view.equation) == ("einsum", "bh,hk->bk")
    assert _kinds(view) == [("input", "x"), ("compute", "")]
    moves, compute = view.stages
    assert moves.reason == "does not line up with layout {b: x, k: y} on (x=2, y=2)"
    assert (moves.source, moves.target) == ("P('x', 'y') on (x=2, y=2)", "P('x', None) on (x=2, y=2)")
    assert dict(moves.tiles) == {"h0/0": "[0:4, 0:6]", "h0/1": "[0:4, 0:6]", "h1/0": "[4:8, 0:6]",
                                 "h1/1": "[4:8, 0:6]"}
    # Each device gets the half of its rows it lacks from its neighbour on the same host, and copies the other.
    assert sorted((m.sender, m.receivers) for m in moves.moves) == [
        ("h0/0", ("h0/1",)), ("h0/1", ("h0/0",)), ("h1/0", ("h1/1",)), ("h1/1", ("h1/0",))]
    assert len(moves.copies) == 4 and moves.network_bytes == 0 and moves.local_bytes == 4 * 4 * 3 * FLOAT
    assert moves.finish <= compute.start
    assert view.in_place == (("w", "P(None, 'y') on (x=2, y=2)", "every device already holds its tile of layout "
                              "{b: x, k: y} on (x=2, y=2): read where it is, nothing moves"),)
    assert [(c.device, c.shape) for c in compute.computes] == [("h0/0", (4, 2)), ("h0/1", (4, 2)), ("h1/0", (4, 2)),
                                                               ("h1/1", (4, 2))]
    assert all(dict(c.params) == {"equation": "bh,hk->bk"} for c in compute.computes)
    assert view.host_bytes == program.host_bytes()
    assert view.estimate == pytest.approx(program.estimate_seconds)


def test_reductions_show_their_ring_groups_and_bytes_per_member():
    view = program_view(_contraction_over_y())
    assert _kinds(view) == [("input", "a"), ("compute", ""), ("reduce", "c~partial")]
    reduce = view.stages[2]
    assert reduce.title == "sum all-reduce (ring) over 2 group(s) of 2"
    assert "devices that differ only in axes y hold partial sums" in reduce.reason
    assert [g.devices for g in reduce.groups] == [("h0/0", "h0/1"), ("h1/0", "h1/1")]
    # A ring all-reduce of 2 members: each sends 2(n-1)/n of the 8x4 box, that is all of it.
    assert all(g.bytes_held == 8 * 4 * FLOAT and g.bytes_sent == (8 * 4 * FLOAT,) * 2 for g in reduce.groups)
    svg = view.stages_svg()
    groups = re.findall(r'<g class="group" data-step="(\d+)" data-devices="([^"]+)"', svg)
    assert [d for _, d in groups] == ["h0/0,h0/1", "h1/0,h1/1"]
    assert re.findall(r'class="cell reduce" data-device="([^"]+)"', svg) == ["h0/0", "h0/1", "h1/0", "h1/1"]
    assert len(re.findall(r'class="cell compute"', svg)) == 4
    arrows = re.findall(r'class="arrow" data-step="\d+" data-from="([^"]+)" data-to="([^"]+)"', svg)
    assert sorted(arrows) == sorted((m.sender, r) for m in view.stages[0].moves for r in m.receivers)


def test_a_result_reduce_scattered_then_moved_into_out_sharding():
    program = plan_einsum("ij,jk->ik", [TensorDecl("a", (8, 6), "float32", Sharding(MESH, (None, "x"))),
                                        TensorDecl("b", (6, 4), "float32", Sharding(MESH, ("x", None)))], "c",
                          Sharding(OTHER, ("x", None)))
    view = program_view(program)
    assert _kinds(view) == [("compute", ""), ("reduce", "c~partial"), ("move", "c")]
    reduce, move = view.stages[1:]
    assert reduce.title.startswith("sum reduce-scatter along dim 0 (ring)")
    assert all(g.bytes_sent == (4 * 4 * FLOAT,) * 2 for g in reduce.groups)  # (n-1)/n of the 8x4 box
    assert move.reason == ("out_sharding P('x', None) on (x=2) is not where layout {j: x} on (x=2, y=2) leaves it: "
                           "the result moves after its reduction")
    assert move.source.startswith("c (result), as steps ") and move.target == "P('x', None) on (x=2)"
    assert dict(move.tiles) == {"h2/0": "[0:4, 0:4]", "h3/0": "[4:8, 0:4]"}
    assert move.network_bytes == 2 * 4 * 4 * FLOAT and reduce.finish <= move.start
    assert [t for t, _, _ in view.in_place] == ["a", "b"]


def test_a_partial_input_summed_before_the_compute():
    program = plan_einsum("ij,jk->ik", [TensorDecl("a", (8, 6), "float32", Sharding(MESH, (None, "x"), partial=("y",))),
                                        TensorDecl("b", (6, 4), "float32", Sharding(MESH, ("x", None)))], "c")
    view = program_view(program)
    assert _kinds(view)[0] == ("sum", "a") and ("compute", "") in _kinds(view)
    summed = view.stages[0]
    assert summed.title == "Sum Partial input a" and "summed over axes y before the local einsum" in summed.reason
    assert [g.devices for g in summed.groups] == [("h0/0", "h0/1"), ("h1/0", "h1/1")]


def test_apply_moves_the_input_whose_layout_conflicts():
    program = plan_apply("add", [TensorDecl("a", (8, 6), "float32", Sharding(MESH, ("x", "y"))),
                                 TensorDecl("b", (8, 6), "float32", Sharding(MESH, ("y", "x")))], "c")
    view = program_view(program)
    assert _kinds(view) == [("input", "b"), ("compute", "")]
    assert view.stages[0].target == "P('x', 'y') on (x=2, y=2)" and view.stages[0].source == "P('y', 'x') on (x=2, y=2)"
    assert view.stages[1].title == "Local add on 4 devices"
    assert [t for t, _, _ in view.in_place] == ["a"]


def test_a_partial_tensors_reshard_is_reductions_then_moves():
    program = reshard_program((8, 6), "float32", Sharding(MESH, (None, "x"), partial=("y",)),
                              Sharding(OTHER, ("x", None)))
    view = program_view(program)
    assert [s.kind for s in view.stages] == ["reduce", "move"]
    assert view.stages[1].reason == "the reduced values move into the destination sharding P('x', None) on (x=2)"
    assert view.kernel == "" and view.in_place == ()


def test_a_program_read_back_from_json_cuts_into_the_same_stages():
    program = _contraction_over_y()
    fresh, read = program_view(program), program_view(Program.from_json(program.dumps()))
    assert read.layout is None
    assert _kinds(read) == _kinds(fresh)
    assert [s.groups for s in read.stages] == [s.groups for s in fresh.stages]
    assert read.stages[0].reason == "its tiles are not the tiles the compute steps read" and read.stages[0].target == ""


# -- the page, served by the app over an in-memory source ----------------------------------------------------


class _Source:
    """A `DashboardSource` holding some programs and one job that ran the first of them."""

    def __init__(self, programs: list[Program], plans: list[Plan] = ()):
        self.programs = {p.id: p for p in programs}
        self.plans = {p.id: p for p in plans}
        first = programs[0].id
        self.job_doc = {"id": "job1", "tensor": "out", "state": "succeeded", "strategy": "auto", "kind": "einsum",
                        "inputs": ["x", "w"], "bytes_done": 1, "bytes_total": 1, "seconds": 0.1, "started": 1.0,
                        "error": None, "plan_id": first, "program_id": first, "transports": []}

    def agents(self) -> list[dict]:
        return []

    def tensors(self) -> list[dict]:
        return []

    def jobs(self, limit: Optional[int] = None) -> list[dict]:
        return [self.job_doc][:limit]

    def job_count(self) -> int:
        return 1

    def job_states(self) -> dict[str, int]:
        return {"succeeded": 1}

    def job_durations(self) -> Durations:
        return Durations([0, 0, 1] + [1] * (len(DURATION_BUCKETS) - 3), 1, 0.1)

    def job(self, job_id: str) -> Optional[dict]:
        return self.job_doc if job_id == "job1" else None

    def plan(self, plan_id: str) -> Optional[Plan]:
        return self.plans.get(plan_id)

    def program(self, program_id: str) -> Optional[Program]:
        return self.programs.get(program_id)

    def job_transfer_transports(self, job_id: str) -> list[str]:
        return []

    def bytes_moved(self) -> dict[str, int]:
        return {}

    def max_plan_tasks(self) -> int:
        return 250_000


TOKEN = "t0ken"


@dataclass
class _Web:
    client: httpx.Client
    source: _Source
    odd: Program  # names that HTML would read as tags

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(path, **kw)


@pytest.fixture()
def web():
    odd = plan_einsum("bh,hk->bk", [TensorDecl("<b>x&", (8, 6), "float32", Sharding(MESH, ("x", "y"))),
                                    TensorDecl("w", (6, 4), "float32", Sharding(MESH, (None, "y")))], "<i>out")
    source = _Source([_contraction_over_y(), odd])
    server, port = serve_app(create_app(source, TOKEN), "127.0.0.1:0")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as client:
            yield _Web(client, source, odd)
    finally:
        server.should_exit = True


def test_the_page_draws_the_stages_and_the_api_gives_them(web):
    program = next(iter(web.source.programs.values()))
    page = web.get(f"/programs/{program.id}")
    assert page.status_code == 200
    html = page.text
    assert re.findall(r'<li class="stage" data-kind="(\w+)"', html) == ["input", "compute", "reduce"]
    assert 'class="stages"' in html and 'class="timeline"' in html
    assert 'data-devices="h0/0,h0/1"' in html and "does not line up with layout {j: y} on (x=2, y=2)" in html
    spans = set(re.findall(r'class="span" data-step="\d+" data-kind="(\w+)"', html))
    assert spans == {"move", "compute", "reduce"}
    doc = web.get(f"/api/programs/{program.id}").json()
    assert doc["id"] == program.id and Program.from_json(doc["program"]).id == program.id
    assert [s["kind"] for s in doc["stages"]] == ["input", "compute", "reduce"]
    assert [g["devices"] for g in doc["stages"][2]["groups"]] == [["h0/0", "h0/1"], ["h1/0", "h1/1"]]
    assert web.get("/api/programs/nope").status_code == 404 and web.get("/programs/nope").status_code == 404
    job = web.get("/jobs/job1").text
    assert f'<a class="program-link" href="/programs/{program.id}">' in job and "einsum of x, w" in job


def test_the_page_escapes_names(web):
    html = web.get(f"/programs/{web.odd.id}").text
    assert "<b>x" not in html and "<i>out" not in html
    assert "&lt;b&gt;x&amp;" in html and "&lt;i&gt;out" in html


def test_pages_need_the_token_and_a_plan_id_sends_a_program_to_its_page(web):
    program = next(iter(web.source.programs.values()))
    for path in (f"/programs/{program.id}", f"/api/programs/{program.id}"):
        assert web.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    moved = web.get(f"/plans/{program.id}", follow_redirects=False)
    assert moved.status_code == 303 and moved.headers["location"] == f"/programs/{program.id}"
    assert f"/api/programs/{program.id}" in web.get(f"/api/plans/{program.id}").json()["detail"]


def test_the_jobs_page_lists_the_newest_jobs_and_says_how_many_are_kept(web, monkeypatch):
    from reshard.server.dashboard import resources as app_module

    docs = [{**web.source.job_doc, "id": f"job{i}"} for i in range(1, 4)]
    monkeypatch.setattr(web.source, "jobs", lambda limit=None: docs[:limit])
    monkeypatch.setattr(web.source, "job_count", lambda: len(docs))
    monkeypatch.setattr(app_module, "JOBS_PAGE", 2)
    html = web.get("/jobs").text
    assert "The newest 2 of the 3 jobs the planner keeps" in html
    assert "/jobs/job1" in html and "/jobs/job2" in html and "/jobs/job3" not in html
    assert [j["id"] for j in web.get("/api/jobs").json()] == ["job1", "job2", "job3"]  # the API gives every one
    monkeypatch.setattr(app_module, "JOBS_PAGE", 5)
    assert "The newest" not in web.get("/jobs").text  # all of them fit: no line


def test_metrics_take_job_states_and_the_duration_histogram_from_the_runner_not_the_kept_jobs(web, monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setattr(web.source, "jobs", lambda limit=None: pytest.fail("a scrape built every job's document"))
    monkeypatch.setattr(web.source, "job_states", lambda: {"succeeded": 7, "running": 2})
    counts = [i for i in range(len(DURATION_BUCKETS))]
    monkeypatch.setattr(web.source, "job_durations", lambda: Durations(counts, 40, 123.5))
    families = {f.name: f for f in text_string_to_metric_families(web.get("/metrics").text)}
    assert {s.labels["state"]: s.value for s in families["reshard_jobs"].samples} == {"succeeded": 7, "running": 2}
    hist = {(s.name, s.labels.get("le")): s.value for s in families["reshard_job_duration_seconds"].samples}
    assert [hist[("reshard_job_duration_seconds_bucket", str(float(le)))] for le in DURATION_BUCKETS] == counts
    assert hist[("reshard_job_duration_seconds_bucket", "+Inf")] == 40
    assert hist[("reshard_job_duration_seconds_count", None)] == 40
    assert hist[("reshard_job_duration_seconds_sum", None)] == 123.5
