"""A service's garbage collector once it is up (`settle_heap`), in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_settled_service_collects_new_cycles_and_leaves_what_was_alive_at_start_up_alone():
    script = textwrap.dedent("""
        import gc, weakref
        from reshard.server.common.lifecycle import YOUNG_OBJECTS, settle_heap

        class Node:
            pass

        before = Node()
        before.me = before  # alive at start-up, in a cycle: frozen with the rest
        settle_heap()
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imported modules' objects
        assert gc.get_threshold()[0] == YOUNG_OBJECTS
        after = Node()
        after.me = after  # made later: a cycle the collector still finds
        gone = weakref.ref(after)
        del after
        gc.collect()
        assert gone() is None
        kept = weakref.ref(before)
        del before
        gc.collect()
        assert kept() is not None  # frozen: no pass visits it
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
