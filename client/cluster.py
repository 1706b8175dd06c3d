"""A planner and N agents as local processes on loopback: ``reshard up`` and ``reshard.local_cluster``.

Every process binds port 0 and prints the address it got on its first stdout
line; logs go to files under the cluster's log directory. Stopping sends
SIGTERM, then SIGKILL to whatever lingers; children also get SIGTERM if this
process dies first (Linux parent-death signal, which each child requests for
itself: `die_with_parent`), so nothing is orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from reshard.proto.auth import TlsFiles
from reshard.proto.errors import DeadlineExceededError, InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    from reshard.client.client import Client

__all__ = ["LocalCluster", "local_cluster", "start_process", "launch_process", "await_ready", "die_with_parent",
           "share_of_cores", "sharing_cores", "agent_environment", "describe_copies", "NONTEMPORAL_BYTES",
           "NONTEMPORAL_TUNABLE"]

_READY = re.compile(r"listening on (\S+)")
_DASHBOARD = re.compile(r"dashboard (http://\S+)\)")


_PARENT_ENV = "RESHARD_PARENT_PID"


def die_with_parent() -> None:
    """In a process `start_process` launched: get SIGTERM when that parent exits (Linux PR_SET_PDEATHSIG).

    The child sets this itself, first thing, instead of the parent passing a
    ``preexec_fn``: a ``preexec_fn`` makes ``subprocess`` fork the whole parent,
    and in a parent that runs gRPC the forked child can abort before it execs
    (gRPC's fork handler restarts its poller thread, which then finds its epoll
    fd closed by ``close_fds``: "Epoll1Poller encountered epoll_wait error: Bad
    file descriptor", SIGABRT). Without one, ``subprocess`` uses vfork and runs
    no fork handlers.
    """
    parent = os.environ.pop(_PARENT_ENV, "")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def start_process(args: Sequence[str], log_path: Path, timeout: float,
                  ready_lines: Optional[list[str]] = None) -> tuple[subprocess.Popen, str]:
    """Start ``args``, wait for its "listening on ADDR" line, and return the process and ADDR.

    The ready line itself is appended to ``ready_lines`` when given.
    """
    proc = launch_process(args, log_path)
    return proc, await_ready(proc, args, log_path, timeout, ready_lines)


def launch_process(args: Sequence[str], log_path: Path,
                   environ: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
    """Start ``args`` with stderr to ``log_path`` and the environment ``environ`` (default this process's);
    `await_ready` then waits for its address."""
    log = open(log_path, "ab")
    env = {**(os.environ if environ is None else environ), _PARENT_ENV: str(os.getpid())}  # for die_with_parent()
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env)
    log.close()
    return proc


def await_ready(proc: subprocess.Popen, args: Sequence[str], log_path: Path, timeout: float,
                ready_lines: Optional[list[str]] = None) -> str:
    """The address ``proc`` prints on its "listening on ADDR" line; kills it when none comes within ``timeout``."""
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            m = _READY.search(line.decode(errors="replace"))
            if m:
                if ready_lines is not None:
                    ready_lines.append(line.decode(errors="replace"))
                return m.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise UnavailableError(f"{' '.join(args[3:5])} did not start (exit code {proc.returncode}); log {log_path}:\n{tail}")


def share_of_cores(processes: int) -> int:
    """Kernel threads (``reshard agent --compute-threads``) for each of ``processes`` agents on this machine: its
    cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def sharing_cores(agent_args: Sequence[str], processes: int) -> list[str]:
    """``agent_args`` with ``--compute-threads`` at each agent's `share_of_cores`, unless they set it already."""
    if any(a.split("=")[0] == "--compute-threads" for a in agent_args):
        return list(agent_args)
    return [*agent_args, "--compute-threads", str(share_of_cores(processes))]


# How an agent's large memory copies run: glibc's non-temporal threshold, set in the environment it starts in.
#
# An agent copies in chunks of megabytes (a chunk into a peer's shared segment on one machine,
# `reshard.server.transport.shm`; a piece into a staged tile). glibc's ``memcpy`` writes such a copy through the
# cache (each destination line read before it is written) unless the copy is larger than its *non-temporal
# threshold*, and only then streams it to memory. glibc sets the threshold from the cache size the CPU reports,
# three quarters of the shared cache, so on a machine that reports a large last-level cache a copy must be
# hundreds of megabytes to stream: 190 MiB on this project's development machine, whose 256 MiB copied in chunks
# of 4 MiB took 40 ms against 21 ms in one call. The threshold is a glibc tunable read once as a process starts
# (``GLIBC_TUNABLES``), so the programs that start agents (`LocalCluster`, ``reshard up``, ``reshard lab``, the
# compose file and the Kubernetes manifests) give it to them: 1 MiB, where a chunk is large enough that caching
# its destination buys nothing.
#
# Measured side by side with bench/transport.py (256 MiB from one host to three on loopback, this 2-core
# machine): the nixl transport took 0.118-0.126 s against 0.159-0.160 s without it, and 0.29-0.33 CPU s/GiB
# against 0.39-0.41; the collective transport, whose bytes the kernel copies into sockets, 0.299-0.308 s against
# 0.290-0.306 s (no change beyond noise). An agent started without it runs as before, and its log says so
# (`describe_copies`).
#
# On other C libraries and other processors the variable is ignored, as glibc ignores a tunable it does not know.
NONTEMPORAL_BYTES = 1 << 20  # an agent's copies from this size stream to memory
NONTEMPORAL_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
_TUNABLES = "GLIBC_TUNABLES"


def _threshold(environ: Mapping[str, str]) -> str | None:
    """The non-temporal threshold ``environ``'s ``GLIBC_TUNABLES`` sets, as written, or None."""
    for t in environ.get(_TUNABLES, "").split(":"):
        name, _, value = t.partition("=")
        if name == NONTEMPORAL_TUNABLE:
            return value
    return None


def agent_environment(environ: Mapping[str, str], nbytes: int = NONTEMPORAL_BYTES) -> dict[str, str]:
    """``environ`` for an agent process: ``GLIBC_TUNABLES`` with the non-temporal threshold at ``nbytes`` added to
    the tunables it names already, unless it names that one (an operator's choice is kept). Why: the comment
    above."""
    env = dict(environ)
    if _threshold(env) is None:
        env[_TUNABLES] = ":".join([*(t for t in env.get(_TUNABLES, "").split(":") if t),
                                   f"{NONTEMPORAL_TUNABLE}={nbytes}"])
    return env


def describe_copies(environ: Mapping[str, str] = os.environ) -> str:
    """A line for an agent's log: the threshold its large copies run with, or why it is the C library's own."""
    value = _threshold(environ)
    if value is not None:
        return f"large copies stream to memory from {value} bytes ({_TUNABLES}: {NONTEMPORAL_TUNABLE})"
    if platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return "large copies run as this C library chooses"
    return (f"large copies run with glibc's own non-temporal threshold; {_TUNABLES}={NONTEMPORAL_TUNABLE}="
            f"{NONTEMPORAL_BYTES} in the agent's environment streams chunks of a megabyte or more to memory "
            f"(reshard up, local clusters, the lab and the deploy files set it)")


class LocalCluster:
    """One planner and ``hosts`` agents with ``devices_per_host`` devices each, on 127.0.0.1."""

    def __init__(self, hosts: int = 2, devices_per_host: int = 4, *, host_names: Optional[Sequence[str]] = None,
                 planner_args: Sequence[str] = (), agent_args: Sequence[str] = (), log_dir: Optional[str] = None,
                 startup_timeout_s: float = 60.0, dashboard: bool = False, transport: Optional[str] = None,
                 device: Union[str, Sequence[str], None] = None, tls: Optional[TlsFiles] = None,
                 on_event: Optional[Callable[[str, str], None]] = None):
        # on_event(event, name) as processes come and go (reshard up prints them): "listening" (its address is
        # known), "registered" (the planner lists the agent up), "stopping" and "stopped"; name is "planner" or a host.
        self.on_event = on_event or (lambda event, name: None)
        self.host_names = list(host_names) if host_names else [f"host{i}" for i in range(hosts)]
        # Where each agent keeps its shards (its --device): one for all, or one per host in order.
        devices = [device] * len(self.host_names) if device is None or isinstance(device, str) else list(device)
        if len(devices) != len(self.host_names):
            raise InvalidArgumentError(f"device= gives {len(devices)} devices for {len(self.host_names)} hosts; "
                                       f"give one for every host, or one per host")
        self.device_by_host = dict(zip(self.host_names, devices))
        self.devices_per_host = devices_per_host
        # Agents that all run gRPC or NIXL need no process group: the planner then hosts no store and imports no
        # torch.
        self.planner_args = list(planner_args) + (["--no-rendezvous"] if transport in ("grpc", "nixl") and
                                                  "--no-rendezvous" not in planner_args else [])
        # grpc, collective, auto (the agents' default) or nixl; with collective or auto the cluster is
        # ready once the agents' process group has formed, so the first job can use it.
        self.transport = transport
        # The agents share this machine's cores: each one's kernels get its share (BLAS threads spin).
        self.agent_args = sharing_cores([*agent_args, *(["--transport", transport] if transport else [])],
                                        len(self.host_names))
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="reshard-cluster-")
        self.log_dir = Path(log_dir or self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.startup_timeout_s = startup_timeout_s
        self.address = ""
        self.planner: Optional[subprocess.Popen] = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.agent_addresses: dict[str, str] = {}
        self.dashboard = dashboard
        self.dashboard_url = ""
        self.admin_token = secrets.token_urlsafe(24) if dashboard else ""
        # The cluster token every process and client presents (docs/security.md); in a file only its owner reads.
        self.token = secrets.token_urlsafe(32)
        self.token_file = self.log_dir / "cluster-token"
        # TLS on every gRPC port: each process serves and dials with these files, and so do clients (mutual TLS).
        self.tls = tls
        self._tls_args = [] if tls is None else [
            arg for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key), ("--tls-ca", tls.ca)) if path
            for arg in (flag, str(path))]

    def _cmd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "reshard.server.cli", *args]

    def start(self) -> "LocalCluster":
        try:
            self.token_file.touch(0o600)
            self.token_file.chmod(0o600)
            self.token_file.write_text(self.token)
            web_args: list[str] = []
            if self.dashboard:
                token_file = self.log_dir / "admin-token"
                token_file.write_text(self.admin_token)
                token_file.chmod(0o600)
                web_args = ["--http", "127.0.0.1:0", "--admin-token-file", str(token_file)]
            lines: list[str] = []
            self.planner, self.address = start_process(
                self._cmd("planner", "--listen", "127.0.0.1:0", "--token-file", str(self.token_file),
                          *self._tls_args, *web_args, *self.planner_args),
                self.log_dir / "planner.log", self.startup_timeout_s, lines)
            m = _DASHBOARD.search(lines[0]) if lines else None
            self.dashboard_url = m.group(1) if m else ""
            self.on_event("listening", "planner")
            # All agents start at once and are reported in host order: start-up is mostly imports and a probe.
            launched = {h: self._launch_agent(h) for h in self.host_names}
            for h, (proc, args) in launched.items():
                self._await_agent(h, proc, args)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def device_of(self, host: str) -> str:
        """Where the agent of ``host`` keeps its shards (its ``--device``)."""
        return self.device_by_host.get(host) or "cpu"

    def start_agent(self, host: str, wait: bool = True, extra_args: Sequence[str] = ()) -> str:
        """Start (or restart) the agent of ``host``, a new host joining the cluster included; returns its address."""
        if host not in self.host_names:
            self.host_names.append(host)
        addr = self._await_agent(host, *self._launch_agent(host, extra_args))
        if wait:
            self.wait_ready()
        return addr

    def _launch_agent(self, host: str, extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen, list[str]]:
        device = ["--device", self.device_by_host[host]] if self.device_by_host.get(host) else []
        args = self._cmd("agent", "--planner", self.address, "--listen", "127.0.0.1:0", "--host", host,
                         "--devices", str(self.devices_per_host), "--token-file", str(self.token_file),
                         *self._tls_args, *device, *self.agent_args, *extra_args)
        # an agent's large copies stream to memory (`agent_environment`): a tunable read as a process starts
        proc = launch_process(args, self.log_dir / f"agent-{host}.log", agent_environment(os.environ))
        self.agents[host] = proc  # stop() ends it even if another agent fails to start first
        return proc, args

    def _await_agent(self, host: str, proc: subprocess.Popen, args: list[str]) -> str:
        self.agent_addresses[host] = await_ready(proc, args, self.log_dir / f"agent-{host}.log",
                                                 self.startup_timeout_s)
        self.on_event("listening", host)
        return self.agent_addresses[host]

    @property
    def dashboard_login_url(self) -> str:
        """A URL that logs a browser in to the dashboard (it holds the token: show it, never log it)."""
        if not self.dashboard_url:
            return ""
        return f"{self.dashboard_url}login?token={self.admin_token}"

    def kill_agent(self, host: str) -> None:
        """SIGKILL the agent of ``host`` (fault tests)."""
        proc = self.agents[host]
        proc.kill()
        proc.wait()

    def wait_ready(self) -> None:
        """Block until the planner lists every live agent as up."""
        deadline = time.monotonic() + self.startup_timeout_s
        want = {h for h, p in self.agents.items() if p.poll() is None}
        reported: set[str] = set()
        with self.connect() as c:
            while True:
                try:
                    up = {a["host"] for a in c.agents() if a["up"] and a["address"] == self.agent_addresses[a["host"]]
                          and (a["transport"] in ("grpc", "nixl") or a["in_group"])}
                except Exception:  # noqa: BLE001 - the planner may still be starting
                    up = set()
                for h in sorted(want & up - reported, key=self.host_names.index):
                    reported.add(h)
                    self.on_event("registered", h)
                if want <= up:
                    return
                if time.monotonic() > deadline:
                    raise DeadlineExceededError(f"agents {sorted(want - up)} did not register (and join the process "
                                                f"group) within {self.startup_timeout_s:g}s; logs in {self.log_dir}")
                time.sleep(0.05)

    def connect(self, **kwargs) -> "Client":
        """A client of this cluster's planner, holding its token; ``kwargs`` as for `reshard.Client`."""
        from reshard.client.client import Client

        return Client(self.address, **{"token": self.token, "tls": self.tls, **kwargs})

    def stop(self, grace_s: float = 5.0) -> None:
        procs = list(self.agents.items()) + ([("planner", self.planner)] if self.planner else [])
        for name, p in procs:
            self.on_event("stopping", name)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
            self.on_event("stopped", name)
        self.agents.clear()
        self.planner = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def local_cluster(hosts: int = 2, devices_per_host: int = 4, **kwargs) -> Iterator["Client"]:
    """``with reshard.local_cluster(hosts=2, devices_per_host=4) as c:`` yields a connected client.

    ``c.address`` is the planner's address and ``c.cluster`` the `LocalCluster`. ``device="cuda:0"``
    (or one per host, ``device=["cuda:0", "cuda:1"]``) keeps the agents' shards on GPUs; see `LocalCluster`.
    """
    with LocalCluster(hosts, devices_per_host, **kwargs) as cluster:
        with cluster.connect() as c:
            c.cluster = cluster
            yield c
