"""Where NIXL's Python API comes from, and why it does not import: the one question a host without NIXL is asked
(the agent's ``--transport nixl``, the tests' and benches' skips) before anything of the transport loads; and what
UCX, NIXL's backend, was told to use."""

from __future__ import annotations

__all__ = ["api", "nixl_missing", "ucx_tcp_only", "INSTALL"]

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
