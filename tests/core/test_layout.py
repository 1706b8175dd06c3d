"""The service's rooms and the rules between them, read from the imports of every module found.

================ =====================================================================
room             may import (besides the standard library, third-party packages, the
                 core ``reshard.*`` and ``reshard.proto``)
================ =====================================================================
server/common    nothing else of the server
server/transport common
server/agent     common, transport
server/planner   common
server/dashboard common, planner
server/devtools  anything (the lab and the demo drive whole clusters)
server/cli.py    anything (the one command line)
client           nothing of the server; no room but the tools imports the SDK (what
                 both must compute alike, e.g. the CUDA IPC fields, lives in proto/)
================ =====================================================================

The rules come from the issue that made the rooms: the planner and the agent
never import each other, transports never import the planner (nor the agent, whose
runtime they serve), and what both sides share lives in ``common``. Modules are
found by walking the folders, so a new module is checked without listing it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import reshard
from tests.core.test_imports import _imports

SERVER = Path(reshard.__file__).parent.parent / "server"

# room -> rooms of the server it may import
ALLOWED = {
    "common": set(),
    "transport": {"common"},
    "agent": {"common", "transport"},
    "planner": {"common"},
    "dashboard": {"common", "planner"},
}
FREE = {"devtools", "cli"}  # may import any room


def _room_of_file(path: Path, root: Path) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _room_of_import(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] == ["reshard", "server"] and len(parts) > 2:
        return parts[2]
    if parts[:2] == ["reshard", "client"]:
        return "client"  # the SDK: only the tools may drive it
    return None


def _package(path: Path, root: Path) -> str:
    """The package a server module is imported from (``server/`` installs as ``reshard.server``)."""
    return ".".join(["reshard", *path.relative_to(root.parent).parts[:-1]])


def violations(root: Path = SERVER) -> list[str]:
    """Every import of a server module that breaks the room rules, as 'file:line (room) imports name (room)'."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        room = _room_of_file(path, root)
        if room in FREE or path.parent == root and path.name == "__init__.py":
            continue
        allowed = ALLOWED.get(room)
        if allowed is None:
            bad.append(f"{where}: module outside every room; add its folder to the rules")
            continue
        for line, name, _ in _imports(path, _package(path, root)):
            target = _room_of_import(name)
            if target is not None and target != room and target not in allowed:
                found = f"{where}:{line} ({room}) imports {name} ({target})"
                if found not in bad:  # `from x import a, b` yields x once per name
                    bad.append(found)
    return bad


def test_every_room_imports_only_what_its_rules_allow():
    files = list(SERVER.rglob("*.py"))
    assert len(files) >= 20, f"expected the service modules under {SERVER}"
    for room in ALLOWED:
        assert (SERVER / room).is_dir(), f"room server/{room} is missing"
    bad = violations()
    assert not bad, "imports across rooms that the rules forbid:\n" + "\n".join(bad)


@pytest.mark.parametrize("room, planted, target", [
    ("planner", "from reshard.server.agent.store import ShardStore", "agent"),
    ("agent", "import reshard.server.planner.jobs", "planner"),
    ("transport", "from reshard.server.planner import rendezvous", "planner"),
    ("transport", "from reshard.server.agent.runtime import Runtime", "agent"),
    ("common", "from reshard.server.transport import grpc_link", "transport"),
    ("transport", "from reshard.client.client import Client", "client"),
])
def test_a_planted_import_is_caught(tmp_path, room, planted, target):
    """Guards the checker: a copy of the rooms with one forbidden import planted must fail."""
    fake = tmp_path / "server"
    for r in (*ALLOWED, "devtools"):
        (fake / r).mkdir(parents=True)
        (fake / r / "__init__.py").write_text("")
    (fake / room / "planted.py").write_text(f"import os\n{planted}\n")
    bad = violations(fake)
    assert len(bad) == 1 and f"({room}) imports" in bad[0] and f"({target})" in bad[0], bad


def test_relative_imports_are_resolved_to_their_room(tmp_path):
    fake = tmp_path / "server"
    (fake / "planner").mkdir(parents=True)
    (fake / "agent").mkdir(parents=True)
    (fake / "planner" / "x.py").write_text("from ..agent import store\nfrom . import jobs\n")
    bad = violations(fake)
    assert bad == ["server/planner/x.py:1 (planner) imports reshard.server.agent (agent)"]
