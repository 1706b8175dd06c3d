"""One `put_state_dict` from 4 DTensor ranks (gloo, CPU) is ONE transaction: a reader polling the current versions
while the ranks publish step after step never sees two steps at once, in the catalog's labels or in the bytes it
reads; and a rank that dies midway through a publish leaves no new version: the others are told which device never
came once the group expires, and the catalog still holds the last complete step.

The tensors: uneven Shard(0) and Shard(1) DTensors, a Replicate one and a plain buffer, each holding
``pattern + step`` (``pattern`` a distinct number per element), so every value read says which step it is from.

This file is also the ranks' program: ``python test_atomic_publish.py RANK STORE PLANNER OUT``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from reshard.client.cluster import LocalCluster
from reshard.proto.errors import NotFoundError

WORLD = 4
HOSTS = ["host0", "host1"]  # 2 ranks a host
STEPS = 8
UPLOAD_TIMEOUT_S = 3.0
HELD_STEPS = (2, 4, 6)  # rank 0 waits after publishing these until the reader has seen them (see _held)
PREFIX = "atomic/"
# name -> (shape, placement): "S0"/"S1" Shard(dim), "R" Replicate, "plain" a plain tensor (put by the first rank)
TENSORS = {f"layers.{i}.{kind}": (shape, placement) for i in range(3) for kind, shape, placement in (
    ("w", (13, 6), "S0"), ("v", (5, 9), "S1"), ("norm", (6,), "R"), ("scale", (2, 2), "plain"))}


def _pattern(shape) -> np.ndarray:
    """A distinct value per element, 1000 apart, so that adding the step keeps both readable (exact in float32)."""
    return (np.arange(int(np.prod(shape)), dtype=np.float32) * 1000).reshape(shape)


def _steps_of(values: dict) -> set:
    """The steps the values read are from: (value - pattern) per element, over every tensor."""
    found = set()
    for name, v in values.items():
        v = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
        found.update(np.unique(v - _pattern(v.shape)).tolist())
    return found


def _held(out: str, step: int, timeout_s: float = 60.0) -> None:
    """Rank 0 waits until the test's reader has seen ``step``, so that the reads span several publishes however
    the 2 cores are shared; the other ranks go on into the next publish, which cannot commit without rank 0, so the
    reader keeps polling while a publish is half handed over."""
    deadline = time.monotonic() + timeout_s
    while not Path(out, f"seen-{step}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the reader never saw step {step} in {timeout_s:g}s")
        time.sleep(0.01)


# -- the ranks -------------------------------------------------------------------------------------------------

def _rank_main(rank: int, store_path: str, planner: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import reshard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    placements = {"S0": [Shard(0)], "S1": [Shard(1)], "R": [Replicate()]}
    state = {}
    for name, (shape, placement) in TENSORS.items():
        full = torch.from_numpy(_pattern(shape))
        state[name] = full if placement == "plain" else distribute_tensor(full, mesh, placements[placement])
    report: dict = {"published": []}
    with reshard.connect(planner) as c:
        devices = c.mesh_devices(mesh, HOSTS)
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                for t in state.values():
                    (t.to_local() if hasattr(t, "to_local") else t).add_(1.0)  # pattern + step
            c.put_state_dict(state, devices, step=step, prefix=PREFIX)
            report["published"].append(step)
            if rank == 0 and step in HELD_STEPS:
                _held(out, step)
        # The last publish: rank 3 hands over half its shards and dies; the others wait for the group's outcome.
        if rank == WORLD - 1:
            real = c.put_shard_group

            def dies_midway(key, tensors, shards, **kwargs):
                real(key, tensors, shards[:len(shards) // 2], **{**kwargs, "wait": False})
                os._exit(17)

            c.put_shard_group = dies_midway
        with torch.no_grad():
            for t in state.values():
                (t.to_local() if hasattr(t, "to_local") else t).add_(1.0)
        try:
            c.put_state_dict(state, devices, step=STEPS + 1, prefix=PREFIX)
        except reshard.ReshardError as e:
            report["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # rank 3 is gone: a gloo teardown would wait for it


# -- the test --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def short_lived_uploads():
    """A cluster of its own whose uploads expire after 3 s idle, so a dead rank's group ends within the test."""
    pytest.importorskip("torch")
    with LocalCluster(2, 2, planner_args=["--upload-timeout", str(UPLOAD_TIMEOUT_S)], transport="grpc") as cluster:
        yield cluster


def test_readers_never_see_two_steps_at_once_and_a_rank_that_dies_midway_leaves_no_version(short_lived_uploads,
                                                                                           tmp_path):
    cluster = short_lived_uploads
    names = [PREFIX + n for n in TENSORS]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RESHARD_TOKEN": cluster.token}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(tmp_path / "store"), cluster.address,
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    # per poll: the steps of the labels (one catalog call), then the steps of the bytes (one get_many, which may
    # see a later step: a publish may commit between the two)
    reads: list[tuple[set, set]] = []
    stop = threading.Event()

    def poll():
        with cluster.connect() as c:
            while not stop.is_set():
                try:
                    labels = {t.step for t in c.locate(names)}
                    values = c.get_many(names)
                except NotFoundError:  # before the first publish, or a version freed between the two calls
                    time.sleep(0.005)
                    continue
                reads.append((labels, _steps_of(values)))
                for step in labels:
                    (tmp_path / f"seen-{step}").touch()

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        stop.set()
        reader.join()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    mixed = [r for r in reads if len(r[0]) != 1 or len(r[1]) != 1]
    assert not mixed, f"{len(mixed)} of {len(reads)} reads saw several steps at once, e.g. {mixed[:3]}"
    codes = [p.returncode for p in procs]
    assert codes == [0, 0, 0, 17], "\n".join(f"rank {r} exited {c}:\n{o[-3000:]}"
                                             for r, (c, o) in enumerate(zip(codes, outputs)))
    seen = sorted({next(iter(labels)) for labels, _ in reads})
    assert set(HELD_STEPS) <= set(seen) <= set(range(1, STEPS + 1)), seen  # the reads spanned the publishes
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD - 1)]
    for r, report in enumerate(reports):
        assert report["published"] == list(range(1, STEPS + 1))
        assert report["error"].startswith("FailedPreconditionError: upload group "), report["error"]
        assert (f"of {len(TENSORS)} tensors expired after {UPLOAD_TIMEOUT_S:g}s without activity, before devices "
                f"['host1/1'] handed over their shards (did a rank die midway?); nothing of it was committed: "
                f"publish again from every rank") in report["error"], f"rank {r}: {report['error']}"
    with cluster.connect() as c:
        assert {t.step for t in c.locate(names)} == {STEPS}
        assert _steps_of(c.get_many(names)) == {STEPS}
        assert all(len(c.versions(n)) == 1 for n in names)  # nothing of step 9 is held


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
