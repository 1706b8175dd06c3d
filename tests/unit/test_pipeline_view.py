"""The pipeline page (`server/dashboard/pipeline_view.py`): a step's timeline as a Gantt chart, simulated from
the query or measured and posted, beside the simulator's prediction; served by the dashboard app over an
in-memory source on a loopback port."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from reshard import schedule
from reshard.schedule import Span, Timeline
from reshard.server.dashboard.app import create_app
from reshard.server.dashboard.pipeline_view import gantt_svg, pipeline_view, predicted_for
from reshard.server.dashboard.source import serve_app

from unit.test_program_view import _Source, _contraction_over_y

TOKEN = "t0ken"


@pytest.fixture(scope="module")
def web():
    server, port = serve_app(create_app(_Source([_contraction_over_y()]), TOKEN), "127.0.0.1:0")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as client:
            yield client
    finally:
        server.should_exit = True


def _measured() -> Timeline:
    """A made-up measured step: the simulator's 1F1B spans, stage 1 waiting before its first forward, updates."""
    sim = schedule.simulate("1f1b", 3, 4, 1.0, 2.0, 0.5)
    extra = (Span(1, "wait", 0, 0.0, 1.5), *(Span(i, "update", -1, sim.iteration_s, sim.iteration_s + 0.25)
                                             for i in range(3)))
    return Timeline("1f1b", 3, 4, sim.iteration_s + 0.25, sim.peak_activations, sim.spans + extra)


def _charts(html: str) -> list[str]:
    return re.findall(r'<div class="panel pipeline" data-kind="([\w-]+)"><h3>([^<]*)</h3>', html)


def test_the_page_simulates_every_schedule_from_the_query(web):
    page = web.get("/pipeline", params={"stages": 4, "microbatches": 16, "forward": 1, "backward": 2,
                                        "transfer": 1})
    assert page.status_code == 200
    want = {k: schedule.simulate(k, 4, 16, 1.0, 2.0, 1.0) for k in schedule.KINDS}
    assert [(k, t) for k, t in _charts(page.text)] == [
        (k, f"{k}, simulated: {want[k].iteration_s:.4g} s per step") for k in schedule.KINDS]
    ops = re.findall(r'<g class="span" data-stage="(\d)" data-op="([\w ]+)" data-microbatch="(-?\d+)">', page.text)
    assert len(ops) == 3 * (2 * 4 * 16 + 2 * 3 * 16)
    assert ops.count(("0", "F", "15")) == 3 and ops.count(("3", "send B", "0")) == 3
    doc = web.get("/api/pipeline", params={"transfer": "0.5,1,2"}).json()
    assert [d["timeline"]["iteration_s"] for d in doc] == [
        schedule.simulate(k, 4, 8, 1.0, 2.0, [0.5, 1.0, 2.0]).iteration_s for k in schedule.KINDS]
    assert [d["stages"][0]["peak_activations"] for d in doc] == [8, 4, 7]


def test_a_posted_step_is_drawn_beside_its_prediction(web):
    measured = _measured()
    page = web.post("/pipeline", content=json.dumps({"run": measured.to_json()}),
                    headers={"content-type": "application/json"})
    assert page.status_code == 200, page.text
    predicted = predicted_for(measured)
    assert _charts(page.text) == [
        ("1f1b", f"run: 1f1b, measured: {measured.iteration_s:.4g} s per step"),
        ("1f1b", f"run: 1f1b, simulated for the measured times: {predicted.iteration_s:.4g} s per step")]
    assert 'data-op="wait"' in page.text and 'data-op="update"' in page.text
    doc = web.post("/api/pipeline", content=json.dumps(measured.to_json())).json()
    assert len(doc) == 1
    assert Timeline.from_json(doc[0]["measured"]["timeline"]) == measured
    stage1 = doc[0]["measured"]["stages"][1]
    assert stage1["wait_s"] == 1.5 and stage1["compute_s"] == measured.seconds(1, "F") + measured.seconds(1, "B") + 0.25
    # The measured ops take the simulator's times, so the prediction is the simulation itself.
    assert doc[0]["predicted"]["timeline"]["iteration_s"] == schedule.simulate("1f1b", 3, 4, 1.0, 2.0, 0.5).iteration_s


@pytest.mark.parametrize("method, path, kw, message", [
    ("post", "/pipeline", {"content": "{"}, "pipeline timeline JSON"),
    ("post", "/api/pipeline", {"content": json.dumps({"kind": "1f1b"})}, "timeline lacks the field 'stages'"),
    ("post", "/api/pipeline", {"content": "[]"}, "post a timeline (Timeline.to_json()) or an object {name: timeline}"),
    ("get", "/pipeline", {"params": {"forward": "fast"}}, "forward='fast': give seconds"),
    ("get", "/api/pipeline", {"params": {"microbatches": 0}}, "microbatches is 0; a pipeline needs a positive"),
    ("get", "/api/pipeline", {"params": {"transfer": "1,2"}}, "transfer_s has 2 values; give one number or one per "
                                                               "boundary (3)"),
])
def test_bad_requests_say_why(web, method, path, kw, message):
    reply = getattr(web, method)(path, **kw)
    assert reply.status_code == 422 and message in reply.json()["detail"]


def test_the_page_needs_the_token(web):
    base = str(web.base_url).rstrip("/")
    assert httpx.get(base + "/pipeline").status_code == 401
    assert httpx.post(base + "/api/pipeline", content="{}").status_code == 401


def test_overlapping_transfers_get_lanes_of_their_own():
    # Stage 1 of 3 sends activations forward and gradients back; under 1F1B with slow links they overlap.
    sim = schedule.simulate("1f1b", 3, 4, 1.0, 1.0, 2.0)
    svg = gantt_svg(sim)
    rows = {float(y) for y in re.findall(r'data-stage="1" data-op="send [FB]" data-microbatch="\d"><title>[^<]*'
                                         r'</title><rect x="[\d.]+" y="([\d.]+)"', svg)}
    assert len(rows) == 2
    view = pipeline_view("1f1b", sim)
    assert [r["peak_activations"] for r in view.rows] == [3, 2, 1]
    assert view.rows[0]["idle_s"] == pytest.approx(sim.iteration_s - 8.0)


def test_the_api_routes_are_in_the_openapi_document(web):
    paths = web.get("/openapi.json").json()["paths"]
    assert set(paths["/api/pipeline"]) == {"get", "post"} and "/pipeline" not in paths
