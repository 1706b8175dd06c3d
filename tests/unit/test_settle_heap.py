"""A service process moves its start-up objects out of the cyclic collector's sight once it has started."""

import subprocess
import sys


def test_settle_heap_freezes_what_start_up_made_and_collects_first():
    code = (
        "import gc, weakref\n"
        "from reshard.server.common.lifecycle import settle_heap\n"
        "class Node: pass\n"
        "a = Node(); a.self = a; gone = weakref.ref(a); del a\n"  # cyclic garbage: collected, not frozen
        "assert gc.get_freeze_count() == 0\n"
        "settle_heap()\n"
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n"
        "assert gone() is None\n"
        "assert gc.isenabled()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

