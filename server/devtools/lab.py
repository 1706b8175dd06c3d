"""An emulated multi-host cluster on one machine: network namespaces with shaped links.

Layout of one lab (``ID`` is short and random, so labs never collide):

    root ns --veth-- [ rsl-ID-br: bridge br0 ] --veth, shaped-- rsl-ID-h0 (agent host0)
                                              --veth, shaped-- rsl-ID-h1 (agent host1)
                                              --veth--------- rsl-ID-p  (planner)

Every host link is shaped with ``tc`` to the same rate in both directions (egress of
the host's ``eth0`` and egress of its bridge port), so each emulated host has one
full-duplex NIC of that rate, as the planner's cost model assumes. Addresses live
only inside the namespaces the lab creates (``10.213.N.0/24``); the root namespace
gets one address on the bridge so the SDK can reach the planner.

Teardown kills every process in the lab's namespaces and deletes them, on exit,
on Ctrl-C and on failure. A lab whose owner died is removed by the next lab that
starts, and ``reshard lab --cleanup`` removes every lab.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from reshard.plan_command import HelpFormatter
from reshard.proto.auth import TOKEN_ENV
from reshard.client.cluster import agent_environment, sharing_cores
from reshard.server.common.lifecycle import wait_for_signal
from reshard.server.devtools import links

log = logging.getLogger(__name__)

__all__ = ["LabConfig", "Lab", "LabError", "LinkSampler", "cleanup_labs", "lab_available", "start_cluster",
           "add_lab_command"]

PREFIX = "rsl-"
STATE_DIR = Path("/run/reshard-lab")


class LabError(RuntimeError):
    """The lab cannot be built here (no root, no ``ip``) or a command failed."""


@dataclass(frozen=True)
class LabConfig:
    num_hosts: int = 3
    devices_per_host: int = 2
    gbps: float = 1.0
    delay_ms: float = 0.0
    # Every device's float32 GFLOP/s, emulated as the links are (reshard.server.agent.pace); 0: kernels at this
    # machine's speed, the hosts sharing its cores
    device_gflops: float = 0.0
    mtu: int = 9000
    subnet_base: int = 213  # addresses 10.<subnet_base>.<lab index>.x
    host_prefix: str = "host"


def lab_available() -> tuple[bool, str]:
    """Whether a lab can be built here, and if not, why."""
    if os.geteuid() != 0:
        return False, "reshard lab needs root (it creates network namespaces and shapes links with tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"reshard lab needs the '{tool}' command (Debian package iproute2)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"cannot create network namespaces here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise LabError(f"command failed: {' '.join(cmd)}: {r.stderr.strip()}")
    return r


def _namespaces() -> list[str]:
    r = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    r = _run("ip", "netns", "pids", ns, check=False)
    pids = [int(p) for p in r.stdout.split() if p.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if Path(f"/proc/{p}").exists()]
            time.sleep(0.05)
    _run("ip", "netns", "del", ns, check=False)


def _lab_ids() -> set[str]:
    return {ns[len(PREFIX):].split("-")[0] for ns in _namespaces() if ns.startswith(PREFIX)}


def _owner_alive(lab_id: str) -> bool:
    try:
        pid = json.loads((STATE_DIR / f"{lab_id}.json").read_text())["owner"]
    except (OSError, ValueError, KeyError):
        return False
    return Path(f"/proc/{pid}").exists()


def cleanup_labs(only_orphans: bool = False) -> list[str]:
    """Remove labs (all of them, or those whose owner process is gone); returns their ids."""
    removed = []
    for lab_id in sorted(_lab_ids()):
        if only_orphans and _owner_alive(lab_id):
            continue
        for ns in _namespaces():
            if ns.startswith(f"{PREFIX}{lab_id}-"):
                _kill_namespace(ns)
        (STATE_DIR / f"{lab_id}.json").unlink(missing_ok=True)
        removed.append(lab_id)
    return removed


@dataclass
class Lab:
    """Build with ``with Lab(LabConfig(...)) as lab:``; start processes with `spawn`."""

    config: LabConfig = field(default_factory=LabConfig)
    lab_id: str = field(default_factory=lambda: secrets.token_hex(3))
    processes: list[subprocess.Popen] = field(default_factory=list)
    # The cluster token the lab's processes and clients present (they reach each other beyond loopback).
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    _built: list[str] = field(default_factory=list)

    # -- names and addresses ---------------------------------------------------------

    @property
    def index(self) -> int:
        return int(self.lab_id, 16) % 250 + 1

    def _addr(self, last: int) -> str:
        return f"10.{self.config.subnet_base}.{self.index}.{last}"

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.lab_id}-br"

    @property
    def planner_ns(self) -> str:
        return f"{PREFIX}{self.lab_id}-p"

    @property
    def planner_ip(self) -> str:
        return self._addr(1)

    @property
    def root_ip(self) -> str:
        return self._addr(254)

    def host_name(self, i: int) -> str:
        return f"{self.config.host_prefix}{i}"

    def host_ns(self, i: int) -> str:
        return f"{PREFIX}{self.lab_id}-h{i}"

    def host_ip(self, i: int) -> str:
        return self._addr(10 + i)

    @staticmethod
    def host_port(i: int) -> str:
        """Host ``i``'s link's end on the bridge: its counters are the host's traffic, the other way round."""
        return f"vh{i}"

    # -- building ---------------------------------------------------------------------

    def __enter__(self) -> "Lab":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._built.append(ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)

    def _link(self, ns: str, ip: str, port: str, shaped: bool) -> None:
        """A veth from ``ns`` (as eth0, address ``ip``) to the bridge (as ``port``)."""
        tmp = f"rs{self.lab_id}{port}"[:15]
        _run("ip", "link", "add", tmp, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", tmp, "netns", self.bridge_ns)
        _run("ip", "link", "set", tmp, "name", port, ns=self.bridge_ns)
        for where, dev in ((ns, "eth0"), (self.bridge_ns, port)):
            _run("ip", "link", "set", dev, "mtu", str(self.config.mtu), ns=where)
        _run("ip", "link", "set", port, "master", "br0", "up", ns=self.bridge_ns)
        _run("ip", "addr", "add", f"{ip}/24", "dev", "eth0", ns=ns)
        _run("ip", "link", "set", "eth0", "up", ns=ns)
        if shaped:
            self._shape(ns, "eth0")
            self._shape(self.bridge_ns, port)

    def _shape(self, ns: str, dev: str) -> None:
        rate_bits = self.config.gbps * 1e9
        # A burst of a few milliseconds at line rate keeps tbf accurate with large segments.
        burst = max(int(rate_bits / 8 * 0.002), 2 * self.config.mtu + 65536)
        tbf = ["rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms"]
        if self.config.delay_ms > 0:
            _run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                 "delay", f"{self.config.delay_ms}ms", ns=ns)
            _run("tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf", *tbf, ns=ns)
        else:
            _run("tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf, ns=ns)

    def build(self) -> None:
        ok, why = lab_available()
        if not ok:
            raise LabError(why)
        stale = cleanup_labs(only_orphans=True)
        if stale:
            log.info("removed leftover labs %s", stale)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.lab_id}.json").write_text(json.dumps({"owner": os.getpid()}))
        self._add_ns(self.bridge_ns)
        _run("ip", "link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _run("ip", "link", "set", "br0", "up", ns=self.bridge_ns)
        self._add_ns(self.planner_ns)
        self._link(self.planner_ns, self.planner_ip, "vp", shaped=False)
        for i in range(self.config.num_hosts):
            self._add_ns(self.host_ns(i))
            self._link(self.host_ns(i), self.host_ip(i), self.host_port(i), shaped=True)
        # The root namespace joins the bridge so the SDK can reach the planner and agents.
        root_dev = f"rs{self.lab_id}r"
        _run("ip", "link", "add", root_dev, "type", "veth", "peer", "name", "vr", "netns", self.bridge_ns)
        _run("ip", "link", "set", "vr", "master", "br0", "up", ns=self.bridge_ns)
        _run("ip", "addr", "add", f"{self.root_ip}/24", "dev", root_dev)
        _run("ip", "link", "set", root_dev, "up")
        log.info("lab %s: %d hosts at %g Gbit/s", self.lab_id, self.config.num_hosts, self.config.gbps)

    def spawn(self, ns: str, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` inside namespace ``ns`` with the lab's token in its environment; it is killed when
        the lab closes."""
        env = {**popen.pop("env", os.environ), TOKEN_ENV: self.token}
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, **popen)
        self.processes.append(proc)
        return proc

    def link_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes each emulated host has sent and received over its shaped link so far, from the counters of the
        link's bridge end (what the bridge receives, the host sent): benches compare them with a plan's network
        bytes to show that the bytes crossed the links, not shared memory around them."""
        ports = {link["ifname"]: link["stats64"]
                 for link in json.loads(_run("ip", "-j", "-s", "link", "show", ns=self.bridge_ns).stdout)}
        return {self.host_name(i): (ports[self.host_port(i)]["rx"]["bytes"], ports[self.host_port(i)]["tx"]["bytes"])
                for i in range(self.config.num_hosts)}

    @contextlib.contextmanager
    def sample_links(self, interval_s: float = 0.005) -> Iterator["LinkSampler"]:
        """Sample every host link's counters every ``interval_s`` while the block runs (`links`); the sampler's
        ``timeline`` is there once it ends."""
        sampler = LinkSampler(self, interval_s)
        try:
            yield sampler
        finally:
            sampler.stop()

    def connect(self, address: str, **kwargs):
        """A client of the lab's planner at ``address``, holding the lab's token."""
        import reshard

        return reshard.connect(address, token=self.token, **kwargs)

    def close(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in reversed(self._built):
            _kill_namespace(ns)
        self._built.clear()
        (STATE_DIR / f"{self.lab_id}.json").unlink(missing_ok=True)


class LinkSampler:
    """A process in the lab's bridge namespace that samples each host link's counters (`links.main`) from its start
    until `stop`, which reads them into ``timeline`` (`links.LinkTimeline`)."""

    def __init__(self, lab: Lab, interval_s: float):
        if not interval_s > 0:
            raise ValueError(f"links are sampled every positive number of seconds; got {interval_s!r}")
        self.hosts = tuple(lab.host_name(i) for i in range(lab.config.num_hosts))
        self.rate = lab.config.gbps * 1e9 / 8
        self.timeline: Optional[links.LinkTimeline] = None
        ports = ",".join(lab.host_port(i) for i in range(lab.config.num_hosts))
        self._proc = lab.spawn(lab.bridge_ns, [sys.executable, "-m", "reshard.server.devtools.links", ports,
                                               str(interval_s)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        first = self._proc.stdout.readline()
        if first.strip() != links.READY:
            self._proc.kill()
            self._proc.wait()
            raise LabError(f"the link sampler in {lab.bridge_ns} did not start: {first.strip() or 'it exited'}")

    def stop(self) -> links.LinkTimeline:
        """End the sampling (a last sample is taken now) and read the timeline."""
        if self.timeline is None:
            out, _ = self._proc.communicate(timeout=60)
            if self._proc.returncode:
                raise LabError(f"the link sampler exited with code {self._proc.returncode}")
            self.timeline = links.parse(out, self.hosts, self.rate)
        return self.timeline


PLANNER_PORT = 7070
AGENT_PORT = 7071


def _wait_listening(ns: str, ip: str, port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    """Wait until ``ip:port`` inside ``ns`` accepts connections, or fail naming ``what``."""
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(0.5)\n"
        f"sys.exit(0 if s.connect_ex(('{ip}', {port})) == 0 else 1)\n"
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LabError(f"{what} exited with code {proc.returncode} before it listened on {ip}:{port}")
        if _run(sys.executable, "-c", probe, ns=ns, check=False).returncode == 0:
            return
        time.sleep(0.2)
    raise LabError(f"{what} did not listen on {ip}:{port} within {timeout:.0f}s")


def start_cluster(lab: Lab, extra_agent_args: Sequence[str] = (), log_dir: Optional[Path] = None) -> str:
    """Start a planner and one agent per emulated host; returns the planner's address.

    Each agent reports the lab's link rate as its NIC bandwidth, so the planner's
    topology matches the shaping.
    """
    def out(name: str):
        if log_dir is None:
            return subprocess.DEVNULL
        log_dir.mkdir(parents=True, exist_ok=True)
        return open(log_dir / f"{name}.log", "wb")

    cli = [sys.executable, "-m", "reshard.server.cli"]
    planner = lab.spawn(lab.planner_ns, [*cli, "planner", "--listen", f"{lab.planner_ip}:{PLANNER_PORT}"],
                        stdout=out("planner"), stderr=subprocess.STDOUT)
    _wait_listening(lab.planner_ns, lab.planner_ip, PLANNER_PORT, planner, "the planner")
    address = f"{lab.planner_ip}:{PLANNER_PORT}"
    # The emulated hosts share this machine's cores: each agent's kernels get its share (threads spin).
    agent_args = sharing_cores(extra_agent_args, lab.config.num_hosts)
    if lab.config.device_gflops:
        agent_args = [*agent_args, "--emulate-gflops", str(lab.config.device_gflops)]
    flags = [*agent_args, ""]
    transport = next((b for a, b in zip(flags, flags[1:]) if a == "--transport"), None) or next(
        (a.split("=", 1)[1] for a in flags if a.startswith("--transport=")), None)
    if transport == "nixl" and "--nixl-tcp-only" not in agent_args:
        # The namespaces share one kernel: UCX's shared memory would bypass the shaped links altogether.
        agent_args = [*agent_args, "--nixl-tcp-only"]
    for i in range(lab.config.num_hosts):
        host = lab.host_name(i)
        agent = lab.spawn(lab.host_ns(i), [
            *cli, "agent", "--planner", address, "--listen", f"{lab.host_ip(i)}:{AGENT_PORT}",
            "--host", host, "--devices", str(lab.config.devices_per_host),
            "--nic-gbps", str(lab.config.gbps), *agent_args,
        ], stdout=out(host), stderr=subprocess.STDOUT, env=agent_environment(os.environ))
        _wait_listening(lab.host_ns(i), lab.host_ip(i), AGENT_PORT, agent, f"the agent of {host}")
    return address


def wait_for_group(client, hosts: Sequence[str], timeout_s: float = 60.0, group: bool = True) -> None:
    """Wait until the agents of ``hosts`` are up and in the collective transport's process group (a lab started
    with ``--transport collective``; ``group=False``: up only, for agents on nixl or gRPC, which form no group),
    or raise `LabError` naming those that are not."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = {a["host"] for a in client.agents() if a["up"] and (a["in_group"] or not group)}
        if ready >= set(hosts):
            return
        if time.monotonic() > deadline:
            raise LabError(f"the agents of {sorted(set(hosts) - ready)} did not "
                           f"{'join the process group' if group else 'come up'} within {timeout_s:g} s")
        time.sleep(0.1)


# -- the ``reshard lab`` command ------------------------------------------------------


def add_lab_command(sub) -> None:
    d = LabConfig()
    p = sub.add_parser("lab", help="emulate N hosts with shaped links (network namespaces; needs root) and run "
                                   "a planner and an agent per host in them; Ctrl-C tears it all down",
                       formatter_class=HelpFormatter)
    p.add_argument("--hosts", type=int, default=d.num_hosts, help="emulated hosts, one agent each (host0..)")
    p.add_argument("--devices-per-host", type=int, default=d.devices_per_host, help="devices per agent (HOST/0 ..)")
    p.add_argument("--gbps", type=float, default=d.gbps, help="every host link's rate, each way")
    p.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way delay added to every host link")
    p.add_argument("--device-gflops", type=float, default=d.device_gflops,
                   help="emulate every device at this float32 rate: a compute step lasts at least its FLOPs at it, "
                        "so the hosts' compute overlaps as on separate machines (0: this machine's speed)")
    p.add_argument("--log-dir", default=None, help="keep the planner's and agents' logs here")
    p.add_argument("--trace-dir", default=None,
                   help="every agent appends a line per task it runs to DIR/<host>.jsonl (reshard agent --trace-dir; "
                        "python -m reshard.server.devtools.task_trace DIR reads them)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the labs left behind (their owner process is gone), then exit")
    p.add_argument("--all", action="store_true", help="with --cleanup: also remove labs whose owner still runs")
    p.set_defaults(func=run_lab_command)


def run_lab_command(args) -> int:
    ok, why = lab_available()
    if not ok:
        print(f"error: {why}; nothing was created", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_labs(only_orphans=not args.all)
        print(f"removed labs {', '.join(removed)}" if removed else "no labs to remove")
        return 0
    if (args.hosts < 1 or args.devices_per_host < 1 or args.gbps <= 0 or args.delay_ms < 0
            or not args.device_gflops >= 0):
        print(f"error: a lab needs --hosts >= 1, --devices-per-host >= 1, --gbps > 0, --delay-ms >= 0 and "
              f"--device-gflops >= 0; got {args.hosts}, {args.devices_per_host}, {args.gbps:g}, {args.delay_ms:g}, "
              f"{args.device_gflops:g}", file=sys.stderr)
        return 2
    config = LabConfig(num_hosts=args.hosts, devices_per_host=args.devices_per_host, gbps=args.gbps,
                       delay_ms=args.delay_ms, device_gflops=args.device_gflops)
    # SIGTERM and SIGHUP must unwind through the Lab's __exit__ like Ctrl-C does, also while it builds.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        with Lab(config) as lab:
            address = start_cluster(lab, ["--trace-dir", args.trace_dir] if args.trace_dir else [],
                                    log_dir=Path(args.log_dir) if args.log_dir else None)
            link = f"{config.gbps:g} Gbit/s each way" + (f", {config.delay_ms:g} ms delay" if config.delay_ms else "")
            devices = f", devices emulated at {config.device_gflops:g} GFLOP/s" if config.device_gflops else ""
            print(f"lab {lab.lab_id}: {config.num_hosts} hosts, links {link}{devices}")
            print(f"planner  {address}  (namespace {lab.planner_ns})")
            for i in range(config.num_hosts):
                h = lab.host_name(i)
                print(f"agent    {h:<8} {lab.host_ip(i)}:{AGENT_PORT}  devices {h}/0..{h}/{config.devices_per_host - 1}"
                      f"  (namespace {lab.host_ns(i)})")
            fd, token_file = tempfile.mkstemp(prefix=f"reshard-lab-{lab.lab_id}-", suffix=".token")  # mode 0600
            with os.fdopen(fd, "w") as f:
                f.write(lab.token)
            print(f"token    {token_file} (export RESHARD_TOKEN_FILE={token_file})")
            print(f"connect with: reshard.connect({address!r}, token=open({token_file!r}).read()); Ctrl-C tears "
                  f"the lab down", flush=True)
            try:
                wait_for_signal(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
            finally:
                os.unlink(token_file)
    except KeyboardInterrupt:
        pass
    except LabError as e:
        print(f"error: {e}; the lab was torn down", file=sys.stderr)
        return 2
    print("lab torn down", flush=True)
    return 0
