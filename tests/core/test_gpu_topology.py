"""The topology of a GPU host (`Topology.gpu_hosts`): 8 rail-aligned NICs of 400 Gbit/s and NVLink 4, and the
cost model's estimates and lower bounds on it; every topology of one NIC a host prices, reads and writes as before.
"""

from __future__ import annotations

import pytest

from reshard import InvalidTopologyError, Mesh, Sharding, Topology, plan


def test_a_gpu_host_has_eight_rails_of_400_gbit_and_nvlink_4():
    t = Topology.gpu_hosts()
    assert t.nics_per_host == 8 and t.nic_gbps == 400.0
    assert t.nic_bytes_per_s("h0") == 400e9  # 8 x 50 GB/s: the host's rails added up
    assert t.rail_bytes_per_s("h0") == 50e9  # one NIC: one device's traffic on its own rail
    assert t.intra_bytes_per_s("h0") == 450e9  # NVLink 4: 450 GB/s in each direction
    assert t.memory_bytes_per_s("h0") == 3350e9
    assert str(t) == "Topology(NIC 8 x 400 Gbit/s, intra-host 3600 Gbit/s)"


def test_an_override_is_the_hosts_whole_network_rate():
    t = Topology(nic_gbps=400.0, nics_per_host=8, host_nic_gbps={"slow": 800.0})
    assert t.nic_bytes_per_s("slow") == 100e9 and t.rail_bytes_per_s("slow") == 12.5e9
    assert t.nic_bytes_per_s("other") == 400e9


def test_one_nic_a_host_prices_reads_and_writes_as_before():
    t = Topology(nic_gbps=25.0, host_nic_gbps={"a": 50.0})
    assert t.nics_per_host == 1
    assert t.nic_bytes_per_s("b") == t.rail_bytes_per_s("b") == 25e9 / 8
    assert "nics_per_host" not in t.to_json()  # plan ids hash this JSON: unchanged for every older topology
    assert str(t) == "Topology(NIC 25 Gbit/s, intra-host 100 Gbit/s, 1 NIC overrides)"
    gpu = Topology.gpu_hosts()
    assert gpu.to_json()["nics_per_host"] == 8
    assert Topology.from_json(gpu.to_json()) == gpu
    assert Topology.from_json({"nic_gbps": 25.0}).nics_per_host == 1


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "8", 65])
def test_a_nic_count_that_is_no_whole_number_of_nics_is_refused(bad):
    with pytest.raises(InvalidTopologyError, match=r"^nics_per_host is .*; a host has a whole number of NICs from 1 "
                                                   r"to 64 \(a GPU host has one per GPU: 8\)$"):
        Topology(nics_per_host=bad)


def test_estimate_and_bound_of_a_host_to_host_move_are_for_eight_rails():
    # Every device of host t0 sends its tile to the same device of host s0 (rail-aligned): 64 MiB leave t0's NICs.
    train = Mesh.grid({"host": 1, "gpu": 8}, 8, "t")
    serve = Mesh.grid({"host": 1, "gpu": 8}, 8, "s")
    shape = (8 * 1024, 2048)  # float32: 64 MiB
    nbytes = shape[0] * shape[1] * 4
    p = plan(shape, "float32", Sharding(train, ("gpu", None)), Sharding(serve, ("gpu", None)), Topology.gpu_hosts())
    assert p.lower_bound_seconds == pytest.approx(nbytes / 400e9, rel=1e-12)
    assert p.estimate_seconds == pytest.approx(nbytes / 400e9, rel=1e-12)
    one_nic = plan(shape, "float32", Sharding(train, ("gpu", None)), Sharding(serve, ("gpu", None)),
                   Topology(nic_gbps=400.0, intra_host_gbps=3600.0))
    assert one_nic.estimate_seconds == pytest.approx(8 * p.estimate_seconds, rel=1e-12)


def test_hosts_that_share_a_machine_are_named_and_read_and_written_only_where_they_do():
    t = Topology(host_machine={"a": "m1", "b": "m1", "c": "m2"})
    assert t.machine("a") == t.machine("b") == "m1" and t.machine("d") != t.machine("e")
    assert t.apart("c", ["a", "d"]) and not t.apart("a", ["b", "c"]) and not t.apart("d", ["d"])
    assert Topology().apart("a", ["b", "c"]) and not Topology().apart("a", ["a", "b"])
    assert Topology.from_json(t.to_json()) == t and t.to_json()["host_machine"] == {"a": "m1", "b": "m1", "c": "m2"}
    assert "host_machine" not in Topology().to_json()  # plan ids hash this JSON: unchanged where no host shares one
    with pytest.raises(InvalidTopologyError, match="host_machine names a host with an empty machine"):
        Topology(host_machine={"a": ""})
