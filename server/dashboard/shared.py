"""What every route module of the dashboard shares: the source it reads, its page templates and how a page renders."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from reshard import Plan
from reshard.program import Program
from reshard.server.common.sizes import format_size
from reshard.server.planner.jobs import Durations

__all__ = ["DashboardSource", "TEMPLATES", "render", "job_view"]

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
TEMPLATES.env.filters["bytes"] = lambda n: format_size(n or 0)


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
        reached), host_seconds ({host: seconds of its Execute call}), program_bytes ({host: bytes of program text it
        was handed: its slice, where the program is cut per host}), manifest_digest (the SHA-256 of the consumer's
        manifest a reshard_many was checked against, or None), deltas (a reshard_many's tensors: {name, mode, why,
        bytes, full_bytes, expected}), network_bytes, full_network_bytes, expected_network_bytes, delta_note, sync
        (the registered sync a reshard_many runs, or None), started_s and handed_s (seconds from the request to
        every host's part running, and to the planner's calls having reached every host; None until then)"""

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

    def delta_bytes(self) -> tuple[int, int]:
        """(network bytes sent as deltas so far, the bytes full moves of those tensors would have sent). Optional: a
        source without it reports no delta bytes."""

    def max_plan_tasks(self) -> int:
        """The planner's limit on plan size (``--max-plan-tasks``): what-if plans are held to it too."""


def render(request: Request, name: str, **ctx) -> HTMLResponse:
    """The page of template ``name`` with ``ctx``."""
    # Pages showing a job still in flight reload themselves every two seconds.
    if any(j.get("state") in ("queued", "running") for j in ctx.get("jobs", []) + [ctx.get("job") or {}]):
        ctx["refresh"] = 2
    return TEMPLATES.TemplateResponse(request, name, ctx)


def job_view(job: dict) -> dict:
    """A job's document with what its row shows besides: percent done and, once it succeeded, Gbit/s."""
    done, total = job.get("bytes_done", 0), job.get("bytes_total", 0)
    secs = job.get("seconds") or 0.0
    return {
        **job,
        "percent": 100.0 * done / total if total else (100.0 if job.get("state") == "succeeded" else 0.0),
        "gbps": total * 8 / secs / 1e9 if secs and job.get("state") == "succeeded" else None,
    }
