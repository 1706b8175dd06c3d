"""The pipeline page: a training step's timeline as a Gantt chart, measured or simulated (issue 14).

One row per stage: its ops (forwards, backwards, the SGD update), the time it waited for an input, and under
them the transfers it sent, from issue to arrival. A step measured by ``reshard.client.pipeline`` is posted to
``POST /pipeline`` as its ``Timeline.to_json()`` (or an object of several, ``{"name": timeline, ...}``, as
``bench/pipeline.py --timelines`` writes) and drawn beside what ``reshard.schedule.simulate`` predicts for the
op and transfer times it measured; ``GET /pipeline`` draws the simulator's steps for times given in the query.
The dashboard keeps none of it: a timeline is the caller's data, drawn and forgotten.

=========== ==================================================================
span        colour
=========== ==================================================================
``F``       forward, blue; ``B`` backward, green; ``update`` SGD, grey
``wait``    waiting for an activation or a gradient, pale red
``send F``  an activation in flight to the next stage, light blue, below
``send B``  a gradient in flight to the previous stage, light green, below
=========== ==================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Optional

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from reshard import schedule
from reshard.errors import InvalidJsonError, InvalidScheduleError
from reshard.jsonio import loads
from reshard.schedule import Timeline

__all__ = ["PipelineView", "pipeline_view", "predicted_for", "gantt_svg", "pipeline_router", "FILLS"]

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
FILLS = {"F": "#3c8ae0", "B": "#4caf6a", "update": "#9a9a9a", "wait": "#f3c1c1", "send F": "#a9cbf3",
         "send B": "#b5e0c0"}
MAX_SPANS = 20000  # a page draws at most this many spans; beyond, it says so
MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True)
class PipelineView:
    """What the page shows of one timeline: the chart, and per stage where the time went."""

    title: str
    timeline: Timeline
    rows: tuple[dict, ...]  # per stage: compute_s, wait_s, idle_s, sends, peak
    svg: str

    def to_json(self) -> dict:
        return {"title": self.title, "timeline": self.timeline.to_json(), "stages": list(self.rows)}


def _rows(t: Timeline) -> tuple[dict, ...]:
    rows = []
    for i in range(t.stages):
        compute = sum(t.seconds(i, op) for op in ("F", "B", "update"))
        wait = t.seconds(i, "wait")
        rows.append({"stage": i, "compute_s": compute, "wait_s": wait,
                     "idle_s": max(0.0, t.iteration_s - compute - wait),
                     "sends": sum(1 for s in t.spans if s.stage == i and s.op.startswith("send")),
                     "peak_activations": t.peak_activations[i]})
    return tuple(rows)


def pipeline_view(title: str, timeline: Timeline, scale_s: Optional[float] = None) -> PipelineView:
    """The page's data for ``timeline``; ``scale_s`` is the time the chart's full width stands for (default the
    step's own), so that charts drawn side by side compare."""
    return PipelineView(title, timeline, _rows(timeline), gantt_svg(timeline, scale_s))


def predicted_for(measured: Timeline) -> Optional[Timeline]:
    """What the simulator predicts for the op and transfer times ``measured`` shows (`schedule.median_times`);
    None when it lacks an op or a transfer to take a time from."""
    try:
        times = schedule.median_times(measured)
    except InvalidScheduleError:
        return None
    return schedule.simulate(measured.kind, measured.stages, measured.microbatches, *times)


def gantt_svg(t: Timeline, scale_s: Optional[float] = None, width: int = 960) -> str:
    """One row per stage: ops and waits on top, transfers in flight below (stacked where they overlap)."""
    left, right, top, op_h, lane_h, gap = 70, 10, 22, 18, 7, 12
    span_s = max(scale_s or t.iteration_s, 1e-9)
    px = (width - left - right) / span_s
    spans = t.spans[:MAX_SPANS]
    lanes: dict[int, list[list[float]]] = {i: [] for i in range(t.stages)}  # per stage: each lane's last end
    placed = []
    for s in sorted((s for s in spans if s.op.startswith("send")), key=lambda s: (s.stage, s.start_s)):
        ends = lanes[s.stage]
        lane = next((k for k, end in enumerate(ends) if end[0] <= s.start_s), None)
        if lane is None:
            ends.append([0.0])
            lane = len(ends) - 1
        ends[lane][0] = s.end_s
        placed.append((s, lane))
    heights = [op_h + max(1, len(lanes[i])) * lane_h + gap for i in range(t.stages)]
    y0 = [top + sum(heights[:i]) for i in range(t.stages)]
    height = top + sum(heights) + 4
    out = [f'<svg class="gantt" data-kind="{escape(t.kind)}" width="{width}" height="{height}" '
           f'xmlns="http://www.w3.org/2000/svg" font-size="10" font-family="sans-serif">']
    ticks = _ticks(span_s)
    for v in ticks:
        x = left + v * px
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height - 4}" stroke="#e3e3e3"/>'
                   f'<text x="{x:.1f}" y="{top - 8}" text-anchor="middle" fill="#555">{v:g} s</text>')
    for i in range(t.stages):
        out.append(f'<text x="4" y="{y0[i] + 13}" fill="#222">stage {i}</text>')
    for s in spans:
        if s.op.startswith("send"):
            continue
        x, w = left + s.start_s * px, max((s.end_s - s.start_s) * px, 0.5)
        label = "SGD" if s.op == "update" else ("" if s.op == "wait" else f"{s.op}{s.microbatch}")
        out.append(f'<g class="span" data-stage="{s.stage}" data-op="{escape(s.op)}" data-microbatch="{s.microbatch}">'
                   f'<title>{escape(str(s))}</title><rect x="{x:.1f}" y="{y0[s.stage]}" width="{w:.1f}" '
                   f'height="{op_h}" fill="{FILLS[s.op]}" stroke="#fff" stroke-width="0.5"/>'
                   + (f'<text x="{x + w / 2:.1f}" y="{y0[s.stage] + 13}" text-anchor="middle" fill="#fff">'
                      f'{label}</text>' if label and w >= 8 * len(label) else "") + "</g>")
    for s, lane in placed:
        x, w = left + s.start_s * px, max((s.end_s - s.start_s) * px, 0.5)
        y = y0[s.stage] + op_h + 1 + lane * lane_h
        out.append(f'<g class="span" data-stage="{s.stage}" data-op="{escape(s.op)}" data-microbatch="{s.microbatch}">'
                   f'<title>{escape(str(s))}</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h - 1}" '
                   f'fill="{FILLS[s.op]}" stroke="#fff" stroke-width="0.5"/></g>')
    if len(t.spans) > MAX_SPANS:
        out.append(f'<text x="{left}" y="{height - 6}" fill="#b00020">the first {MAX_SPANS} of {len(t.spans)} spans'
                   f'</text>')
    out.append("</svg>")
    return "".join(out)


def _ticks(span_s: float) -> list[float]:
    raw = span_s / 8
    step = min((m * 10 ** e for e in range(-6, 7) for m in (1, 2, 5) if m * 10 ** e >= raw), default=raw)
    return [round(k * step, 9) for k in range(int(span_s / step) + 1)]


def _number(query, key: str, default: str) -> list[float]:
    text = query.get(key, default)
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise HTTPException(422, f"{key}={text!r}: give seconds, one number or a comma-separated list") from None


def _simulated(query) -> tuple[dict, list[PipelineView]]:
    form = {k: query.get(k, d) for k, d in (("stages", "4"), ("microbatches", "8"), ("forward", "1"),
                                            ("backward", "2"), ("transfer", "1"))}
    try:
        n, m = int(form["stages"]), int(form["microbatches"])
    except ValueError:
        raise HTTPException(422, "stages and microbatches are whole numbers") from None
    if n * m > 4096:
        raise HTTPException(422, f"{n} stages x {m} microbatches is more than the page draws (4096)")
    times = [_number(query, key, form[key]) for key in ("forward", "backward", "transfer")]
    times = [t[0] if len(t) == 1 else t for t in times]
    try:
        sims = [schedule.simulate(kind, n, m, *times) for kind in schedule.KINDS]
    except InvalidScheduleError as e:
        raise HTTPException(422, str(e)) from None
    scale = max(s.iteration_s for s in sims)
    return form, [pipeline_view(f"{s.kind}, simulated", s, scale) for s in sims]


def _posted(body: bytes) -> list[tuple[PipelineView, Optional[PipelineView]]]:
    """(measured, predicted) views of the posted timeline or ``{name: timeline}`` object."""
    try:
        data = loads(body, "pipeline timeline JSON", max_bytes=MAX_BODY_BYTES)
        named = {"step": data} if isinstance(data, dict) and "kind" in data else data
        if not isinstance(named, dict) or not named:
            raise InvalidScheduleError("post a timeline (Timeline.to_json()) or an object {name: timeline}")
        timelines = {str(name): Timeline.from_json(t) for name, t in named.items()}
    except (InvalidJsonError, InvalidScheduleError) as e:
        raise HTTPException(422, str(e)) from None
    predicted = {name: predicted_for(t) for name, t in timelines.items()}
    scale = max([t.iteration_s for t in timelines.values()] + [p.iteration_s for p in predicted.values() if p])
    return [(pipeline_view(f"{name}: {t.kind}, measured", t, scale),
             pipeline_view(f"{name}: {t.kind}, simulated for the measured times", predicted[name], scale)
             if predicted[name] else None) for name, t in timelines.items()]


def pipeline_router(dependencies: Sequence) -> APIRouter:
    """``/pipeline`` (GET: the simulator's steps; POST: a measured step beside its prediction) and
    ``/api/pipeline`` (the same as JSON), every route behind ``dependencies`` (the app's access check)."""
    router = APIRouter(dependencies=list(dependencies))

    @router.get("/pipeline", response_class=HTMLResponse, include_in_schema=False)
    def simulated_page(request: Request):
        form, views = _simulated(request.query_params)
        return TEMPLATES.TemplateResponse(request, "pipeline.html", {"form": form, "views": views, "pairs": []})

    @router.post("/pipeline", response_class=HTMLResponse, include_in_schema=False)
    async def measured_page(request: Request):
        pairs = _posted(await request.body())
        return TEMPLATES.TemplateResponse(request, "pipeline.html", {"form": None, "views": [], "pairs": pairs})

    @router.get("/api/pipeline", tags=["api"], summary="Simulated pipeline steps under every schedule")
    def simulated_json(request: Request) -> list[dict]:
        return [v.to_json() for v in _simulated(request.query_params)[1]]

    @router.post("/api/pipeline", tags=["api"],
                 summary="A measured step (Timeline JSON, or {name: timeline}) and the simulator's prediction")
    async def measured_json(request: Request) -> list[dict]:
        return [{"measured": m.to_json(), "predicted": p.to_json() if p else None}
                for m, p in _posted(await request.body())]

    return router


def legend_html() -> str:
    return " ".join(f'<span style="background:{fill};padding:0 6px;margin-right:4px">&nbsp;</span>{escape(op)}'
                    for op, fill in FILLS.items())


TEMPLATES.env.globals["pipeline_legend"] = legend_html
