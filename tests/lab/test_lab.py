"""The emulated cluster: a chain broadcast over shaped links, and nothing left behind.

Needs root and network namespaces; skips with the reason otherwise. These tests check what moved and
where, never how fast: a loaded machine makes any time ratio flaky, so the measured-to-estimated ratio
is reported by ``bench/paper.py`` instead.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.server.devtools.lab import PREFIX, Lab, LabConfig, lab_available, start_cluster

pytestmark = pytest.mark.lab

GBPS = 1.0
NBYTES = 16 * 2**20  # several chunks per hop (2 MiB at 1 Gbit/s), each read back over a shaped link


@pytest.fixture(scope="module", autouse=True)
def _needs_lab():
    ok, why = lab_available()
    if not ok:
        pytest.skip(why)


def lab_namespaces(lab_id: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}{lab_id}-")]


def test_chain_broadcast_on_three_shaped_hosts_is_bit_exact_and_crosses_each_link_once():
    with Lab(LabConfig(num_hosts=3, devices_per_host=2, gbps=GBPS, device_gflops=4.0)) as lab:
        address = start_cluster(lab)
        hosts = [lab.host_name(i) for i in range(3)]
        src = Sharding(Mesh.from_hosts({"x": 1, "y": 1}, hosts[:1], 1), (None,))
        dst = Sharding(Mesh.from_hosts({"x": 2, "y": 2}, hosts[1:], 2), (None,))
        data = np.arange(NBYTES // 4, dtype=np.int32)
        with lab.connect(address) as c:
            # The devices are emulated as told (tests/unit/test_pace.py times them) and priced so.
            deadline = time.monotonic() + 60
            while len(agents := c.agents()) < len(hosts) and time.monotonic() < deadline:
                time.sleep(0.1)  # registered moments after they listen
            assert {a["host"]: a["device_gflops"] for a in agents} == dict.fromkeys(hosts, 4.0)
            c.put("t", data, src)
            plan = c.plan("t", dst, "broadcast")
            # The planner's topology is the shaping: one box through each NIC at the link rate.
            assert plan.estimate_seconds == pytest.approx(NBYTES * 8 / (GBPS * 1e9), rel=1e-6)
            assert [t.method for t in plan.transfers] == ["broadcast"]
            before = lab.link_bytes()
            with lab.sample_links() as sampler:
                t0 = time.monotonic()
                result = c.reshard("t", dst, "broadcast").result(timeout=60)
                t1 = time.monotonic()
            after = lab.link_bytes()
            for dev in dst.mesh.devices:
                assert np.array_equal(c.get_shard("t", dev), data)
        assert lab_namespaces(lab.lab_id)
    # Each receiving host got the box once over the network: the chain, not a copy per device; and the sender
    # put it on its own link once.
    assert result.network_bytes == 2 * NBYTES
    assert {h: sum(t["bytes_in"].values()) for h, t in result.traffic.items()} == {
        hosts[0]: 0, hosts[1]: NBYTES, hosts[2]: NBYTES}
    assert sum(result.traffic[hosts[0]]["bytes_out"].values()) == NBYTES
    assert lab_namespaces(lab.lab_id) == []
    # The links' timeline saw the same: the box left host0 once, crossed into host1, left it once more (the chain's
    # forward) and crossed into host2, with a few headers (9000-byte frames) and the job's control messages
    timeline = sampler.timeline
    crossed = timeline.totals(t0, t1)
    for host, (sent, received) in zip(hosts, [(1, 0), (1, 1), (0, 1)]):
        assert crossed[host][0] == pytest.approx(sent * NBYTES, abs=0.03 * NBYTES)
        assert crossed[host][1] == pytest.approx(received * NBYTES, abs=0.03 * NBYTES)
    # over the whole sampling, the timeline's bytes are the counters' that `Lab.link_bytes` reads around it
    whole = timeline.totals(timeline.times[0], timeline.times[-1])
    for host in hosts:
        for i in (0, 1):
            assert 0 <= after[host][i] - before[host][i] - whole[host][i] < 256 << 10  # heartbeats outside it
    first, last = timeline.first_byte(t0, 1 << 20), timeline.last_byte(t0, t1)
    assert first is not None and 0 < first < last <= t1 - t0
    starts, sent_bins, received_bins = timeline.bins(t0, t1, 0.05)
    assert starts[-1] < t1 - t0 <= starts[-1] + 0.05
    binned = timeline.totals(t0, t0 + len(starts) * 0.05)  # the last bin ends past t1
    assert received_bins.sum(axis=0) == pytest.approx([binned[h][1] for h in hosts], abs=1)
    assert sent_bins.sum(axis=0) == pytest.approx([binned[h][0] for h in hosts], abs=1)
    # and no link ever ran faster than its shaping lets it
    assert timeline.busiest_rate(t0, t1, 0.1) <= 1.15 * GBPS * 1e9 / 8


OWNER = """
import sys, time
from reshard.server.devtools.lab import Lab, LabConfig, start_cluster
lab = Lab(LabConfig(num_hosts=2, devices_per_host=1)).__enter__()
start_cluster(lab)
print(lab.lab_id, flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # 26 s of make test's 10 minutes: runs from make bench
@pytest.mark.parametrize("how", ["next lab", "reshard lab --cleanup"])
def test_a_lab_whose_owner_was_killed_is_removed(how):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        lab_id = owner.stdout.readline().strip()
        assert lab_id, "the owner process died before its lab was up"
        owner.kill()  # SIGKILL: no teardown runs; planner and agents keep running in the namespaces
        owner.wait()
        assert lab_namespaces(lab_id), "the killed owner's namespaces should still be there"
        if how == "next lab":
            with Lab(LabConfig(num_hosts=1, devices_per_host=1)):
                assert lab_namespaces(lab_id) == []
        else:
            out = subprocess.run([sys.executable, "-m", "reshard.server.cli", "lab", "--cleanup"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert lab_id in out.stdout
        assert lab_namespaces(lab_id) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_reshard_lab_refuses_without_root():
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable]
    probe = subprocess.run([*nobody, "-c", "import reshard.server.cli"], capture_output=True, text=True, timeout=60,
                           cwd="/")
    if probe.returncode:  # a checkout in a directory only root may enter (as `mktemp -d` makes one)
        pytest.skip(f"user nobody (uid 65534) cannot import this checkout's reshard, so it cannot be run as a user "
                    f"without root here: {probe.stderr.strip().splitlines()[-1]}")
    out = subprocess.run([*nobody, "-m", "reshard.server.cli", "lab"], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert out.returncode == 2
    assert "reshard lab needs root" in out.stderr
    assert "nothing was created" in out.stderr
