"""A client that checks CUDA IPC before each put (``ipc=True``) asks the planner for the agents' addresses once, not
per put, and again where the list it holds lacks a host or an agent there refuses: an agent that came, or moved to
another address, is found. The planner and the agents are fakes of the client's two seams."""

from __future__ import annotations

import pytest

from reshard.client.client import Client
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import FailedPreconditionError


class FakeCluster:
    """ListAgents answers from ``addresses`` (host -> address), counted; an agent answers CUDA IPC at the addresses in
    ``serving`` and refuses (as an unreachable one does) at any other."""

    def __init__(self, client: Client, addresses: dict[str, str]):
        self.addresses = dict(addresses)
        self.serving = set(addresses.values())
        self.listed = 0
        client._planner_call = self.call
        client._why_no_ipc = lambda address: "" if address in self.serving else \
            f"the agent at {address} did not describe its device (UNAVAILABLE)"

    def call(self, method: str, request, timeout=None):
        assert method == "ListAgents", method
        self.listed += 1
        return pb.AgentList(agents=[pb.AgentInfo(host=h, address=a, num_devices=1, up=True)
                                          for h, a in sorted(self.addresses.items())])


@pytest.fixture()
def client():
    c = Client("127.0.0.1:1")
    try:
        yield c
    finally:
        c.close()


def test_puts_ask_for_the_agents_once(client):
    cluster = FakeCluster(client, {"host0": "a:1", "host1": "b:1"})
    for _ in range(5):
        client._require_ipc(["host0"])
        client._require_ipc({"host0", "host1"})
    assert cluster.listed == 1


def test_a_host_the_list_lacks_and_an_agent_that_moved_are_asked_for_again(client):
    cluster = FakeCluster(client, {"host0": "a:1"})
    client._require_ipc(["host0"])
    cluster.addresses["host1"] = "b:1"
    cluster.serving.add("b:1")
    client._require_ipc(["host1"])  # not in the list held: asked again
    assert cluster.listed == 2
    cluster.addresses["host0"] = "a:2"  # restarted on another port
    cluster.serving = {"a:2", "b:1"}
    client._require_ipc(["host0"])  # the agent at the address held refuses: asked again, and the new one answers
    assert cluster.listed == 3
    client._require_ipc(["host0", "host1"])
    assert cluster.listed == 3


def test_an_agent_that_refuses_at_its_listed_address_fails_the_put(client):
    cluster = FakeCluster(client, {"host0": "a:1"})
    cluster.serving = set()
    with pytest.raises(FailedPreconditionError, match=r"^ipc=True, but the agent at a:1 did not describe its device "
                                                      r"\(UNAVAILABLE\); pass ipc='auto' to stream the bytes instead$"):
        client._require_ipc(["host0"])
    client._require_ipc(["host1"])  # a host with no agent is left to the planner's BeginUpload, as before
