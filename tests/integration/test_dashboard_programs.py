"""The dashboard draws the program of an einsum that ran on a real cluster: the input that did not line up moved
first, then the local einsum on every device, then the ring groups that complete the sums.

A real planner and real agents on loopback, the dashboard over real HTTP, and the page read back from a real
browser (headless Chromium, as in test_dashboard.py).
"""

from __future__ import annotations

import re
import subprocess

import httpx
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster

from .test_dashboard import CHROMIUM_FLAGS, GRPC, _chromium, _screenshot

HOSTS = ["host0", "host1"]
MESH = Mesh.from_hosts({"x": 2, "y": 2}, HOSTS, 2)


@pytest.fixture(scope="module")
def einsum_job(tmp_path_factory):
    """``c = a @ b`` where a splits the contracted dim j over x and b splits it over y: the layouts conflict, so
    one input moves, every device multiplies its tiles, and ring groups sum the partial products."""
    log_dir = tmp_path_factory.mktemp("dash-programs")
    # the device rates are fixed: the layout the planner picks must not depend on what this machine measures
    rates = ["--device-gflops", "20", "--memory-gbps", "20"]
    with LocalCluster(2, 2, dashboard=True, log_dir=str(log_dir), agent_args=[*GRPC, *rates]) as cluster, \
            cluster.connect() as c:
        a = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
        b = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) - 10
        c.put("a", a, Sharding(MESH, (None, "x")))
        c.put("b", b, Sharding(MESH, ("y", None)))
        planned = c.plan_einsum("ij,jk->ik", "a", "b", out="c")
        job = c.einsum("ij,jk->ik", "a", "b", out="c").result(timeout=60)
        assert np.array_equal(c.get("c"), a @ b)
        yield {"job": job.id, "planned": planned, "token": cluster.admin_token, "url": cluster.dashboard_url}


def _get(web, path: str) -> httpx.Response:
    return httpx.get(web["url"].rstrip("/") + path, headers={"Authorization": f"Bearer {web['token']}"}, timeout=30)


def test_the_job_links_to_its_program_and_the_api_gives_the_stages(einsum_job):
    job = _get(einsum_job, f"/api/jobs/{einsum_job['job']}").json()
    assert (job["kind"], job["inputs"], job["state"]) == ("einsum", ["a", "b"], "succeeded")
    program_id = job["program_id"]
    assert program_id == job["plan_id"] == einsum_job["planned"].id  # the dry run planned the same program
    page = _get(einsum_job, f"/jobs/{einsum_job['job']}").text
    assert f'<a class="program-link" href="/programs/{program_id}">' in page
    doc = _get(einsum_job, f"/api/programs/{program_id}").json()
    layout = einsum_job["planned"].einsum_layout_text  # the layout the planner chose, as the SDK reports it
    assert doc["layout"] == layout and doc["equation"] == "ij,jk->ik"
    assert [(s["kind"], s["tensor"]) for s in doc["stages"]][1:] == [("compute", ""), ("reduce", "c~partial")]
    moved, compute, reduce = doc["stages"]
    assert moved["kind"] == "input" and moved["reason"] == f"does not line up with layout {layout}"
    assert [t["tensor"] for t in doc["in_place"]] == sorted({"a", "b"} - {moved["tensor"]})
    # On the cost model a device's einsum starts once the moves into its tiles are done, and a group's reduce
    # once its members' einsums are.
    start = {s["id"]: s["start"] for s in doc["steps"]}
    finish = {s["id"]: s["finish"] for s in doc["steps"]}
    readers = [c["step"] for c in compute["computes"]
               if any(ref.startswith(f"{moved['tensor']}:dst") for ref, _ in c["inputs"])]
    assert readers and all(start[i] >= moved["finish"] for i in readers)
    einsum_of = {c["device"]: c["step"] for c in compute["computes"]}
    assert all(start[g["step"]] >= max(finish[einsum_of[d]] for d in g["devices"]) for g in reduce["groups"])
    assert [c["device"] for c in compute["computes"]] == list(MESH.devices)
    assert sorted(len(g["devices"]) for g in reduce["groups"]) == [2, 2]
    assert _get(einsum_job, f"/programs/{program_id}").status_code == 200
    moved_on = _get(einsum_job, f"/plans/{program_id}")
    assert moved_on.status_code == 303 and moved_on.headers["location"] == f"/programs/{program_id}"


def test_the_program_page_in_a_real_browser(einsum_job, tmp_path):
    chromium = _chromium()
    program = einsum_job["planned"]
    moved = next(s for s in program.steps if s.kind == "move").tensor
    url = f"{einsum_job['url']}login?token={einsum_job['token']}&next=/programs/{program.id}"
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    html = dom.stdout
    assert f"Program {program.id[:12]}" in html, dom.stderr[-500:]
    # The stages in the order they run: the input that did not line up, the local einsums, the reductions.
    stages = re.findall(r'<g class="stage" data-kind="(\w+)" data-tensor="([^"]*)"', html)
    assert stages == [("input", moved), ("compute", ""), ("reduce", "c~partial")]
    arrows = re.findall(r'class="arrow" data-step="(\d+)" data-from="([^"]+)" data-to="([^"]+)"', html)
    assert sorted((int(s), f, t) for s, f, t in arrows) == sorted(
        (s.id, s.transfer.sender, r) for s in program.steps if s.kind == "move" for r in s.transfer.receivers)
    assert sorted(re.findall(r'class="cell compute" data-device="([^"]+)"', html)) == sorted(MESH.devices)
    groups = re.findall(r'<g class="group" data-step="\d+" data-devices="([^"]+)"', html)
    assert sorted(groups) == sorted(",".join(s.devices) for s in program.steps if s.kind == "reduce")
    assert f"does not line up with layout {program.einsum_layout_text}" in html
    _screenshot(chromium, tmp_path / "profile", url, tmp_path, "dashboard-program.png", 1600)
