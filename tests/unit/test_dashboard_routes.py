"""Every dashboard route answers only with the token: the app over an in-memory source, served on loopback, each
route it declares (JSON, pages, documentation, metrics, pipeline) asked without it, with a wrong one and with it."""

from __future__ import annotations

import re
from typing import Optional

import httpx
import pytest
from fastapi.routing import APIRoute

from reshard.server.dashboard.app import create_app
from reshard.server.dashboard.source import serve_app
from reshard.server.planner.jobs import DURATION_BUCKETS, Durations

TOKEN = "t0ken"
OPEN = {("GET", "/login"), ("POST", "/login")}  # how a browser logs in: open by design
GUARDED = {("GET", p) for p in ("/api/cluster", "/api/tensors", "/api/jobs", "/api/jobs/{job_id}",
                                "/api/plans/{plan_id}", "/api/programs/{program_id}", "/api/whatif", "/api/pipeline",
                                "/", "/tensors", "/jobs", "/jobs/{job_id}", "/plans/{plan_id}",
                                "/programs/{program_id}", "/whatif", "/pipeline", "/metrics", "/openapi.json", "/docs")}
GUARDED |= {("POST", "/api/pipeline"), ("POST", "/pipeline")}


class _Empty:
    """A `DashboardSource` of a planner with no agents, tensors or jobs."""

    def agents(self) -> list[dict]:
        return []

    def tensors(self) -> list[dict]:
        return []

    def jobs(self, limit: Optional[int] = None) -> list[dict]:
        return []

    def job_count(self) -> int:
        return 0

    def job_states(self) -> dict[str, int]:
        return {}

    def job_durations(self) -> Durations:
        return Durations([0] * len(DURATION_BUCKETS), 0, 0.0)

    def job(self, job_id: str):
        return None

    def plan(self, plan_id: str):
        return None

    def program(self, program_id: str):
        return None

    def job_transfer_transports(self, job_id: str) -> list[str]:
        return []

    def bytes_moved(self) -> dict[str, int]:
        return {}

    def max_plan_tasks(self) -> int:
        return 1000


def _routes(routes) -> list[APIRoute]:
    """Every route of ``routes``, into included routers (FastAPI keeps an included router whole as one entry)."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None)
        if inner is not None:
            out += _routes(inner.routes)
        else:
            assert isinstance(r, APIRoute), f"a route the dashboard cannot check: {r!r}"
            out.append(r)
    return out


@pytest.fixture(scope="module")
def served():
    app = create_app(_Empty(), TOKEN)
    server, port = serve_app(app, "127.0.0.1:0")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield app, client
    finally:
        server.should_exit = True


def test_every_route_but_the_login_needs_the_token(served):
    app, client = served
    declared = {(m, r.path): r for r in _routes(app.routes) for m in r.methods}
    assert set(declared) == GUARDED | OPEN
    for method, path in sorted(GUARDED):
        url = re.sub(r"\{\w+\}", "nope", path)
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Cookie": "reshard_admin=not-the-token"}):
            r = client.request(method, url, headers=headers)
            assert r.status_code == 401 and r.json() == {"detail": "unauthorized"}, (method, path, headers)
        # A browser gets the login page instead, still 401.
        page = client.request(method, url, headers={"Accept": "text/html"})
        assert page.status_code == 401, (method, path)
        # With the token the route itself answers: a page, a 404 for the made-up id, a 422 for missing fields.
        right = client.request(method, url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert right.status_code in (200, 404, 422), (method, path, right.status_code, right.text[:200])
        if right.status_code == 404:
            assert right.json() == {"detail": f"no {path.split('/')[-2].rstrip('s')} 'nope'"}, (method, path)
    assert client.get("/login", params={"token": TOKEN}, follow_redirects=False).status_code == 303


def test_a_running_sync_s_page_reads_its_delta_report_once_while_the_report_grows():
    """The delta report fills a running sync's ``deltas`` on a thread of its own (`JobRunner._delta_report`): the
    job's document copies it once, not iterating the dict the report adds to (which raises)."""
    from reshard.server.dashboard.source import _job_doc
    from reshard.server.planner.jobs import Job

    class Reporting(dict):
        def items(self):  # the report adds a tensor while the page reads it, as its thread does
            for n, d in super().items():
                self.setdefault("late", {"mode": "full", "why": "later", "bytes": 1, "full_bytes": 1, "expected": 1})
                yield n, d

    job = Job("d" * 32, "w", None, "auto", state="running", kind="reshard_many", inputs=["w"],
              deltas=Reporting(w={"mode": "delta", "why": "base v1 -> v2", "bytes": 3, "full_bytes": 9,
                                  "expected": 3}))
    doc = _job_doc(job)
    assert [d["name"] for d in doc["deltas"]] == ["w"] and doc["deltas"][0]["bytes"] == 3
