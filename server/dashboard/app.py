"""The admin dashboard's app: every resource's router (cluster, tensors, jobs, plans, programs, what-if, pipeline,
metrics) and the documentation, behind one token guard, as pages and as JSON.

Served by the planner process (``reshard planner --http ADDR``). Pages are rendered
on the server (Jinja2, inline SVG); the JSON under ``/api`` is described by the
generated OpenAPI document; ``/metrics`` speaks Prometheus. No GET changes state.
Each resource's JSON and page sit side by side in its router (`resources`, `whatif`,
`metrics`, `pipeline_view`); this module only assembles them.

Access: when a token is configured, every request needs it, as
``Authorization: Bearer TOKEN``, the ``reshard_admin`` cookie, or once as
``/login?token=TOKEN`` (which sets the cookie and redirects). A browser without it
gets a login page (`login`); anything else a bare 401. The guard is added where
each router is included, so a route cannot be added without it; only ``/login``
is open.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Optional

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html

from reshard.server.dashboard.login import COOKIE, install_login
from reshard.server.dashboard.metrics import metrics_router
from reshard.server.dashboard.pipeline_view import pipeline_router
from reshard.server.dashboard.resources import (cluster_router, jobs_router, plans_router, programs_router,
                                                tensors_router)
from reshard.server.dashboard.shared import TEMPLATES, DashboardSource
from reshard.server.dashboard.whatif import whatif_router

__all__ = ["DashboardSource", "create_app", "COOKIE"]


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
    # In this order the OpenAPI document lists the API as it always has: cluster, tensors, jobs, plans, programs,
    # what-if, pipeline.
    for router in (cluster_router(source), tensors_router(source), jobs_router(source), plans_router(source),
                   programs_router(source), whatif_router(source), pipeline_router(()), metrics_router(source)):
        app.include_router(router, dependencies=guard)
    return app
