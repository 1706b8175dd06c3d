"""A planner that cuts large programs per host (`--slice-program-bytes`, `reshard.host_slice`), with real agents: a
quantized MoE state dict's job hands each agent only its host's part, arrives bit for bit the reference quantizer's,
and runs again from the slices the agents keep; a small job under the threshold goes whole; the job's record and its
dashboard page say what each host was handed. (The shared cluster of the other integration tests cuts every
program, so every one of them runs on slices too.)"""

from __future__ import annotations

import httpx
import ml_dtypes
import numpy as np
import pytest

from reshard import Mesh, Sharding
from reshard.client import LocalCluster
from reshard.dtypes import bfloat16_to_float32, float32_to_bfloat16
from reshard.moe import moe_state_dict
from tests.core.test_fp8_kernels import reference
from tests.integration.test_quantize_on_the_way import SERVE_GRID, TINY_MOE, TRAIN_GRID

SLICE_BYTES = 16 << 10  # the tiny MoE's program text is larger (57 KB), two small tensors' smaller


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    with LocalCluster(4, 2, dashboard=True, log_dir=str(tmp_path_factory.mktemp("slices")),
                      planner_args=["--slice-program-bytes", str(SLICE_BYTES)], agent_args=["--transport", "grpc"]) \
            as cluster, cluster.connect() as client:
        yield cluster, client


def _job(cluster, job_id: str) -> dict:
    r = httpx.get(cluster.dashboard_url.rstrip("/") + f"/api/jobs/{job_id}",
                  headers={"Authorization": f"Bearer {cluster.admin_token}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def _page(cluster, job_id: str) -> str:
    r = httpx.get(cluster.dashboard_url.rstrip("/") + f"/jobs/{job_id}",
                  headers={"Authorization": f"Bearer {cluster.admin_token}"}, timeout=30, follow_redirects=True)
    r.raise_for_status()
    return r.text


def _step_values(case, seed: int) -> dict[str, np.ndarray]:
    """A training step's weights of ``case``: bf16 (float32 where the case says), drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    values = {}
    for t in case.weights:
        x = (rng.standard_normal(t.shape) * 0.02).astype(np.float32)
        values[t.name] = x if t.dtype == "float32" else float32_to_bfloat16(x).view(ml_dtypes.bfloat16)
    return values


def _check_served(got: dict, values: dict, case) -> None:
    """Every weight as served is what was published, bit for bit, or its quantized form the reference quantizer
    makes, with its scales."""
    for t in case.weights:
        if t.name not in case.scales:
            assert got[t.name].tobytes() == values[t.name].tobytes(), t.name
            continue
        codes, scales = reference(bfloat16_to_float32(values[t.name].view(np.uint16)), 128)
        np.testing.assert_array_equal(got[t.name].view(np.uint8), codes, err_msg=t.name)
        np.testing.assert_array_equal(got[case.scales[t.name]], scales, err_msg=t.name)


def test_each_agent_gets_its_hosts_part_of_a_quantized_moe_and_the_result_is_bit_exact(web):
    cluster, client = web
    case = moe_state_dict(TINY_MOE, TRAIN_GRID, SERVE_GRID, ep_devices=2)
    names = [t.name for t in case.tensors]
    dtypes = {k: d for k, d in case.serve_dtypes.items() if k not in case.scales.values()}
    for step in range(2):  # the second sync runs the same program: the agents hold their slices
        values = _step_values(case, step)
        client.put_many({t.name: (values[t.name], t.src) for t in case.weights}, step=step)
        result = client.reshard_many({t.name: t.dst for t in case.weights}, scales=case.scales,
                                     dtype=dtypes).result(timeout=300)
        assert result.state == "succeeded", result.error
        _check_served(client.get_many(names), values, case)
        handed = _job(cluster, result.id)["program_bytes"]
        assert sorted(handed) == ["host0", "host1", "host2", "host3"]
        # each its own part: the training hosts' (sends and quantizes) and the serving hosts' (receives) differ
        assert len(set(handed.values())) > 1 and min(handed.values()) > 0, handed
        assert "each its own part" in _page(cluster, result.id)


# 10 s (three quantized steps): in the slow suite; make test syncs registered syncs in test_registered_sync.py and
# checks a quantizing one's checks in tests/unit/test_sync_counters.py.
@pytest.mark.slow
def test_a_registered_sync_quantizes_a_moe_on_the_way_every_step_bit_exact_on_one_program(web):
    cluster, client = web
    case = moe_state_dict(TINY_MOE, TRAIN_GRID, SERVE_GRID, ep_devices=2)
    names = [t.name for t in case.tensors]
    dtypes = {k: d for k, d in case.serve_dtypes.items() if k not in case.scales.values()}
    weights = {t.name: t for t in case.weights}
    client.put_many({n: (np.zeros(t.shape, np.float32).astype(ml_dtypes.bfloat16 if t.dtype != "float32"
                                                               else np.float32), t.src) for n, t in weights.items()})
    sync = client.register_sync({n: t.dst for n, t in weights.items()}, scales=case.scales, dtype=dtypes)
    programs = set()
    try:
        for step in range(3):  # the trainer publishes bf16, the sync commits fp8 over it: every step
            values = _step_values(case, 10 + step)
            client.put_many({n: (values[n], t.src) for n, t in weights.items()}, step=step)
            result = sync.run(version=step).result(timeout=300)
            programs.add(result.plan_id)
            _check_served(client.get_many(names), values, case)
            assert _job(cluster, result.id)["sync"] == sync.id
        assert len(programs) == 1, programs
        # the same as a reshard_many naming the step: the scales the syncs made carry no later step of their own,
        # and are read as they are
        client.put_many({n: (values[n], t.src) for n, t in weights.items()}, step=3)
        again = client.reshard_many({n: t.dst for n, t in weights.items()}, scales=case.scales, dtype=dtypes,
                                    version=3).result(timeout=300)
        assert again.plan_id in programs and _job(cluster, again.id)["sync"] is None
    finally:
        client.delete_many([n for n in names if n in {t.name for t in client.tensors()}])


def test_a_program_under_the_threshold_goes_whole_to_every_agent(web):
    cluster, client = web
    src = Sharding(Mesh.from_hosts({"x": 2}, ["host0", "host1"], 1), ("x", None))
    dst = Sharding(Mesh.from_hosts({"y": 2}, ["host2", "host3"], 1), (None, "y"))
    a, b = np.arange(64, dtype=np.float32).reshape(8, 8), np.ones((8, 8), np.float32)
    client.put_many({"small.a": (a, src), "small.b": (b, src)})
    result = client.reshard_many({"small.a": dst, "small.b": dst}).result(timeout=60)
    assert result.state == "succeeded", result.error
    assert np.array_equal(client.get("small.a"), a) and np.array_equal(client.get("small.b"), b)
    handed = _job(cluster, result.id)["program_bytes"]
    assert len(set(handed.values())) == 1 and 0 < next(iter(handed.values())) < SLICE_BYTES, handed
