"""A server whose port is taken refuses to start instead of sharing the port.

gRPC turns SO_REUSEPORT on by default; two agents configured with one port would
then both bind it and the kernel would split connections between them, so one
agent silently received the other's shards. Both services now turn it off.
"""

from __future__ import annotations

import pytest

from reshard.server.agent.service import serve_agent
from reshard.server.common.config import AgentConfig, PlannerConfig
from reshard.server.planner.service import serve_planner


def test_a_second_agent_on_a_taken_port_refuses_to_start():
    server, port, _ = serve_agent(AgentConfig("h0", 1, "127.0.0.1:1", transport="grpc", listen="127.0.0.1:0"))
    try:
        with pytest.raises(OSError, match=rf"reshard.v1.Agent could not bind 127.0.0.1:{port}"):
            serve_agent(AgentConfig("h1", 1, "127.0.0.1:1", transport="grpc", listen=f"127.0.0.1:{port}"))
    finally:
        server.stop(0)


def test_a_second_planner_on_a_taken_port_refuses_to_start():
    server, port, planner = serve_planner(PlannerConfig())
    try:
        with pytest.raises(OSError, match=rf"reshard.v1.Planner could not bind 127.0.0.1:{port}"):
            serve_planner(PlannerConfig(listen=f"127.0.0.1:{port}"))
    finally:
        server.stop(0)
        planner.close()
