"""The planner's rendezvous store: where the agents' process group forms and confirms plan ids.

torch's TCPStore server binds every interface whatever host it is given, so the
store listens on a socket bound here, to the planner's listen host (loopback by
default), and handed over as ``master_listen_fd``. The store has no
authentication of its own: docs/security.md says who must not reach it.

The socket is bound and listening before torch is imported (`Rendezvous` knows its
port at once), and the store starts on it in the background (`start_in_background`):
importing torch takes a second or more, which the planner's agents, importing torch
themselves as they start, would otherwise wait through. An agent that reaches the
store before it is up waits in the socket's backlog.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from reshard.server.common.contract import confirm_prefix
from reshard.server.common.torch_support import require_torch, seconds_delta

__all__ = ["Rendezvous"]

log = logging.getLogger(__name__)


class Rendezvous:
    """The planner's TCPStore, bound to its listen host on a free port: bound now, started by `start`."""

    def __init__(self, listen_host: str, timeout_s: float):
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
        self._host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"
        self._timeout_s = timeout_s
        self._listener: socket.socket | None = listener
        self.store = None  # the TCPStore, once `start` has made it
        self._lock = threading.Lock()

    def start(self) -> None:
        """Import torch and start the store on the bound socket; on failure the socket is closed."""
        listener, self._listener = self._listener, None
        if listener is None:
            raise RuntimeError("the rendezvous store was already started")
        try:
            dist = require_torch()
            store = dist.TCPStore(self._host, self.port, is_master=True, wait_for_workers=False,
                                  timeout=seconds_delta(self._timeout_s), master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        # The store owns the descriptor now and closes it when it goes: a socket object left holding it
        # would close it a second time when collected, by then under whatever opened that number next
        # (a gRPC channel's socket died of "Bad file descriptor" that way).
        listener.detach()
        with self._lock:
            self.store = store

    def start_in_background(self, failed: Callable[[str], None]) -> threading.Thread:
        """`start` on a thread of its own; ``failed(why)`` if it cannot (torch that does not import, say)."""

        def run() -> None:
            try:
                self.start()
            except Exception as e:  # noqa: BLE001 - reported to the planner, which stops offering the store
                why = f"its rendezvous store did not start: {type(e).__name__}: {e}"
                log.error("the planner hosts no rendezvous store: %s; agents run gRPC", why)
                failed(why)

        thread = threading.Thread(target=run, daemon=True, name="rendezvous-start")
        thread.start()
        return thread

    def forget_job(self, generation: int, job: str, hosts_by_phase: dict[int, list[str]]) -> None:
        """Delete a finished job's plan-id confirmations, so a long-lived store does not grow with every job."""
        with self._lock:
            if self.store is None:
                return  # not started: no agent can have written a key
            for phase, hosts in hosts_by_phase.items():
                for host in hosts:
                    self.store.delete_key(confirm_prefix(generation, job, phase) + host)
