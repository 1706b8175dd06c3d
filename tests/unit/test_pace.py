"""An emulated device (`DevicePace`): a step lasts its FLOPs at the rate, one step at a time per device."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from reshard.server.agent.pace import DevicePace
from reshard.server.common.config import AgentConfig

RATE = 1.0  # GFLOP/s: 1e8 flops take 0.1 s


def test_a_step_lasts_its_flops_at_the_rate_counted_from_its_kernels_start():
    pace = DevicePace(RATE)
    assert pace.seconds(1e8) == pytest.approx(0.1)
    started = time.monotonic()
    time.sleep(0.08)  # the kernel's own time counts toward the step's
    pace.finish("h/0", 1e8, started)
    took = time.monotonic() - started
    # 0.1 s from the kernel's start, not from the wait's (0.18 s or more); the slack is a loaded machine's wake-up
    assert 0.1 - 1e-3 <= took < 0.16


def test_steps_on_one_device_take_turns_and_other_devices_run_beside_them():
    pace = DevicePace(RATE)

    def steps(devices) -> float:
        def one(device):
            pace.finish(device, 1e8, time.monotonic())

        threads = [threading.Thread(target=one, args=(d,)) for d in devices]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    assert steps(["h/0", "h/0", "h/0"]) >= 0.3 - 0.01
    assert steps(["h/1", "h/2", "h/3"]) < 0.25


def test_a_failed_job_ends_the_wait():
    pace = DevicePace(RATE)

    class Failed(Exception):
        pass

    def check():
        if time.monotonic() - t0 > 0.05:
            raise Failed()

    t0 = time.monotonic()
    with pytest.raises(Failed):
        pace.finish("h/0", 1e10, t0, check)  # 10 s unless the check ends it
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_a_rate_that_is_not_positive_is_refused(rate):
    with pytest.raises(ValueError, match="positive"):
        DevicePace(rate)


@pytest.mark.parametrize("rate", [-1.0, float("nan")])
def test_the_agent_refuses_a_negative_emulated_rate(rate):
    with pytest.raises(ValueError, match="emulate_gflops"):
        AgentConfig(host="h", num_devices=1, planner="", emulate_gflops=rate)
    out = subprocess.run([sys.executable, "-m", "reshard.server.cli", "agent", "--planner", "127.0.0.1:1", "--host",
                          "h", "--devices", "1", "--emulate-gflops", str(rate)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--emulate-gflops" in out.stderr and "is not a number >= 0" in out.stderr
