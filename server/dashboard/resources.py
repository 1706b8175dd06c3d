"""The dashboard's routes of the planner's resources: cluster, tensors, jobs, plans and programs, each
resource's JSON (under ``/api``) and its page side by side in one router.

`create_app` (``server.dashboard.app``) includes every router behind the token guard.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from reshard.server.dashboard.plan_view import plan_view
from reshard.server.dashboard.program_view import program_view
from reshard.server.dashboard.shared import DashboardSource, job_view, render
from reshard.server.planner.jobs import JOBS_KEPT

__all__ = ["cluster_router", "tensors_router", "jobs_router", "plans_router", "programs_router", "JOBS_PAGE"]

JOBS_PAGE = 500  # the jobs page lists the newest jobs, this many; /api/jobs returns every one the planner keeps


def cluster_router(source: DashboardSource) -> APIRouter:
    """``/api/cluster`` and the front page, which shows the agents with the tensors and the newest jobs."""
    router = APIRouter()

    @router.get("/api/cluster", tags=["api"], summary="Agents, their devices and health")
    def api_cluster() -> list[dict[str, Any]]:
        return source.agents()

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        return render(request, "cluster.html", agents=source.agents(), tensors=source.tensors(),
                      jobs=[job_view(j) for j in source.jobs(limit=10)])

    return router


def tensors_router(source: DashboardSource) -> APIRouter:
    """``/api/tensors`` and ``/tensors``: the catalog."""
    router = APIRouter()

    @router.get("/api/tensors", tags=["api"], summary="Tensors in the catalog")
    def api_tensors() -> list[dict[str, Any]]:
        return source.tensors()

    @router.get("/tensors", response_class=HTMLResponse, include_in_schema=False)
    def tensors_page(request: Request):
        return render(request, "tensors.html", tensors=source.tensors())

    return router


def jobs_router(source: DashboardSource) -> APIRouter:
    """``/api/jobs``, ``/jobs`` and one job's, its page drawing the plan or the program it ran."""
    router = APIRouter()

    @router.get("/api/jobs", tags=["api"], summary="Reshard jobs, newest first")
    def api_jobs() -> list[dict[str, Any]]:
        return [job_view(j) for j in source.jobs()]

    @router.get("/api/jobs/{job_id}", tags=["api"], summary="One job")
    def api_job(job_id: str) -> dict[str, Any]:
        return job_view(_job(source, job_id))

    @router.get("/jobs", response_class=HTMLResponse, include_in_schema=False)
    def jobs_page(request: Request):
        return render(request, "jobs.html", jobs=[job_view(j) for j in source.jobs(limit=JOBS_PAGE)],
                      total=source.job_count(), kept=JOBS_KEPT)

    @router.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(request: Request, job_id: str):
        job = _job(source, job_id)
        if job.get("program_id"):
            return render(request, "plan.html", job=job_view(job), view=None,
                          program=source.program(job["program_id"]))
        p = source.plan(job["plan_id"]) if job.get("plan_id") else None
        measured = job.get("seconds") if job.get("state") == "succeeded" else None
        return render(request, "plan.html", job=job_view(job), view=plan_view(p, measured) if p else None,
                      carried_by=source.job_transfer_transports(job_id))

    return router


def _job(source: DashboardSource, job_id: str) -> dict:
    job = source.job(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job


def plans_router(source: DashboardSource) -> APIRouter:
    """One plan's JSON and page; an id that names a program points there."""
    router = APIRouter()

    @router.get("/api/plans/{plan_id}", tags=["api"], summary="A plan as JSON")
    def api_plan(plan_id: str) -> dict[str, Any]:
        p = source.plan(plan_id)
        if p is None:
            also = f"; it is a program: /api/programs/{plan_id}" if source.program(plan_id) is not None else ""
            raise HTTPException(404, f"no plan {plan_id!r}{also}")
        return p.to_json()

    @router.get("/plans/{plan_id}", response_class=HTMLResponse, include_in_schema=False)
    def plan_page(request: Request, plan_id: str):
        p = source.plan(plan_id)
        if p is None:
            if source.program(plan_id) is not None:
                return RedirectResponse(f"/programs/{plan_id}", status_code=303)
            raise HTTPException(404, f"no plan {plan_id!r}")
        return render(request, "plan.html", job=None, view=plan_view(p))

    return router


def programs_router(source: DashboardSource) -> APIRouter:
    """One program's JSON (with its stages, step estimates and bytes per host) and page."""
    router = APIRouter()

    @router.get("/api/programs/{program_id}", tags=["api"],
                summary="A program as JSON, with its stages, step estimates and bytes per host")
    def api_program(program_id: str) -> dict[str, Any]:
        return program_view(_program(source, program_id)).to_json()

    @router.get("/programs/{program_id}", response_class=HTMLResponse, include_in_schema=False)
    def program_page(request: Request, program_id: str):
        return render(request, "program.html", view=program_view(_program(source, program_id)))

    return router


def _program(source: DashboardSource, program_id: str):
    p = source.program(program_id)
    if p is None:
        raise HTTPException(404, f"no program {program_id!r}")
    return p
