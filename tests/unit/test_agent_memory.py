"""An agent process's memory settings (`reshard.server.agent.memory`), each in a process of its own: they change
the whole process."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_startup_objects_are_frozen_out_of_full_collections_and_later_ones_are_not():
    """After startup (torch imported) the collector tracks hundreds of thousands of objects; frozen, a full pass
    walks none of them, while what the agent makes later is still collected, cycles included."""
    out = _run("""
        import gc, torch, weakref
        from reshard.server.agent.memory import freeze_startup_objects
        before = len(gc.get_objects())
        frozen = freeze_startup_objects()
        after = len(gc.get_objects())
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        print(before, frozen, after, gone() is None)
    """)
    before, frozen, after, collected = out.split()
    assert int(before) > 100_000 and int(frozen) >= int(before) * 0.9 and int(after) < 1_000
    assert collected == "True"
