"""The admin dashboard: cluster, tensors, jobs, transfer plans and programs, as pages and as JSON.

Served by the planner process (``reshard planner --http ADDR``). Pages are rendered
on the server (Jinja2, inline SVG); the JSON under ``/api`` is described by the
generated OpenAPI document; ``/metrics`` speaks Prometheus. No GET changes state.

Access: when a token is configured, every request needs it, as
``Authorization: Bearer TOKEN``, the ``reshard_admin`` cookie, or once as
``/login?token=TOKEN`` (which sets the cookie and redirects). A browser without it
gets a login page (`login`); anything else a bare 401.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.templating import Jinja2Templates
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from reshard import Plan, Sharding, STRATEGIES, plan as make_plan
from reshard.program import Program
from reshard.plan_command import parse_mesh, parse_shape, parse_spec
from reshard.errors import ReshardError
from reshard.server.common.sizes import format_size
from reshard.server.dashboard.login import COOKIE, install_login
from reshard.server.dashboard.pipeline_view import pipeline_router
from reshard.server.dashboard.plan_view import plan_view
from reshard.server.dashboard.program_view import program_view
from reshard.server.planner.control import check_plan_size
from reshard.server.planner.jobs import DURATION_BUCKETS, JOBS_KEPT, Durations

log = logging.getLogger(__name__)

__all__ = ["DashboardSource", "create_app", "COOKIE"]

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


TEMPLATES.env.filters["bytes"] = lambda n: format_size(n or 0)
JOBS_PAGE = 500  # the jobs page lists the newest jobs, this many; /api/jobs returns every one the planner keeps


class DashboardSource(Protocol):
    """What the dashboard reads from the planner. Each method returns plain data."""

    def agents(self) -> list[dict]:
        """host, address, num_devices, devices, up, heartbeat_age_s, bytes_held, transport, memory_used_bytes,
        memory_limit_bytes (0: not reported)"""

    def tensors(self) -> list[dict]:
        """name, shape, dtype, sharding (str), spec, version, nbytes, bytes_per_host, lost (some tile has no copy
        left), lost_devices, lost_tiles ({tile, devices} per tile with no copy left)"""

    def jobs(self, limit: Optional[int] = None) -> list[dict]:
        """Newest first, at most ``limit`` (None: every job the planner keeps): id, tensor, state, strategy,
        bytes_done, bytes_total, seconds, started, error, plan_id, transports, kind ("reshard", "einsum" or an
        apply's kernel), inputs, program_id (the program the job runs, once planned, where that is no plan of moves:
        a compute job, a Partial tensor's reshard; else None), phases ({phase: seconds} in `PHASES` order, those it
        reached), host_seconds ({host: seconds of its Execute call})"""

    def job_count(self) -> int:
        """How many jobs the planner keeps (the last `JOBS_KEPT` finished ones and every one in flight)."""

    def job_states(self) -> dict[str, int]:
        """How many of the jobs the planner keeps are in each state."""

    def job_durations(self) -> Durations:
        """The durations of every job that succeeded since the planner started, as a cumulative histogram."""

    def job(self, job_id: str) -> Optional[dict]:
        ...

    def plan(self, plan_id: str) -> Optional[Plan]:
        """None also where the id names a program."""

    def program(self, program_id: str) -> Optional[Program]:
        """A job's program or a dry run's; None also where the id names a plan."""

    def job_transfer_transports(self, job_id: str) -> list[str]:
        """Per transfer of the job's plan, the transport that carried it (grpc, collective or local)."""

    def bytes_moved(self) -> dict[str, int]:
        """Bytes moved so far, by transport name."""

    def max_plan_tasks(self) -> int:
        """The planner's limit on plan size (``--max-plan-tasks``): what-if plans are held to it too."""


def _auth(token: Optional[str]) -> Callable:
    def check(request: Request) -> None:
        if token is None:
            return
        given = request.cookies.get(COOKIE)
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            given = header[7:].strip()
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status_code=401, detail="unauthorized")

    return check


def _job_view(job: dict) -> dict:
    done, total = job.get("bytes_done", 0), job.get("bytes_total", 0)
    secs = job.get("seconds") or 0.0
    return {
        **job,
        "percent": 100.0 * done / total if total else (100.0 if job.get("state") == "succeeded" else 0.0),
        "gbps": total * 8 / secs / 1e9 if secs and job.get("state") == "succeeded" else None,
    }


def create_app(source: DashboardSource, token: Optional[str] = None) -> FastAPI:
    # FastAPI's own documentation routes would skip the token check; they are added below, guarded.
    app = FastAPI(title="reshard admin", version="1", description="Cluster, tensors, jobs and transfer plans.",
                  docs_url=None, redoc_url=None, openapi_url=None)
    guard = [Depends(_auth(token))]

    @app.get("/openapi.json", dependencies=guard, include_in_schema=False)
    def openapi() -> dict:
        return app.openapi()

    @app.get("/docs", dependencies=guard, include_in_schema=False)
    def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="reshard admin API")

    install_login(app, TEMPLATES, token)

    # -- JSON -----------------------------------------------------------------------------

    @app.get("/api/cluster", dependencies=guard, tags=["api"], summary="Agents, their devices and health")
    def api_cluster() -> list[dict[str, Any]]:
        return source.agents()

    @app.get("/api/tensors", dependencies=guard, tags=["api"], summary="Tensors in the catalog")
    def api_tensors() -> list[dict[str, Any]]:
        return source.tensors()

    @app.get("/api/jobs", dependencies=guard, tags=["api"], summary="Reshard jobs, newest first")
    def api_jobs() -> list[dict[str, Any]]:
        return [_job_view(j) for j in source.jobs()]

    @app.get("/api/jobs/{job_id}", dependencies=guard, tags=["api"], summary="One job")
    def api_job(job_id: str) -> dict[str, Any]:
        job = source.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return _job_view(job)

    @app.get("/api/plans/{plan_id}", dependencies=guard, tags=["api"], summary="A plan as JSON")
    def api_plan(plan_id: str) -> dict[str, Any]:
        p = source.plan(plan_id)
        if p is None:
            also = f"; it is a program: /api/programs/{plan_id}" if source.program(plan_id) is not None else ""
            raise HTTPException(404, f"no plan {plan_id!r}{also}")
        return p.to_json()

    @app.get("/api/programs/{program_id}", dependencies=guard, tags=["api"],
             summary="A program as JSON, with its stages, step estimates and bytes per host")
    def api_program(program_id: str) -> dict[str, Any]:
        p = source.program(program_id)
        if p is None:
            raise HTTPException(404, f"no program {program_id!r}")
        return program_view(p).to_json()

    @app.get("/api/whatif", dependencies=guard, tags=["api"], summary="Plans of every strategy; moves no data")
    def api_whatif(shape: str, src: str, src_spec: str, dst: str, dst_spec: str, dtype: str = "float32",
                   nic_gbps: float = 10.0) -> list[dict[str, Any]]:
        return [p.to_json() for p in _whatif(shape, dtype, src, src_spec, dst, dst_spec, nic_gbps,
                                             source.max_plan_tasks())]

    # -- pages ------------------------------------------------------------------------------

    def page(request: Request, name: str, **ctx) -> HTMLResponse:
        # Pages showing a job still in flight reload themselves every two seconds.
        if any(j.get("state") in ("queued", "running") for j in ctx.get("jobs", []) + [ctx.get("job") or {}]):
            ctx["refresh"] = 2
        return TEMPLATES.TemplateResponse(request, name, ctx)

    @app.get("/", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        return page(request, "cluster.html", agents=source.agents(), tensors=source.tensors(),
                    jobs=[_job_view(j) for j in source.jobs(limit=10)])

    @app.get("/tensors", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def tensors_page(request: Request):
        return page(request, "tensors.html", tensors=source.tensors())

    @app.get("/jobs", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def jobs_page(request: Request):
        return page(request, "jobs.html", jobs=[_job_view(j) for j in source.jobs(limit=JOBS_PAGE)],
                    total=source.job_count(), kept=JOBS_KEPT)

    @app.get("/jobs/{job_id}", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def job_page(request: Request, job_id: str):
        job = source.job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        if job.get("program_id"):
            return page(request, "plan.html", job=_job_view(job), view=None, program=source.program(job["program_id"]))
        p = source.plan(job["plan_id"]) if job.get("plan_id") else None
        measured = job.get("seconds") if job.get("state") == "succeeded" else None
        return page(request, "plan.html", job=_job_view(job), view=plan_view(p, measured) if p else None,
                    carried_by=source.job_transfer_transports(job_id))

    @app.get("/plans/{plan_id}", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def plan_page(request: Request, plan_id: str):
        p = source.plan(plan_id)
        if p is None:
            if source.program(plan_id) is not None:
                return RedirectResponse(f"/programs/{plan_id}", status_code=303)
            raise HTTPException(404, f"no plan {plan_id!r}")
        return page(request, "plan.html", job=None, view=plan_view(p))

    @app.get("/programs/{program_id}", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def program_page(request: Request, program_id: str):
        p = source.program(program_id)
        if p is None:
            raise HTTPException(404, f"no program {program_id!r}")
        return page(request, "program.html", view=program_view(p))

    @app.get("/whatif", dependencies=guard, response_class=HTMLResponse, include_in_schema=False)
    def whatif_page(request: Request, shape: str = "", src: str = "", src_spec: str = "", dst: str = "",
                    dst_spec: str = "", dtype: str = "float32", nic_gbps: float = 10.0):
        form = dict(shape=shape, src=src, src_spec=src_spec, dst=dst, dst_spec=dst_spec, dtype=dtype, nic_gbps=nic_gbps)
        views, error = [], None
        if shape:
            try:
                views = [plan_view(p) for p in _whatif(shape, dtype, src, src_spec, dst, dst_spec, nic_gbps,
                                                       source.max_plan_tasks())]
            except HTTPException as e:
                error = e.detail
        return page(request, "whatif.html", form=form, views=views, error=error)

    app.include_router(pipeline_router(guard))

    # -- metrics ------------------------------------------------------------------------------

    @app.get("/metrics", dependencies=guard, response_class=PlainTextResponse, include_in_schema=False)
    def metrics():
        registry = CollectorRegistry()
        registry.register(_Collector(source))
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app


def _whatif(shape: str, dtype: str, src: str, src_spec: str, dst: str, dst_spec: str, nic_gbps: float,
            max_plan_tasks: int) -> list[Plan]:
    from reshard import Topology

    try:
        s = Sharding(parse_mesh(src, "src"), parse_spec(src_spec))
        d = Sharding(parse_mesh(dst, "dst"), parse_spec(dst_spec))
        topo = Topology(nic_gbps=nic_gbps)
        dims = parse_shape(shape)
        for name in STRATEGIES:
            check_plan_size(dims, s, d, name, max_plan_tasks, f"planning shape {dims} with strategy {name}")
        return [make_plan(dims, dtype, s, d, topo, name) for name in STRATEGIES]
    except ReshardError as e:
        raise HTTPException(status_code=422, detail=str(e)) from None


class _Collector:
    """Reads the planner's figures at scrape time, so nothing is counted twice."""

    def __init__(self, source: DashboardSource):
        self.source = source

    def collect(self):
        moved = CounterMetricFamily("reshard_bytes_moved", "Bytes moved by reshard jobs, by transport", labels=["transport"])
        for transport, n in sorted(self.source.bytes_moved().items()):
            moved.add_metric([transport], n)
        yield moved
        states = GaugeMetricFamily("reshard_jobs", f"Jobs the planner keeps (every one in flight, the last "
                                   f"{JOBS_KEPT:,} finished), by state", labels=["state"])
        for state, n in sorted(self.source.job_states().items()):
            states.add_metric([state], n)
        yield states
        d = self.source.job_durations()
        hist = HistogramMetricFamily("reshard_job_duration_seconds", "Duration of the jobs that succeeded since the "
                                     "planner started")
        buckets = [(floatToGoString(le), n) for le, n in zip(DURATION_BUCKETS, d.counts)]
        hist.add_metric([], [*buckets, ("+Inf", d.count)], d.total_s)
        yield hist
        agents = self.source.agents()
        up = GaugeMetricFamily("reshard_agents_up", "Agents whose heartbeats are current")
        up.add_metric([], sum(1 for a in agents if a.get("up")))
        yield up
