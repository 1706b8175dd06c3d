"""Where NIXL's Python API comes from, and why it does not import: the one question a host without NIXL is asked
(the agent's ``--transport nixl``, the tests' and benches' skips) before anything of the transport loads; and what
UCX, NIXL's backend, was told to use."""

from __future__ import annotations

import threading

__all__ = ["api", "nixl_missing", "ucx_tcp_only", "INSTALL", "OneAtATime"]

INSTALL = "pip install 'reshard[nixl]'"


def api():
    """NIXL's Python API: the ``nixl_cu12`` wheel the extra pins, else ``nixl_cu13`` (CUDA 13 hosts), else the
    ``nixl`` meta package's pick."""
    try:
        from nixl_cu12 import _api
    except ImportError:
        try:
            from nixl_cu13 import _api
        except ImportError:
            from nixl import _api
    return _api


def nixl_missing() -> str | None:
    """None when NIXL imports here; else why not, ending with the command to run: pip install 'reshard[nixl]'"""
    try:
        api()
    except (ImportError, OSError) as e:  # OSError: the wheel is there but its shared libraries do not load
        return f"NIXL does not import in this Python ({type(e).__name__}: {e}); {INSTALL}"
    return None


def ucx_tcp_only(environ) -> bool:
    """Whether UCX may move bytes over TCP alone: ``UCX_TLS`` names tcp and nothing else (read as UCX reads it, when
    a NIXL agent is made)."""
    return {t.strip() for t in environ.get("UCX_TLS", "").split(",")} == {"tcp"}


class OneAtATime:
    """A NIXL agent whose calls from this process's threads take turns on a lock of ours, which a waiting thread
    holds without the GIL.

    The agent runs NIXL_THREAD_SYNC_STRICT: every call takes the agent's own lock, which a poll holds while it takes in
    what arrived (over TCP, a millisecond and more) and a WRITE while it sends what the socket takes. Some of NIXL's
    Python bindings wait for that lock holding the GIL (its handle release: on the emulated hosts' weight sync it
    took 0.6-2 ms on average against 5 us uncontended, and every other thread of the agent stopped meanwhile). Here
    the wait is on this lock, outside NIXL, and NIXL's own lock is always free. Attributes that are not methods (the
    agent's backends, its plugin list) are the agent's own."""

    def __init__(self, agent):
        self._agent = agent
        # reentrant: a buffer freed while this thread holds it (a collection as a call returns) deregisters itself
        self._turn = threading.RLock()

    def __getattr__(self, name: str):
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr
        turn = self._turn

        def call(*args, **kwargs):
            with turn:
                return attr(*args, **kwargs)

        call.__name__ = name
        return call
