"""The manifest gate on a real planner and agents: a reshard_many checked against the consumer's manifest records its
digest (the SDK's JobResult, the dashboard's API and its job page), and one whose tensors miss a layer or carry
per-rank names is refused before anything is planned or moved, listing each difference."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from reshard import Manifest, Mesh, Sharding
from reshard.client import InvalidArgumentError
from reshard.client.cluster import LocalCluster

from .conftest import held_bytes

HOSTS = ["host0", "host1"]
TRAIN = Sharding(Mesh.from_hosts({"x": 2}, ["host0"], 2), ("x", None))
SERVE = Sharding(Mesh.from_hosts({"x": 2}, ["host1"], 2), (None, "x"))


def _model(num_layers: int) -> dict[str, np.ndarray]:
    """A small model's state dict, as the consumer loads it."""
    rng = np.random.default_rng(0)
    sd = {"embed": rng.standard_normal((13, 6)).astype(np.float32)}
    for i in range(num_layers):
        sd[f"layers.{i}.w"] = rng.standard_normal((6, 6)).astype(np.float32)
        sd[f"layers.{i}.norm"] = rng.standard_normal((6,)).astype(np.float32)
    return sd


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gate")
    with LocalCluster(2, 2, dashboard=True, log_dir=str(log_dir), transport="grpc") as cluster:
        with cluster.connect() as c:
            yield cluster, c


def _api(cluster, path: str):
    r = httpx.get(cluster.dashboard_url.rstrip("/") + path, headers={"Authorization": f"Bearer {cluster.admin_token}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_a_matching_manifest_is_recorded_by_the_job_and_shown(web):
    cluster, c = web
    sd = _model(2)
    manifest = Manifest.from_state_dict(sd)
    c.put_many({f"ok/{n}": (t, TRAIN if t.ndim == 2 else Sharding(TRAIN.mesh, (None,))) for n, t in sd.items()})
    prefixed = Manifest({f"ok/{n}": e for n, e in manifest.tensors.items()})
    job = c.reshard_many({f"ok/{n}": SERVE if t.ndim == 2 else Sharding(SERVE.mesh, (None,)) for n, t in sd.items()},
                         manifest=prefixed).result(timeout=60)
    assert job.manifest_digest == prefixed.digest and len(job.manifest_digest) == 64
    assert all(np.array_equal(c.get(f"ok/{n}"), t) for n, t in sd.items())
    assert _api(cluster, f"/api/jobs/{job.id}").json()["manifest_digest"] == prefixed.digest
    page = _api(cluster, f"/jobs/{job.id}").text
    assert f'data-manifest="{prefixed.digest}"' in page and f"manifest {prefixed.digest[:12]}" in page
    assert f'data-manifest="{prefixed.digest}"' in _api(cluster, "/jobs").text
    # A job without a manifest records none, and its row shows none.
    plain = c.reshard_many({"ok/embed": TRAIN}).result(timeout=60)
    assert plain.manifest_digest == "" and _api(cluster, f"/api/jobs/{plain.id}").json()["manifest_digest"] is None


@pytest.mark.parametrize("published", ["missing_layer", "per_rank_names"])
def test_a_sync_that_does_not_match_is_refused_before_anything_moves(web, published):
    cluster, c = web
    consumer = _model(2)
    manifest = Manifest.from_state_dict(consumer)
    if published == "missing_layer":
        sent = {n: t for n, t in consumer.items() if not n.startswith("layers.1.")}
    else:  # a trainer that published its ranks' local shards under local names: half a model each
        sent = {n + f"/rank{r}": part for n, t in consumer.items() if t.ndim == 2
                for r, part in enumerate(np.array_split(t, 2))}
        sent.update({n: t for n, t in consumer.items() if t.ndim == 1})
    one_device = Sharding(Mesh.from_hosts({"x": 1}, ["host0"], 1), (None, None))
    c.put_many({f"{published}/{n}": (t, one_device if t.ndim == 2 else Sharding(one_device.mesh, (None,)))
                for n, t in sent.items()})
    before_jobs, before_held = len(_api(cluster, "/api/jobs").json()), held_bytes(c)
    # The consumer syncs what it expects: every name of its model (those not published are not in the catalog) ...
    targets = {f"{published}/{n}": SERVE if t.ndim == 2 else Sharding(SERVE.mesh, (None,))
               for n, t in consumer.items()}
    # ... or, the per-rank case, what the trainer published.
    if published == "per_rank_names":
        targets = {f"{published}/{n}": Sharding(SERVE.mesh, (None,) * t.ndim) for n, t in sent.items()}
    prefixed = Manifest({f"{published}/{n}": e for n, e in manifest.tensors.items()})
    with pytest.raises(InvalidArgumentError) as e:
        c.reshard_many(targets, manifest=prefixed)
    message = str(e.value)
    assert message.startswith(f"reshard_many of {len(targets)} tensors does not match the consumer's manifest "
                              f"(5 tensors, sha256 {prefixed.digest[:12]}): ")
    if published == "missing_layer":
        assert (f"2 missing: '{published}/layers.1.norm' (not in the catalog), '{published}/layers.1.w' (not in "
                f"the catalog). Nothing moved.") in message
    else:
        assert (f"3 missing: '{published}/embed' (not among the tensors moved), '{published}/layers.0.w' (not "
                f"among the tensors moved), '{published}/layers.1.w' (not among the tensors moved); 6 extra: "
                f"'{published}/embed/rank0', '{published}/embed/rank1', '{published}/layers.0.w/rank0', ") in message
    # Refused as the request arrived: no job was queued, no agent staged a byte.
    assert len(_api(cluster, "/api/jobs").json()) == before_jobs
    assert held_bytes(c) == before_held
    assert all(c.info(f"{published}/{n}").version == 1 for n in sent)
