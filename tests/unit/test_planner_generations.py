"""Process group generations survive a planner restart (issue 37): a planner with ``--state`` numbers on above every
generation the planner before it announced, so an agent still in the dead planner's group never hears its number
again (it would report that group joined, and the next collective job would run on a closed store)."""

from __future__ import annotations

from reshard.server.common.config import PlannerConfig
from reshard.server.planner.control import GENERATION, Planner
from reshard.server.planner.state import StateStore

STORE_PORT = 1234  # never dialled: the planner only names it to agents


def _planner_with_agents(state_path: str) -> Planner:
    planner = Planner(PlannerConfig(state_path=state_path), agents=None, store_port=STORE_PORT)
    for i, host in enumerate(("a", "b")):
        planner.register(host, 2, f"127.0.0.1:{4000 + i}", 10.0, transport="collective", secret=bytes([i + 1]) * 32)
    return planner


def test_a_restarted_planner_numbers_generations_above_the_dead_one_s(tmp_path):
    state = str(tmp_path / "state.db")
    first = _planner_with_agents(state)
    dead = first.group.view()
    assert dead.members == ("a", "b") and dead.generation >= 1
    first.close()  # as if killed: nothing is written at close
    second = _planner_with_agents(state)
    view = second.group.view()
    assert view.members == ("a", "b") and view.generation > dead.generation
    second.group.reform("a collective job failed")
    assert StateStore(state).counter(GENERATION) == second.group.view().generation == view.generation + 1
    second.close()


def test_without_state_generations_start_at_one():
    planner = Planner(PlannerConfig(), agents=None, store_port=STORE_PORT)
    planner.register("a", 2, "127.0.0.1:4000", 10.0, transport="collective", secret=bytes(32))
    assert planner.group.view().generation == 1
    planner.close()
