import numpy as np
import reshard
from reshard import Mesh, Sharding

# A planner and 4 agents (hosts host0..host3, 2 devices each) as local processes.
# Against a running cluster: c = reshard.connect("planner-host:50051", token=...) (docs/security.md).
with reshard.local_cluster(hosts=4, devices_per_host=2) as c:
    print(c.devices())  # ['host0/0', 'host0/1', ..., 'host3/1']

    # Stage 1 holds the activations split by rows over hosts host0 and host1.
    stage1 = Mesh.from_hosts({"x": 2, "y": 2}, ["host0", "host1"], devices_per_host=2)
    a = np.random.default_rng(0).standard_normal((1000, 512)).astype(np.float32)
    c.put("activations", a, Sharding(stage1, ("x", None)))

    # Stage 2 wants them replicated over its hosts, columns split over its devices.
    stage2 = Mesh.from_hosts({"x": 2, "y": 2}, ["host2", "host3"], devices_per_host=2)
    target = Sharding(stage2, (None, "y"))
    print(c.plan("activations", target).summary(max_transfers=4))  # dry run: nothing moves

    job = c.reshard("activations", target)  # returns at once; many jobs may run together
    result = job.result(timeout=60)
    print(f"{result.state} in {result.seconds:.3f}s, {result.network_bytes / 2**20:.1f} MiB over the network")

    assert np.array_equal(c.get("activations"), a)
    assert np.array_equal(c.get_shard("activations", "host3/1"), a[:, 256:])
    c.delete("activations")
