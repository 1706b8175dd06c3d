"""The planner's rendezvous store: where the agents' process group forms and confirms plan ids."""

from __future__ import annotations

import threading

from reshard.server.common.contract import confirm_prefix
from reshard.server.common.torch_support import require_torch, seconds_delta

__all__ = ["Rendezvous"]


class Rendezvous:
    """The planner's TCPStore, bound to its listen host on a free port."""

    def __init__(self, listen_host: str, timeout_s: float):
        dist = require_torch()
        host = listen_host.strip("[]") or "0.0.0.0"
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=seconds_delta(timeout_s))
        self.port = self.store.port
        self._lock = threading.Lock()

    def forget_job(self, generation: int, job: str, hosts_by_phase: dict[int, list[str]]) -> None:
        """Delete a finished job's plan-id confirmations, so a long-lived store does not grow with every job."""
        with self._lock:
            for phase, hosts in hosts_by_phase.items():
                for host in hosts:
                    self.store.delete_key(confirm_prefix(generation, job, phase) + host)
