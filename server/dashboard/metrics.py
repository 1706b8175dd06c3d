"""The dashboard's ``/metrics``: the planner's figures in Prometheus's text format, read at scrape time."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from reshard.server.dashboard.shared import DashboardSource
from reshard.server.planner.jobs import DURATION_BUCKETS, JOBS_KEPT

__all__ = ["metrics_router"]


def metrics_router(source: DashboardSource) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", response_class=PlainTextResponse, include_in_schema=False)
    def metrics():
        registry = CollectorRegistry()
        registry.register(_Collector(source))
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return router


class _Collector:
    """Reads the planner's figures at scrape time, so nothing is counted twice."""

    def __init__(self, source: DashboardSource):
        self.source = source

    def collect(self):
        moved = CounterMetricFamily("reshard_bytes_moved", "Bytes moved by reshard jobs, by transport",
                                    labels=["transport"])
        for transport, n in sorted(self.source.bytes_moved().items()):
            moved.add_metric([transport], n)
        yield moved
        # A source made before delta sync (a test's in-memory one) has no figures for it: it sent no delta.
        sent, replaced = getattr(self.source, "delta_bytes", lambda: (0, 0))()
        delta = CounterMetricFamily("reshard_delta_bytes_sent", "Network bytes reshard_many jobs sent as deltas "
                                    "(changes since a tensor's previous sync)")
        delta.add_metric([], sent)
        yield delta
        full = CounterMetricFamily("reshard_delta_full_bytes", "Network bytes full moves of the tensors sent as "
                                   "deltas would have sent (what reshard_delta_bytes_sent replaced)")
        full.add_metric([], replaced)
        yield full
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
