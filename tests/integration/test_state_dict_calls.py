"""The state-dict calls on the shared cluster from one process, in seconds: a plain torch module published (one
transaction, labeled with its step), moved into another layout by `sync_state_dict` and read into modules in place
(float32 and bfloat16, cast on the way) through a pin while the next step commits; the rank-to-device table; and
the put side's manifest gate, which sends nothing. The FSDP2 and tensor-parallel loop is test_state_dict.py."""

from __future__ import annotations

import numpy as np
import pytest

from reshard import Manifest, ManifestError
from reshard.client import InvalidArgumentError

from .conftest import held_bytes

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parametrize("cluster", ["grpc"], indirect=True)


class _Net(torch.nn.Module):
    def __init__(self, seed: int, rows: int = 13):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(rows, 6)
        self.proj = torch.nn.Linear(6, 5)
        self.register_buffer("scale", torch.arange(3, dtype=torch.int64))


class _FakeMesh:
    """What mesh_devices reads of a DeviceMesh: its ranks."""

    def __init__(self, ranks):
        self.mesh = np.array(ranks)


def test_mesh_devices_places_ranks_in_order_over_the_hosts(client):
    assert client.mesh_devices(_FakeMesh([[4, 5], [6, 7]]), ["a", "b"]) == {4: "a/0", 5: "a/1", 6: "b/0", 7: "b/1"}
    assert client.mesh_devices(_FakeMesh([2, 0, 1]), "h") == {0: "h/0", 1: "h/1", 2: "h/2"}
    with pytest.raises(InvalidArgumentError, match=r"the mesh's 3 ranks do not split evenly over hosts \['a', 'b'\]"):
        client.mesh_devices(_FakeMesh([0, 1, 2]), ["a", "b"])


def test_publish_sync_and_read_in_place_through_a_pin(client):
    prefix = "sdcalls/"
    trainer = _Net(0)
    want = {n: t.clone() for n, t in trainer.state_dict().items()}
    published = client.put_state_dict(trainer, ["host0/0", "host0/1", "host1/0"], step=1, prefix=prefix)
    assert published == Manifest.from_module(trainer)
    assert {t.name: t.step for t in client.tensors() if t.name.startswith(prefix)} == {
        prefix + n: 1 for n in want}
    serving = _Net(1)  # other weights until it reads
    layout = client.state_dict_shardings(serving, ["host2/0", "host3/0"], prefix=prefix)
    assert {s.spec_str() for s in layout.values()} == {"P(None, None)", "P(None)"}  # plain tensors: replicated
    assert {s.mesh.devices for s in layout.values()} == {("host2/0", "host3/0")}
    job = client.sync_state_dict(serving, ["host2/0", "host3/0"], version=1, prefix=prefix,
                                 manifest=Manifest.from_module(serving), timeout=60)
    assert job.manifest_digest == Manifest.from_module(serving).with_prefix(prefix).digest
    assert client.info(prefix + "proj.weight").sharding.mesh.hosts == ("host2", "host3")
    pin = client.pin([prefix + n for n in want])
    # The trainer's next step commits while the pin holds step 1.
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1.0)
    client.put_state_dict(trainer, ["host0/0"], step=2, prefix=prefix)
    embed = serving.embed.weight
    filled = client.get_state_dict(serving, "host2/0", version=pin, prefix=prefix)
    assert filled["embed.weight"] is embed  # in place: the module's own parameter
    assert all(torch.equal(serving.state_dict()[n], t) for n, t in want.items())
    bf16 = _Net(2).to(torch.bfloat16)
    client.get_state_dict(bf16, version=pin, prefix=prefix, dtype=torch.bfloat16)
    for n, t in bf16.state_dict().items():
        assert t.dtype == (torch.int64 if n == "scale" else torch.bfloat16)
        assert torch.equal(t, want[n].to(t.dtype)), n
    client.release(pin)
    fresh = client.get_state_dict(Manifest.from_module(trainer), prefix=prefix)  # the current step: 2
    assert torch.equal(fresh["proj.bias"], trainer.proj.bias.detach())
    with pytest.raises(InvalidArgumentError, match=r"get_state_dict\(dtype=torch.bfloat16\) fills tensors in place, "
                                                   r"but 3 are of another dtype: 'embed.weight' \(torch.float32\)"):
        client.get_state_dict(_Net(3), prefix=prefix, dtype=torch.bfloat16)
    for n in want:
        client.delete(prefix + n)


def test_put_state_dict_refuses_a_state_dict_unlike_the_manifest_and_sends_nothing(client):
    consumer = Manifest.from_module(_Net(0))
    before = held_bytes(client)
    wrong = {k: v for k, v in _Net(0, rows=12).state_dict().items() if k != "proj.bias"}
    with pytest.raises(ManifestError) as e:
        client.put_state_dict(wrong, ["host0/0"], manifest=consumer, prefix="sdgate/")
    assert str(e.value).startswith(
        f"put_state_dict of 3 tensors does not match the consumer's manifest (4 tensors, sha256 "
        f"{consumer.digest[:12]}): 1 missing: 'proj.bias'; 1 mismatched: 'embed.weight' is float32[12, 6] where the "
        f"manifest has float32[13, 6]. Nothing moved.")
    assert not [t.name for t in client.tensors() if t.name.startswith("sdgate/")]
    # no agent holds more than before (an earlier test's deleted tensors may still be leaving them)
    after = held_bytes(client)
    assert all(after[h] <= before[h] for h in before), (before, after)
