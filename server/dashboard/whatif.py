"""The dashboard's what-if planner: the plan of every strategy for a shape and two layouts typed in, as JSON
(``/api/whatif``) and as a page (``/whatif``); it moves no data."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse

from reshard import Plan, Sharding, STRATEGIES, Topology, plan as make_plan
from reshard.errors import ReshardError
from reshard.plan_command import parse_mesh, parse_shape, parse_spec
from reshard.server.dashboard.plan_view import plan_view
from reshard.server.dashboard.shared import DashboardSource, render
from reshard.server.planner.control import check_plan_size

__all__ = ["whatif_router", "whatif_plans"]


def whatif_router(source: DashboardSource) -> APIRouter:
    router = APIRouter()

    @router.get("/api/whatif", tags=["api"], summary="Plans of every strategy; moves no data")
    def api_whatif(shape: str, src: str, src_spec: str, dst: str, dst_spec: str, dtype: str = "float32",
                   nic_gbps: float = 10.0) -> list[dict[str, Any]]:
        return [p.to_json() for p in whatif_plans(shape, dtype, src, src_spec, dst, dst_spec, nic_gbps,
                                                  source.max_plan_tasks())]

    @router.get("/whatif", response_class=HTMLResponse, include_in_schema=False)
    def whatif_page(request: Request, shape: str = "", src: str = "", src_spec: str = "", dst: str = "",
                    dst_spec: str = "", dtype: str = "float32", nic_gbps: float = 10.0):
        form = dict(shape=shape, src=src, src_spec=src_spec, dst=dst, dst_spec=dst_spec, dtype=dtype, nic_gbps=nic_gbps)
        views, error = [], None
        if shape:
            try:
                views = [plan_view(p) for p in whatif_plans(shape, dtype, src, src_spec, dst, dst_spec, nic_gbps,
                                                            source.max_plan_tasks())]
            except HTTPException as e:
                error = e.detail
        return render(request, "whatif.html", form=form, views=views, error=error)

    return router


def whatif_plans(shape: str, dtype: str, src: str, src_spec: str, dst: str, dst_spec: str, nic_gbps: float,
                 max_plan_tasks: int) -> list[Plan]:
    """The plan of every strategy, each held to the planner's size limit first; a bad field is a 422 naming it."""
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
