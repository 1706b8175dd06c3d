"""bench/_program_parts.py, what the MoE benches measure of a program beyond its own figures: each host's slice of
the program text holds exactly the steps that host's agent runs tasks for (its buckets and tensors with them), its
size is the length of that text, and the lower bound over many tensors is the core's bound where there is one
tensor, adding up where there are more.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from reshard import Mesh, Sharding, Topology, plan
from reshard.many import plan_many
from reshard.program import TensorDecl
from reshard.server.agent.buckets import bucket_moves
from reshard.server.agent.task_graph import host_tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parts():
    spec = importlib.util.spec_from_file_location("bench_program_parts", ROOT / "bench" / "_program_parts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


TRAIN = Mesh.grid({"host": 2, "gpu": 2}, 2, "t")
SERVE = Mesh.grid({"host": 3, "gpu": 2}, 2, "s")


def _program():
    """Rows over the training devices to: every serving device (broadcast chains over hosts), rows over each
    serving host's devices, and a bf16 weight quantized on the way (gathers, quantize computes, fp8 moves)."""
    rows = Sharding(TRAIN, (("host", "gpu"), None))
    return plan_many([
        TensorDecl("big", (256, 256), "float32", rows, Sharding(SERVE, (None, None))),
        TensorDecl("rows", (256, 64), "float32", rows, Sharding(SERVE, ("gpu", None))),
        TensorDecl("w", (256, 256), "bfloat16", rows, Sharding(SERVE, ("gpu", None))),
        TensorDecl("w_s", (2, 2), "float32", None),
        *(TensorDecl(f"norm{i}", (16,), "float32", Sharding(TRAIN, (None,)), Sharding(SERVE, (None,)))
          for i in range(4)),
    ], Topology(nic_gbps=10.0), scales={"w": "w_s"}, dtypes={"w": "float8_e4m3fn"})


def test_a_hosts_slice_holds_the_steps_its_agent_runs_and_its_size_is_that_texts(parts):
    program = _program()
    assert program.buckets and any(s.kind == "compute" for s in program.steps)
    sizes = parts.host_slice_bytes(program)
    buckets = bucket_moves(program)
    hosts = sorted({d.split("/")[0] for d in TRAIN.devices + SERVE.devices})
    assert sorted(sizes) == hosts
    total = len(program.dumps())
    for host in hosts:
        text = parts.host_slice_text(program, host)
        assert sizes[host] == len(text), host
        assert 0 < len(text) < total
        data = json.loads(text)
        # what the agent's task graph makes tasks of on this host, a bucket's members with their lead
        ran = set()
        for task in host_tasks(program, host, buckets):
            ran |= set(buckets[task.step.id].ids) if task.step.id in buckets else {task.step.id}
        assert {s["id"] for s in data["steps"]} == ran, host
        assert data["steps"] == [program.steps[i].to_json() for i in sorted(ran)]
        named = {s.get("tensor") for s in data["steps"]} | {r["tensor"] for s in data["steps"]
                                                             for r in (*s.get("inputs", ()), s.get("output") or {})
                                                             if "tensor" in r}
        assert {t["name"] for t in data["tensors"]} == named - {None}
        assert all(b[0] in ran and set(b) <= ran for b in data["buckets"])
    # every bucket is in the slices of its hosts
    assert {tuple(b) for h in hosts for b in json.loads(parts.host_slice_text(program, h))["buckets"]} == \
        set(program.buckets)


def test_the_many_tensor_bound_is_the_cores_for_one_tensor_and_adds_up(parts):
    topo = Topology(nic_gbps=10.0)
    one = TensorDecl("a", (512, 256), "float32", Sharding(TRAIN, (("host", "gpu"), None)),
                     Sharding(SERVE, ("gpu", None)))
    whole = TensorDecl("b", (300, 70), "bfloat16", Sharding(TRAIN, ("gpu", None)), Sharding(SERVE, (None, "gpu")))
    for t in (one, whole):
        assert parts.many_lower_bound([t], topo) == pytest.approx(
            plan(t.shape, t.dtype, t.src, t.dst, topo).lower_bound_seconds, rel=1e-12)
    assert parts.many_lower_bound([one, TensorDecl("c", one.shape, one.dtype, one.src, one.dst)], topo) == \
        pytest.approx(2 * parts.many_lower_bound([one], topo), rel=1e-12)
    # counted at the itemsize it travels in: one byte an element instead of four
    assert parts.many_lower_bound([one], topo, {"a": 1}) == pytest.approx(
        parts.many_lower_bound([one], topo) / 4, rel=1e-12)
    # on the same hosts: what a host already holds is not needed
    same = TensorDecl("d", (512, 256), "float32", Sharding(TRAIN, ("host", None)), Sharding(TRAIN, ("gpu", None)))
    assert parts.many_lower_bound([same], topo) == pytest.approx(
        plan(same.shape, same.dtype, same.src, same.dst, topo).lower_bound_seconds, rel=1e-12)
