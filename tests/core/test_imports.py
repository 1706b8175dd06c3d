"""Dependencies point one way: the core needs the standard library and numpy only.

Checked twice: at run time (a fresh interpreter imports the core and must not
have loaded grpc, torch, fastapi or our service and SDK packages), and
statically (every import statement of every core module, and of the SDK).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import reshard

CORE = Path(reshard.__file__).parent
SDK = CORE.parent / "client"
# The core's compiled module (reshard/_delta_kernel.c: plain C against Python's own API, no other library) counts as
# core too: numpy does its work where it was not built.
CORE_MODULES = ({p.stem for p in CORE.glob("*.py")} | {p.stem for p in CORE.glob("*.c")}) - {"__init__"}
HEAVY = ("grpc", "torch", "fastapi", "google.protobuf", "reshard.server", "reshard.client", "reshard.proto")
# reshard/__init__.py reaches the SDK lazily, inside `__getattr__`, so that
# `reshard.connect` works while `import reshard` stays numpy-only.
LAZY_ALLOWED = {("__init__.py", "reshard.client")}


def _imports(path: Path, package: str):
    """(line, module, at module level) for every import in ``path``; relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module_level = set()
    for stmt in tree.body:
        module_level.update(id(n) for n in (ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module
            # `from reshard import client` imports the module reshard.client.
            names = [f"{mod}.{a.name}" if mod == "reshard" else mod for a in node.names]
        else:
            continue
        for name in names:
            yield node.lineno, name, id(node) in module_level


def _core_allowed(name: str) -> bool:
    top, _, rest = name.partition(".")
    if top == "reshard":
        return not rest or rest.split(".")[0] in CORE_MODULES
    return top in sys.stdlib_module_names or top == "numpy"


def test_the_core_imports_only_stdlib_numpy_and_itself():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10, f"expected the core modules under {CORE}"
    bad = [
        f"{path.relative_to(CORE.parent)}:{line} imports {name}"
        for path in files
        for line, name, top_level in _imports(path, "reshard")
        if not _core_allowed(name) and (top_level or (path.name, name) not in LAZY_ALLOWED)
    ]
    assert not bad, "the core may import only the standard library, numpy and reshard core modules:\n" + "\n".join(bad)


def test_the_static_check_sees_what_it_must_refuse(tmp_path):
    """Guards the checker itself, so a test that passes means something."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import grpc\nfrom reshard.server import cli\nfrom . import proto\nfrom reshard import plans, client\n"
        "import os, numpy.linalg\nfrom .sharding import Sharding\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\n"
        "def lazy():\n    from reshard import client\n"
    )
    found = list(_imports(sample, "reshard"))
    refused = [(name, top) for _, name, top in found if not _core_allowed(name)]
    assert refused == [("grpc", True), ("reshard.server", True), ("reshard.proto", True), ("reshard.client", True),
                       ("torch", True), ("reshard.client", False)]


def test_the_sdk_never_imports_the_server():
    files = sorted(SDK.rglob("*.py"))
    if not files:
        pytest.skip(f"no SDK at {SDK} yet")
    bad = [
        f"{path.relative_to(SDK.parent)}:{line} imports {name}"
        for path in files
        for line, name, _ in _imports(path, "reshard.client")
        if name.split(".")[:2] == ["reshard", "server"] or name.split(".")[0] == "server"
    ]
    assert not bad, "the client SDK must not import the server:\n" + "\n".join(bad)


def test_importing_the_core_loads_no_service_dependency():
    code = (
        "import json, sys\n"
        "import reshard, reshard.strategies, reshard.cases, reshard.report, reshard.plan_command\n"
        "from reshard import Mesh, Sharding, plan\n"
        "p = plan((8, 8), 'float32', Sharding(Mesh.grid({'x': 2}, 1), ('x',)),"
        " Sharding(Mesh.grid({'x': 2}, 1, 'd'), (None, 'x'))).validate()\n"
        f"heavy = {HEAVY!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(heavy))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_public_api_is_listed_and_resolves_without_the_sdk():
    sdk = {"connect", "local_cluster", "Client"}
    assert len(reshard.__all__) == len(set(reshard.__all__))
    for name in set(reshard.__all__) - sdk:
        assert getattr(reshard, name) is not None, name
    with pytest.raises(AttributeError, match="module 'reshard' has no attribute 'nope'"):
        reshard.nope


def test_no_core_module_is_shadowed_by_a_name_the_package_exports():
    """``reshard.plan`` is a function; a module ``reshard/plan.py`` beside it would be reachable by
    ``from reshard.plans import ...`` yet not by ``import reshard.plan as m`` (the attribute is the function)."""
    assert not CORE_MODULES & set(reshard.__all__), "rename the module, not the public name"
    import importlib

    plans = importlib.import_module("reshard.plans")
    assert plans.Plan is reshard.Plan and callable(reshard.plan) and reshard.plan.__module__ == "reshard.strategies"
