"""Agents sharing a machine cap their kernels' threads (`reshard.server.agent.threads`)."""

import json
import subprocess
import sys

import pytest

from reshard.client.cluster import share_of_cores
from reshard.server.common.config import AgentConfig

_PROBE = """
import json, sys
import numpy, torch
from threadpoolctl import threadpool_info
from reshard.server.agent.threads import limit_compute_threads
limit_compute_threads(int(sys.argv[1]))
print(json.dumps({"blas": [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"],
                  "torch": torch.get_num_threads()}))
"""


def _threads(limit: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(limit)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_limit_caps_blas_and_torch_threads_in_the_process():
    got = _threads(1)
    assert got["blas"] and set(got["blas"]) == {1}
    assert got["torch"] == 1


_LATER = """
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
from reshard.server.agent.threads import limit_compute_threads, limit_this_thread
if sys.argv[2] == "before":
    import torch
limit_compute_threads(int(sys.argv[1]))
import torch  # an agent loads it after its limit (the collective and nixl transports)
seen = {"main": torch.get_num_threads()}
def look(name):
    seen[name] = torch.get_num_threads()
t = threading.Thread(target=look, args=("plain thread",))
t.start(); t.join()
with ThreadPoolExecutor(1, initializer=limit_this_thread) as pool:  # as the agent's runtime makes its pools
    pool.submit(look, "runtime pool").result()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("torch_loaded", ["after", "before"])
def test_the_limit_holds_in_every_thread_that_runs_kernels_whenever_torch_loads(torch_loaded):
    """OpenMP keeps its thread count per thread: a limit set before torch loads reaches every thread through the
    environment, and one set after reaches the runtime's pools through their initializer."""
    import os

    if (os.cpu_count() or 1) < 2:
        pytest.skip("a limit of 1 is every thread's default on a machine of 1 core: nothing to tell apart")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", _LATER, "1", torch_loaded], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["main"] == 1 and seen["runtime pool"] == 1, seen
    if torch_loaded == "after":
        assert seen["plain thread"] == 1, seen  # the environment reached a thread nobody told


def test_no_limit_leaves_the_libraries_defaults():
    import os

    got = _threads(0)
    if (os.cpu_count() or 1) > 1:
        assert max(got["blas"]) > 1


def test_agents_share_the_cores_and_each_gets_one_at_least():
    import os

    cores = os.cpu_count() or 1
    assert share_of_cores(1) == cores
    assert share_of_cores(cores * 4) == 1
    assert share_of_cores(0) == cores


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ValueError, match="compute_threads must be 0"):
        AgentConfig("h", 1, "127.0.0.1:1", compute_threads=-1)
    out = subprocess.run([sys.executable, "-m", "reshard.server.cli", "agent", "--planner", "127.0.0.1:1", "--host",
                          "h", "--devices", "1", "--compute-threads", "-2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--compute-threads" in out.stderr and "'-2' is not a whole number" in out.stderr


def test_a_local_cluster_gives_each_agent_its_share_unless_told():
    from reshard.client.cluster import LocalCluster

    shared = LocalCluster(hosts=4, devices_per_host=1)
    assert shared.agent_args[-2:] == ["--compute-threads", str(share_of_cores(4))]
    told = LocalCluster(hosts=4, devices_per_host=1, agent_args=["--compute-threads=3"])
    assert told.agent_args.count("--compute-threads") == 0 and "--compute-threads=3" in told.agent_args


def test_spares_reuse_an_idle_thread_and_make_one_only_where_none_is_idle():
    import threading
    import time

    from reshard.server.agent.threads import Spares

    spares = Spares("t")
    try:
        ran, done = [], threading.Event()
        for i in range(3):  # one after the other: the same thread each time
            done.clear()
            spares.start(lambda i=i: (ran.append((i, threading.current_thread().name)), done.set()))
            assert done.wait(5)
            deadline = time.monotonic() + 5
            while spares._idle != 1:  # the thread counts itself idle after the call returns
                assert time.monotonic() < deadline
                time.sleep(0.001)
        assert [i for i, _ in ran] == [0, 1, 2] and len({n for _, n in ran}) == 1 and spares.threads == 1
        gate, inside = threading.Event(), threading.Barrier(3, timeout=5)
        for _ in range(2):  # two at once, the idle one busy: one more thread, two calls running together
            spares.start(lambda: (inside.wait(), gate.wait(5)))
        inside.wait()
        assert spares.threads == 2
        gate.set()
    finally:
        spares.close()


def test_a_call_that_raises_is_logged_and_its_thread_serves_the_next(caplog):
    import threading
    import time

    from reshard.server.agent.threads import Spares

    spares = Spares("t")
    try:
        done = threading.Event()
        spares.start(lambda: 1 / 0)
        deadline = time.monotonic() + 5
        while spares._idle != 1:  # the call raised, was logged, and its thread waits for the next
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert "a call on a spare thread failed" in caplog.text and "ZeroDivisionError" in caplog.text
        spares.start(done.set)
        assert done.wait(5) and spares.threads == 1
    finally:
        spares.close()


def test_closed_spares_end_their_threads():
    import threading
    import time

    from reshard.server.agent.threads import Spares

    spares = Spares("closing")
    done = threading.Event()
    spares.start(done.set)
    assert done.wait(5)
    spares.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith("closing-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a spare thread outlived close"
        time.sleep(0.01)
