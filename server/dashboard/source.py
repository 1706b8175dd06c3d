"""The dashboard's view of a running planner, and the HTTP server that shows it.

`PlannerSource` reads the planner's registry, catalog and jobs and hands the
dashboard plain data; it never changes them. `serve_dashboard` runs the app on
its own thread inside the planner process (`serve_app` any app, as tests do).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import defaultdict
from typing import Optional

import uvicorn
from fastapi import FastAPI

from reshard import Plan
from reshard.errors import PlanValidationError
from reshard.program import Program
from reshard.box import box_str, volume
from reshard.dtypes import itemsize
from reshard.mesh import host_of
from reshard.server.dashboard.app import create_app
from reshard.server.planner.jobs import Durations, Job
from reshard.server.planner.control import Planner

log = logging.getLogger(__name__)

__all__ = ["PlannerSource", "serve_dashboard", "serve_app", "read_token"]


def _job_doc(job: Job) -> dict:
    total = sum(t for _, t in job.progress.values())
    done = sum(d for d, _ in job.progress.values())
    transports = sorted(set(job.transports)) or ([job.transport] if job.transport else [])
    # A compute job, or a reshard of a Partial tensor, runs a program where a plain reshard runs a plan.
    ran = job.ran
    return {
        "id": job.id, "tensor": job.tensor, "state": job.state, "strategy": job.strategy, "kind": job.kind,
        "inputs": list(job.inputs), "outputs": list(job.outputs) or [job.tensor],
        "destination": job.dst.spec_str() if job.dst is not None else None, "bytes_done": done, "bytes_total": total,
        "seconds": job.seconds if job.started else None, "started": job.started, "finished": job.finished,
        "error": job.error or None, "plan_id": ran.id if ran is not None else None,
        "program_id": job.program.id if job.program is not None else None,
        "transports": transports, "estimate_seconds": _estimate(job),
        "phases": dict(job.phases), "host_seconds": dict(sorted(job.host_seconds.items())),
        "program_bytes": dict(sorted(job.program_bytes.items())),
        "manifest_digest": job.manifest_digest or None,
        "deltas": [{"name": n, **d} for n, d in dict(job.deltas).items()], "network_bytes": job.network_bytes,
        "full_network_bytes": job.full_network_bytes, "expected_network_bytes": job.expected_network_bytes,
        "delta_note": job.delta_note or None, "sync": job.sync or None,
        "started_s": job.started_s or None, "handed_s": job.handed_s or None,
    }


def _estimate(job: Job) -> float | None:
    """The job's estimate in seconds: its program's, which prices every move whole, scaled for a reshard_many that
    moves deltas by the network bytes it expects to send over a full move's (a delta tensor priced at its change
    rate times its full bytes: `JobRunner._choose_deltas`); a reshard_many's time is its moves'."""
    ran = job.ran
    if ran is None:
        return None
    if job.deltas and job.full_network_bytes:
        return ran.estimate_seconds * min(1.0, job.expected_network_bytes / job.full_network_bytes)
    return ran.estimate_seconds


def _bytes_per_host(rec) -> dict[str, int]:
    """Bytes of a tensor's current version each host holds (replicas counted per device)."""
    size = itemsize(rec.dtype)
    out: dict[str, int] = defaultdict(int)
    for dev, tile in rec.sharding.tiles(rec.shape).items():
        out[host_of(dev)] += volume(tile) * size
    return out


class PlannerSource:
    """Read-only plain-data view of a `Planner` for the dashboard."""

    def __init__(self, planner: Planner):
        self.planner = planner

    def _held_by_host(self) -> dict[str, int]:
        held: dict[str, int] = defaultdict(int)
        for rec in self.planner.tensors():
            for host, n in _bytes_per_host(rec).items():
                held[host] += n
        return held

    def agents(self) -> list[dict]:
        held = self._held_by_host()
        registry = self.planner.registry
        return [{
            "host": a.host, "address": a.address, "num_devices": a.num_devices, "devices": a.devices,
            "up": registry.is_up(a), "heartbeat_age_s": registry.age(a),
            "bytes_held": held.get(a.host, 0), "nic_gbps": a.nic_gbps,
            "transport": self.planner.group.mode(a.host), "in_group": self.planner.group.in_group(a.host),
            "memory_used_bytes": a.memory_used_bytes, "memory_limit_bytes": a.memory_limit_bytes,
        } for a in registry.agents()]

    def tensors(self) -> list[dict]:
        out = []
        for rec in self.planner.tensors():
            per_host = _bytes_per_host(rec)
            n = itemsize(rec.dtype) * math.prod(rec.shape)
            gone = rec.lost_tiles()
            out.append({"name": rec.name, "shape": list(rec.shape), "dtype": rec.dtype, "sharding": str(rec.sharding),
                        "spec": [list(a) for a in rec.sharding.spec], "version": rec.version, "nbytes": n,
                        "bytes_per_host": dict(per_host), "lost": bool(gone), "lost_devices": sorted(rec.lost),
                        "lost_tiles": [{"tile": box_str(t), "devices": devs} for t, devs in gone.items()]})
        return out

    def jobs(self, limit: Optional[int] = None) -> list[dict]:
        return [_job_doc(j) for j in self.planner.jobs.list()[:limit]]

    def job_count(self) -> int:
        return self.planner.jobs.count()

    def job_states(self) -> dict[str, int]:
        return self.planner.jobs.states()

    def job_durations(self) -> Durations:
        return self.planner.jobs.durations()

    def job(self, job_id: str) -> Optional[dict]:
        job = self.planner.jobs.get(job_id)
        return _job_doc(job) if job else None

    def job_transfer_transports(self, job_id: str) -> list[str]:
        job = self.planner.jobs.get(job_id)
        return list(job.transports) if job else []

    def plan(self, plan_id: str) -> Optional[Plan]:
        for job in self.planner.jobs.list():
            if job.plan is not None and job.plan.id == plan_id:
                return job.plan
        if self._job_program(plan_id) is not None:
            return None
        try:
            return self.planner.stored_plan(plan_id)
        except PlanValidationError:
            # Dry runs of programs are kept beside plans, under their own ids; the program page shows them.
            if self.program(plan_id) is not None:
                return None
            raise

    def program(self, program_id: str) -> Optional[Program]:
        program = self._job_program(program_id)
        if program is not None:
            return program
        stored = self.planner.stored_program(program_id)
        # A plan reads back as the program of its moves, under another id: the plan page shows it.
        return stored if stored is not None and stored.id == program_id else None

    def _job_program(self, program_id: str) -> Optional[Program]:
        for job in self.planner.jobs.list():
            if job.program is not None and job.program.id == program_id:
                return job.program
        return None

    def bytes_moved(self) -> dict[str, int]:
        return self.planner.bytes_moved()

    def delta_bytes(self) -> tuple[int, int]:
        return self.planner.jobs.delta_bytes()

    def max_plan_tasks(self) -> int:
        return self.planner.config.max_plan_tasks


def read_token(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    token = open(path, encoding="utf-8").read().strip()
    if not token:
        raise ValueError(f"admin token file {path} is empty; put a long random token in it")
    return token


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:
        """The planner process owns the signals."""


def serve_dashboard(planner: Planner, listen: str, token: Optional[str]) -> tuple[_Server, int]:
    """Serve the dashboard for ``planner`` on ``listen`` (port 0: any free port); returns (server, port)."""
    return serve_app(create_app(PlannerSource(planner), token), listen)


def serve_app(app: FastAPI, listen: str) -> tuple[_Server, int]:
    """Serve ``app`` on its own thread on ``listen`` (port 0: any free port); returns (server, port). Setting the
    server's ``should_exit`` stops it."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port or 0)))
    bound = sock.getsockname()[1]
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="dashboard")
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        raise RuntimeError(f"the dashboard did not start on {host}:{bound}")
    return server, bound
