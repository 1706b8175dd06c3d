"""The planner's rendezvous store: where the agents' process group forms and confirms plan ids.

torch's TCPStore server binds every interface whatever host it is given, so the
store listens on a socket bound here, to the planner's listen host (loopback by
default), and handed over as ``master_listen_fd``. The store has no
authentication of its own: docs/security.md says who must not reach it.
"""

from __future__ import annotations

import socket
import threading

from reshard.server.common.contract import confirm_prefix
from reshard.server.common.torch_support import require_torch, seconds_delta

__all__ = ["Rendezvous"]


class Rendezvous:
    """The planner's TCPStore, bound to its listen host on a free port."""

    def __init__(self, listen_host: str, timeout_s: float):
        dist = require_torch()
        host = listen_host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, 0))
            listener.listen(1024)
        except OSError as e:
            listener.close()
            raise OSError(f"the rendezvous store could not bind {host}: {e.strerror or e}") from None
        self.port = listener.getsockname()[1]
        try:
            self.store = dist.TCPStore(host if host not in ("0.0.0.0", "::") else "127.0.0.1", self.port,
                                       is_master=True, wait_for_workers=False, timeout=seconds_delta(timeout_s),
                                       master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        # The store owns the descriptor now and closes it when it goes: a socket object left holding it
        # would close it a second time when collected, by then under whatever opened that number next
        # (a gRPC channel's socket died of "Bad file descriptor" that way).
        listener.detach()
        self._lock = threading.Lock()

    def forget_job(self, generation: int, job: str, hosts_by_phase: dict[int, list[str]]) -> None:
        """Delete a finished job's plan-id confirmations, so a long-lived store does not grow with every job."""
        with self._lock:
            for phase, hosts in hosts_by_phase.items():
                for host in hosts:
                    self.store.delete_key(confirm_prefix(generation, job, phase) + host)
