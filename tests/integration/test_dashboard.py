"""The admin dashboard served by a real planner process, after real reshards by real agents."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.client.client import Client

HOSTS = ["host0", "host1", "host2", "host3"]
# The dashboard does not depend on the transport; gRPC agents start without importing torch.
GRPC = ["--transport", "grpc"]


def _reshard_broadcast(c: Client, name: str) -> tuple[str, str]:
    """Put a tensor on host0 and broadcast it to hosts 1-3; returns (job id, plan id)."""
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    dst = Sharding(Mesh.from_hosts({"x": 3, "y": 2}, HOSTS[1:], 2), (None, None))
    data = np.arange(1024 * 1025, dtype=np.float32).reshape(1024, 1025)
    c.put(name, data, src)
    result = c.reshard(name, dst, "broadcast").result(timeout=60)
    assert np.array_equal(c.get(name), data)
    return result.id, result.plan_id


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """A cluster with its dashboard, a finished broadcast job and a dry-run plan."""
    log_dir = tmp_path_factory.mktemp("dash")
    state = log_dir / "state.db"
    with LocalCluster(4, 2, dashboard=True, log_dir=str(log_dir), planner_args=["--state", str(state)],
                      agent_args=GRPC) as cluster:
        with cluster.connect() as c:
            job_id, plan_id = _reshard_broadcast(c, "weights")
            dry = c.plan("weights", Sharding(Mesh.from_hosts({"x": 2, "y": 2}, HOSTS[:2], 2), ("x", None)))
            yield {"cluster": cluster, "client": c, "job": job_id, "plan": plan_id, "dry": dry.id,
                   "token": cluster.admin_token, "url": cluster.dashboard_url, "log_dir": log_dir, "state": state}


def _get(web, path: str, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {web['token']}"}
    return httpx.get(web["url"].rstrip("/") + path, headers=headers, timeout=30, **kw)


def test_api_shows_cluster_tensors_jobs_and_plans(web):
    agents = _get(web, "/api/cluster").json()
    assert sorted(a["host"] for a in agents) == HOSTS
    assert all(a["up"] and a["heartbeat_age_s"] < 10 for a in agents)
    held = {a["host"]: a["bytes_held"] for a in agents}
    assert held["host0"] == 0 and held["host1"] == 1024 * 1025 * 4 * 2  # two replicas on host1's devices

    tensors = {t["name"]: t for t in _get(web, "/api/tensors").json()}
    assert tensors["weights"]["shape"] == [1024, 1025] and tensors["weights"]["version"] == 2
    assert tensors["weights"]["sharding"].startswith("P(None, None)")

    jobs = _get(web, "/api/jobs").json()
    job = next(j for j in jobs if j["id"] == web["job"])
    assert job["state"] == "succeeded" and job["bytes_done"] == job["bytes_total"] > 0
    assert job["plan_id"] == web["plan"] and job["seconds"] > 0 and job["gbps"] > 0
    assert _get(web, f"/api/jobs/{web['job']}").json()["id"] == web["job"]

    plan = _get(web, f"/api/plans/{web['plan']}").json()
    assert plan["id"] == web["plan"] and plan["strategy"] == "broadcast"
    assert [t["route"] for t in plan["transfers"] if t["method"] == "broadcast"] == [["host1", "host2", "host3"]]
    assert _get(web, f"/api/plans/{web['dry']}").status_code == 200  # dry runs are kept too
    assert _get(web, "/api/jobs/nope").status_code == 404


def test_whatif_plans_every_strategy_and_moves_nothing(web):
    before = _get(web, "/api/jobs").json()
    params = {"shape": "1024,1024,512", "dtype": "int32", "src": "x=2,y=4", "src_spec": "_,x,_",
              "dst": "x=2,y=4", "dst_spec": "x,_,_"}
    plans = _get(web, "/api/whatif", params=params).json()
    assert [p["strategy"] for p in plans] == ["send_recv", "local_allgather", "broadcast", "auto"]
    assert min(p["estimate_seconds"] for p in plans) == plans[-1]["estimate_seconds"]
    page = _get(web, "/whatif", params=params).text
    assert page.count('class="plan"') == 4
    bad = _get(web, "/api/whatif", params={**params, "src_spec": "z,_,_"})
    assert bad.status_code == 422 and "unknown axis 'z'" in bad.text
    assert _get(web, "/api/jobs").json() == before


def test_whatif_refuses_a_plan_over_the_size_limit_before_planning(web):
    """An all-gather over 4,096 devices (512 hosts of 8) would deliver 16.7M boxes: refused at once, as the
    planner's Plan call refuses it, naming the counts and the limit."""
    params = {"shape": "16384,64", "src": "x=512,y=8", "src_spec": "x+y,_", "dst": "x=512,y=8", "dst_spec": "_,_"}
    for path in ("/api/whatif", "/whatif"):
        r = _get(web, path, params=params)
        text = r.json()["detail"] if path.startswith("/api") else r.text
        assert "16,777,216 deliveries where the limit is 1,000,000" in text, text[:500]
        assert "--max-plan-tasks 1,000,000" in text
    assert _get(web, "/api/whatif", params=params).status_code == 422


def test_memory_use_and_limits_and_tensor_state_are_shown(web):
    deadline = time.monotonic() + 10
    while True:  # agents report their memory with each heartbeat
        agents = _get(web, "/api/cluster").json()
        if all(a["memory_used_bytes"] == a["bytes_held"] for a in agents) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(a["memory_used_bytes"] == a["bytes_held"] and a["memory_limit_bytes"] > 2**20 for a in agents)
    page = _get(web, "/").text
    limits = re.findall(r'<td class="memory" data-used="(\d+)" data-limit="(\d+)">', page)
    assert len(limits) == len(HOSTS) and all(int(limit) > 0 for _, limit in limits)
    weights = next(t for t in _get(web, "/api/tensors").json() if t["name"] == "weights")
    assert (weights["lost"], weights["lost_devices"], weights["lost_tiles"]) == (False, [], [])
    assert '<td class="ok">ok</td>' in _get(web, "/tensors").text


def test_openapi_describes_the_api(web):
    doc = _get(web, "/openapi.json").json()
    assert {"/api/cluster", "/api/tensors", "/api/jobs", "/api/jobs/{job_id}", "/api/plans/{plan_id}",
            "/api/whatif"} <= set(doc["paths"])
    # Nothing in the API changes state: GETs only, but for the pipeline page's POST, which draws the timeline it
    # is sent and stores nothing.
    assert all(set(ops) == {"get"} for path, ops in doc["paths"].items() if path != "/api/pipeline")
    assert set(doc["paths"]["/api/pipeline"]) <= {"get", "post"}


def test_metrics_parse(web):
    text = _get(web, "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    moved = {s.labels["transport"]: s.value for s in families["reshard_bytes_moved"].samples
             if s.name == "reshard_bytes_moved_total"}
    assert sum(moved.values()) > 0
    assert any(s.labels.get("state") == "succeeded" and s.value >= 1 for s in families["reshard_jobs"].samples)
    assert families["reshard_agents_up"].samples[0].value == 4
    count = next(s for s in families["reshard_job_duration_seconds"].samples
                 if s.name == "reshard_job_duration_seconds_count")
    assert count.value >= 1


@pytest.mark.parametrize("path", ["/", "/jobs", "/tensors", "/whatif", "/api/jobs", "/api/cluster", "/metrics",
                                  "/openapi.json", "/docs"])
def test_token_required(web, path):
    url = web["url"].rstrip("/") + path
    missing = httpx.get(url, timeout=30)
    wrong = httpx.get(url, headers={"Authorization": "Bearer not-the-token"}, timeout=30)
    right = httpx.get(url, headers={"Authorization": f"Bearer {web['token']}"}, timeout=30)
    for r in (missing, wrong):
        assert r.status_code == 401 and r.json() == {"detail": "unauthorized"}
    assert right.status_code == 200


def test_login_sets_a_cookie_and_the_token_is_never_logged(web):
    base = web["url"].rstrip("/")
    r = httpx.get(f"{base}/login", params={"token": web["token"], "next": "/jobs"}, timeout=30)
    assert r.status_code == 303 and r.headers["location"] == "/jobs"
    page = httpx.get(f"{base}/jobs", cookies={"reshard_admin": web["token"]}, timeout=30)
    assert page.status_code == 200 and web["job"][:12] in page.text
    assert httpx.get(f"{base}/login", params={"token": "wrong"}, timeout=30).status_code == 401
    off_site = httpx.get(f"{base}/login", params={"token": web["token"], "next": "//evil.example/"}, timeout=30)
    assert off_site.headers["location"] == "/"
    for log in Path(web["log_dir"]).glob("*.log"):
        assert web["token"] not in log.read_text(errors="replace"), log


@pytest.mark.slow  # 19 s of make test's 10 minutes: runs from make bench
def test_history_survives_a_planner_restart(tmp_path):
    state = tmp_path / "state.db"
    with LocalCluster(4, 2, dashboard=True, log_dir=str(tmp_path / "a"), planner_args=["--state", str(state)],
                      agent_args=GRPC) as one:
        with one.connect() as c:
            job_id, plan_id = _reshard_broadcast(c, "kept")
    with LocalCluster(4, 2, dashboard=True, log_dir=str(tmp_path / "b"), planner_args=["--state", str(state)],
                      agent_args=GRPC) as two:
        headers = {"Authorization": f"Bearer {two.admin_token}"}
        base = two.dashboard_url.rstrip("/")
        jobs = httpx.get(f"{base}/api/jobs", headers=headers, timeout=30).json()
        assert any(j["id"] == job_id and j["state"] == "succeeded" for j in jobs)
        page = httpx.get(f"{base}/jobs/{job_id}", headers=headers, timeout=30)
        assert page.status_code == 200 and plan_id in page.text and 'class="heatmap"' in page.text


# -- a real browser ------------------------------------------------------------------------------

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _chromium() -> str:
    path = shutil.which("chromium")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("headless Chromium is not installed and cannot be installed here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, env=env, timeout=600)
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], capture_output=True, env=env, timeout=900)
    path = shutil.which("chromium")
    if not path:
        pytest.skip(f"installing Debian's chromium failed: {r.stderr.decode(errors='replace')[-300:]}")
    return path


def test_plan_page_in_a_real_browser(web, tmp_path):
    chromium = _chromium()
    url = f"{web['url']}login?token={web['token']}&next=/jobs/{web['job']}"
    profile = tmp_path / "profile"
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    html = dom.stdout
    assert f"Job {web['job'][:12]}" in html, dom.stderr[-500:]
    # Heat map: bytes flow host0 -> host1 -> host2 -> host3 along the chain, and nowhere else.
    cells = {(a, b): int(n) for a, b, n in re.findall(r'class="cell" data-from="(\w+)" data-to="(\w+)" data-bytes="(\d+)"', html)}
    nbytes = 1024 * 1025 * 4
    assert {k for k, v in cells.items() if v} == {("host0", "host1"), ("host1", "host2"), ("host2", "host3")}
    assert all(v == nbytes for v in cells.values() if v)
    # NIC bars against the lower bound: every receiving host receives the tensor once.
    bars = {(h, d): float(s) for h, d, s in re.findall(
        r'class="nic-bar" data-host="(\w+)" data-direction="(\w+)" data-seconds="([0-9.e+-]+)"', html)}
    bound = float(re.search(r'class="bound" data-seconds="([0-9.e+-]+)"', html).group(1))
    assert all(bars[h, "recv"] == pytest.approx(bound) for h in HOSTS[1:])
    assert bars["host3", "send"] == 0
    # The chain route, drawn.
    assert re.findall(r'class="chain" data-route="([\w,]+)"', html) == ["host0,host1,host2,host3"]
    assert 'data-mesh="src"' in html and 'data-mesh="dst"' in html
    # Every heat map cell with bytes says how many, and the scale runs from 0 to the largest cell.
    values = re.findall(r'data-bytes="(\d+)"[^>]*>.*?</rect><text class="cell-value"[^>]*>([^<]*)</text>', html)
    assert sorted(text for n, text in values if int(n)) == ["4.0M"] * 3
    assert re.search(r'class="legend-peak" data-bytes="(\d+)"[^>]*>4.0 MiB<', html).group(1) == str(nbytes)
    assert "bytes sent over the network" in html
    # The NIC chart says which bar is which, and the ratio of measured to estimate is put in words.
    legend = re.search(r'<g class="legend nic-legend">(.*?)</g>', html).group(1)
    assert re.findall(r">([^<]+)</text>", legend) == ["send", "receive", "lower bound (busiest NIC at full rate)"]
    ratio = re.search(r'<td class="measured-ratio">([0-9.]+)</td>', html).group(1)
    said = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", re.search(r'<p class="times-explained">(.*?)</p>', html,
                                                                 re.S).group(1)))
    assert f"measured / estimate = {ratio}: the job took {ratio} times as long as the estimate" in said
    _screenshot(chromium, profile, url, tmp_path, "dashboard-plan.png")


def _screenshot(chromium: str, profile: Path, url: str, tmp_path: Path, name: str, height: int = 1100) -> Path:
    """A screenshot of ``url``, copied to $RESHARD_SCREENSHOT_DIR when set (docs/ holds the committed ones)."""
    shot = tmp_path / name
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size=1300,{height}",
                    f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, name
    out = os.environ.get("RESHARD_SCREENSHOT_DIR")
    if out:
        shutil.copy(shot, Path(out) / name)
    return shot


def test_tile_labels_are_whole_and_distinct_tiles_get_distinct_colours(web):
    """Three-dim tiles over 8 devices: labels too long for one line wrap a dim per line, never cut, and the 8
    source tiles (and the 2 destination tiles) each have a colour of their own, the same in both meshes."""
    params = {"shape": "1024,1024,512", "src": "x=2,y=4", "src_spec": "_,x+y,_", "dst": "x=2,y=4",
              "dst_spec": "x,_,_"}
    html = _get(web, "/whatif", params=params).text
    plan = html[re.search(r'<div class="plan" data-plan="\w+" data-strategy="auto">', html).start():]
    devices = re.findall(r'<g class="device" data-device="([^"]+)" data-tile="([^"]+)" data-fill="([^"]+)">'
                         r'.*?<text class="tile-label"[^>]*>(.*?)</text>', plan)
    assert len(devices) == 16
    for _, tile, _, label in devices:
        lines = re.findall(r"<tspan[^>]*>([^<]*)</tspan>", label)
        assert "…" not in label and "".join(lines).replace(" ", "") == tile.replace(" ", "")
    assert max(len(re.findall("<tspan", label)) for *_, label in devices) == 3  # [0:1024, 0:128, 0:512] wraps
    fill_of = {tile: fill for _, tile, fill, _ in devices}
    assert all(fill_of[tile] == fill for _, tile, fill, _ in devices)  # one colour per tile, in both meshes
    assert len(fill_of) == 10 and len(set(fill_of.values())) == 10


def test_a_browser_without_the_token_gets_a_login_page(web, tmp_path):
    base = web["url"].rstrip("/")
    page = httpx.get(f"{base}/jobs", headers={"Accept": "text/html,application/xhtml+xml"}, timeout=30)
    assert page.status_code == 401 and '<form class="login" method="post" action="/login">' in page.text
    assert 'name="next" value="/jobs"' in page.text
    for path in ("/api/jobs", "/metrics"):  # machines keep the JSON answer, even when they accept HTML
        r = httpx.get(base + path, headers={"Accept": "text/html"}, timeout=30)
        assert r.status_code == 401 and r.json() == {"detail": "unauthorized"}
    wrong = httpx.post(f"{base}/login", data={"token": "nope", "next": "/jobs"},
                       headers={"Accept": "text/html"}, timeout=30)
    assert wrong.status_code == 401 and "That is not the token" in wrong.text
    right = httpx.post(f"{base}/login", data={"token": web["token"], "next": "/jobs"}, timeout=30)
    assert right.status_code == 303 and right.headers["location"] == "/jobs"
    assert httpx.get(f"{base}/jobs", cookies={"reshard_admin": right.cookies["reshard_admin"]},
                     timeout=30).status_code == 200
    chromium = _chromium()  # and as a real browser shows it
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          f"{base}/jobs"], capture_output=True, text=True, timeout=120).stdout
    assert '<input type="password" name="token"' in dom and "Log in to the reshard dashboard" in dom


@pytest.mark.slow  # a Chromium start per page: about 30 s; run with RESHARD_SCREENSHOT_DIR=docs to refresh docs/
def test_every_page_in_a_real_browser(web, tmp_path):
    chromium = _chromium()
    whatif = "shape=1024,1024,512&src=x=2,y=4&src_spec=_,x%2By,_&dst=x=2,y=4&dst_spec=x,_,_"
    pages = {"dashboard-cluster.png": "/", "dashboard-tensors.png": "/tensors", "dashboard-jobs.png": "/jobs",
             "dashboard-dry-run-plan.png": f"/plans/{web['dry']}",  # the job's page: test_plan_page_in_a_real_browser
             "dashboard-whatif.png": f"/whatif?{whatif}",
             "dashboard-pipeline.png": "/pipeline?stages=4&microbatches=8"}
    _screenshot(chromium, tmp_path / "anonymous", f"{web['url']}jobs", tmp_path, "dashboard-login.png", 700)
    profile = tmp_path / "profile"
    for name, path in pages.items():
        url = f"{web['url']}login?token={web['token']}&next={quote(path, safe='')}"
        _screenshot(chromium, profile, url, tmp_path, name, 2000 if "whatif" in name else 1100)


def test_running_job_shows_progress_and_the_page_refreshes(tmp_path):
    slow = [*GRPC, "--rate-limit-mib-s", "8"]
    with LocalCluster(2, 1, dashboard=True, log_dir=str(tmp_path), agent_args=slow) as cluster, \
            cluster.connect() as c:
        headers = {"Authorization": f"Bearer {cluster.admin_token}"}
        base = cluster.dashboard_url.rstrip("/")
        data = np.arange(4 * 2**20, dtype=np.float32)  # 16 MiB: about 2 s at 8 MiB/s
        c.put("slow", data, Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,)))
        job = c.reshard("slow", Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None,)))
        seen = None
        for _ in range(200):
            doc = httpx.get(f"{base}/api/jobs/{job.id}", headers=headers, timeout=30).json()
            if doc["state"] == "running" and 0 < doc["bytes_done"] < doc["bytes_total"]:
                seen = doc
                break
            time.sleep(0.02)
        assert seen is not None, "never saw the job part-way"
        assert 0 < seen["percent"] < 100
        page = httpx.get(f"{base}/jobs/{job.id}", headers=headers, timeout=30).text
        assert '<meta http-equiv="refresh" content="2">' in page
        job.result(timeout=60)
        page = httpx.get(f"{base}/jobs/{job.id}", headers=headers, timeout=30).text
        assert 'http-equiv="refresh"' not in page
        assert np.array_equal(c.get("slow"), data)


def test_transport_in_use_is_shown(tmp_path):
    """Agents on the default transport join the collective group; the pages say what carried each transfer."""
    with LocalCluster(2, 1, dashboard=True, log_dir=str(tmp_path)) as cluster, cluster.connect() as c:
        headers = {"Authorization": f"Bearer {cluster.admin_token}"}
        base = cluster.dashboard_url.rstrip("/")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            agents = httpx.get(f"{base}/api/cluster", headers=headers, timeout=30).json()
            if all(a["in_group"] for a in agents):
                break
            time.sleep(0.1)
        assert [(a["transport"], a["in_group"]) for a in agents] == [("auto", True)] * 2
        data = np.arange(1000, dtype=np.int64)
        c.put("t", data, Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None,)))
        job = c.reshard("t", Sharding(Mesh.from_hosts({"x": 1}, ["host1"], 1), (None,))).result(timeout=60)
        doc = httpx.get(f"{base}/api/jobs/{job.id}", headers=headers, timeout=30).json()
        assert doc["transports"] == ["collective"]
        page = httpx.get(f"{base}/jobs/{job.id}", headers=headers, timeout=30).text
        assert re.findall(r'<td class="carried-by">(\w+)</td>', page) == ["collective"]
        assert 'data-host="host0"' in httpx.get(f"{base}/", headers=headers, timeout=30).text


def test_a_job_says_where_its_time_went_in_the_sdk_the_api_and_its_page(web):
    from reshard.server.planner.jobs import PHASES

    c = web["client"]
    src = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    data = np.arange(512 * 300, dtype=np.float32).reshape(512, 300)
    c.put("timed", data, src)
    result = c.reshard("timed", Sharding(Mesh.from_hosts({"x": 2}, HOSTS[:2], 1), ("x", None))).result(timeout=60)
    assert list(result.phases) == list(PHASES) and all(s >= 0 for s in result.phases.values())
    # waiting came before the job started; the rest is the job's own seconds, up to recording the outcome
    assert sum(list(result.phases.values())[1:]) <= result.seconds + 1e-3
    assert list(result.host_seconds) == ["host0", "host1"]
    assert max(result.host_seconds.values()) <= result.phases["running"] + 1e-3
    doc = _get(web, f"/api/jobs/{result.id}").json()
    assert doc["phases"] == pytest.approx(result.phases) and doc["host_seconds"] == pytest.approx(result.host_seconds)
    page = _get(web, f"/jobs/{result.id}").text
    assert re.findall(r'data-phase="(\w+)"', page) == list(PHASES)
    slowest = max(result.host_seconds, key=result.host_seconds.get)
    assert f'class="slowest" data-host="{slowest}"' in page and "of 2 hosts" in page
    c.delete("timed")
