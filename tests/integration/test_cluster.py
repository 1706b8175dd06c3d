"""Local clusters: their processes never outlive the process that started them, and agents start with what their
copies need."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from reshard.client.cluster import (NONTEMPORAL_BYTES, NONTEMPORAL_TUNABLE, agent_environment,
                                    describe_copies)

_OWNER = textwrap.dedent("""
    import sys, time
    from reshard.client.cluster import LocalCluster
    from reshard.client.client import Client
    cluster = LocalCluster(2, 1, transport="grpc").start()
    with cluster.connect() as c:  # this process runs gRPC, as a training job using the SDK does
        assert len(c.devices()) == 2
    print(cluster.planner.pid, *(p.pid for p in cluster.agents.values()), flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cluster_processes_exit_when_their_owner_is_killed():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        os.kill(owner.pid, signal.SIGKILL)  # no cleanup code runs: only the parent-death signal
        owner.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "planner or agents outlived the process that started them"
    finally:
        owner.kill()
        owner.stdout.close()


def test_starting_processes_while_grpc_is_busy_never_aborts_a_child(tmp_path):
    """A child forked from a process whose threads are inside gRPC could abort before exec (gRPC's fork
    handlers restart its poller, whose epoll fd close_fds then closes): it measured about 3% of starts
    with a preexec_fn. start_process must take the fork-free path."""
    import threading

    from reshard.client.cluster import LocalCluster, start_process

    with LocalCluster(1, 1, transport="grpc") as cluster, cluster.connect() as c:
        stop = threading.Event()

        def busy():
            while not stop.is_set():
                c.devices()

        threads = [threading.Thread(target=busy) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(200):
                proc, addr = start_process(["/bin/sh", "-c", "echo listening on 127.0.0.1:1"],
                                           tmp_path / "child.log", 10)
                assert addr == "127.0.0.1:1"
                assert proc.wait(10) == 0, f"start {i}: the child died with {proc.returncode}"
                proc.stdout.close()
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert "epoll" not in (tmp_path / "child.log").read_text()


def test_local_agents_start_with_the_copy_threshold_and_log_it(cluster):
    # LocalCluster gives each agent the glibc tunable it reads as it starts (agent_environment); the agent's log
    # names the threshold its copies run with (describe_copies)
    for host, proc in cluster.agents.items():
        environ = dict(v.split("=", 1) for v in open(f"/proc/{proc.pid}/environ").read().split("\0") if "=" in v)
        assert f"{NONTEMPORAL_TUNABLE}={NONTEMPORAL_BYTES}" in environ["GLIBC_TUNABLES"].split(":"), host
        log = (cluster.log_dir / f"agent-{host}.log").read_text()
        assert f"agent {host}: large copies stream to memory from {NONTEMPORAL_BYTES} bytes" in log, log[-2000:]


def test_an_agents_environment_keeps_the_tunables_it_has():
    assert agent_environment({})["GLIBC_TUNABLES"] == f"{NONTEMPORAL_TUNABLE}=1048576"
    # other tunables are kept, in order; an operator's own threshold wins
    got = agent_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}, 4096)
    assert got == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{NONTEMPORAL_TUNABLE}=4096", "PATH": "/bin"}
    mine = {"GLIBC_TUNABLES": f"{NONTEMPORAL_TUNABLE}=65536"}
    assert agent_environment(mine) == mine
    assert describe_copies(mine) == (f"large copies stream to memory from 65536 bytes (GLIBC_TUNABLES: "
                                     f"{NONTEMPORAL_TUNABLE})")
    assert "glibc's own" in describe_copies({}) or "C library" in describe_copies({})
