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

Inside the agent's engine each module owns one concern (`INNER`): the transport
interface and the move protocol never import a concrete transport (a new backend is
a file of its own), the agent's kernels, task graph and program view never import
the run or the runtime that use them, no module of the engine grows past
`ENGINE_MAX_LINES`, and who sends what to whom (``reshard.routes``) is defined once.
"""

from __future__ import annotations

import functools
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


ENGINE_ROOMS = ("agent", "transport")
ENGINE_MAX_LINES = 700
CONCRETE_TRANSPORTS = ("grpc_link", "collective", "memory", "faults", "nixl")
# module of a room -> modules of the same room it must not import
INNER = {
    **{f"transport/{m}": {f"transport/{t}" for t in CONCRETE_TRANSPORTS}
       for m in ("base", "streams", "session", "moves", "reduce", "buffers")},
    **{f"agent/{m}": {"agent/run", "agent/runtime"}
       for m in ("kernels", "task_graph", "programs", "staging", "reads")},
    "agent/run": {"agent/runtime"},
}


def inner_violations(root: Path = SERVER) -> list[str]:
    """Every import inside an engine room that `INNER` forbids, as 'file:line imports name'."""
    bad = []
    for module, forbidden in sorted(INNER.items()):
        path = root / f"{module}.py"
        if not path.exists():
            continue
        for line, name, _ in _imports(path, _package(path, root)):
            # `from reshard.server.agent import run` names the module run: try the name and the name with each alias
            for candidate in (name, *(f"{name}.{alias}" for alias in _aliases(path, line))):
                parts = candidate.split(".")
                found = f"{path.relative_to(root.parent)}:{line} imports {candidate}"
                if parts[:2] == ["reshard", "server"] and "/".join(parts[2:4]) in forbidden and found not in bad:
                    bad.append(found)
                    break
    return bad


def _aliases(path: Path, line: int) -> list[str]:
    """The names a ``from ... import`` statement at ``line`` of ``path`` imports."""
    return _from_imports(path).get(line, [])


@functools.cache
def _from_imports(path: Path) -> dict[int, list[str]]:
    """Each ``from ... import`` statement's line in ``path`` -> the names it imports (parsed once a file: asked per
    import line, parsing again each time took 10 s of make test)."""
    import ast

    names: dict[int, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.setdefault(node.lineno, []).extend(a.name for a in node.names)
    return names


def test_the_engines_modules_import_only_downwards():
    for module in INNER:
        assert (SERVER / f"{module}.py").exists(), f"server/{module}.py is missing; update INNER"
    bad = inner_violations()
    assert not bad, "imports inside the engine that its layering forbids:\n" + "\n".join(bad)


@pytest.mark.parametrize("module, planted", [
    ("transport/moves", "from reshard.server.transport.grpc_link import GrpcTransport"),
    ("transport/base", "from reshard.server.transport import collective"),
    ("agent/kernels", "from reshard.server.agent.runtime import Runtime"),
    ("agent/task_graph", "from reshard.server.agent import run"),
])
def test_a_planted_inner_import_is_caught(tmp_path, module, planted):
    fake = tmp_path / "server"
    room, name = module.split("/")
    (fake / room).mkdir(parents=True)
    (fake / room / f"{name}.py").write_text(f"import os\n{planted}\n")
    bad = inner_violations(fake)
    assert len(bad) == 1 and bad[0].startswith(f"server/{module}.py:2 imports"), bad


def test_no_module_of_the_engine_outgrows_one_concern():
    long = [f"{p.relative_to(SERVER.parent)}: {n} lines"
            for room in ENGINE_ROOMS for p in sorted((SERVER / room).glob("*.py"))
            if (n := len(p.read_text().splitlines())) > ENGINE_MAX_LINES]
    assert not long, f"modules of the engine over {ENGINE_MAX_LINES} lines; split them by concern:\n" + "\n".join(long)


def test_who_sends_what_to_whom_is_defined_once():
    """The hop facts live in ``reshard.routes``; a server module that defines a function of the same name
    restates them (as the transport's base module once did)."""
    import ast

    import reshard.routes as routes

    facts = {name for name in routes.__all__ if callable(getattr(routes, name))}
    again = [f"{p.relative_to(SERVER.parent)}:{node.lineno} defines {node.name}"
             for p in sorted(SERVER.rglob("*.py")) for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.FunctionDef) and node.name in facts]
    assert facts >= {"hops", "first_peer", "hop_targets", "receiving_hops", "sending_peers", "stream_count"}
    assert not again, "route facts restated outside reshard.routes:\n" + "\n".join(again)
