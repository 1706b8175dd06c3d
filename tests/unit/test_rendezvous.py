"""The rendezvous store: bound before torch is imported, started on that socket, owning its descriptor."""

import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("torch")

from reshard.proto.errors import FailedPreconditionError  # noqa: E402
from reshard.server.planner.membership import GroupCoordinator  # noqa: E402
from reshard.server.planner.registry import Registry  # noqa: E402
from reshard.server.planner.rendezvous import Rendezvous  # noqa: E402


def test_a_gone_store_does_not_close_a_descriptor_opened_after_it():
    rendezvous = Rendezvous("127.0.0.1", 5)
    rendezvous.start()
    del rendezvous.store  # the store closes its listening socket as it goes
    gc.collect()
    later = socket.socket()  # takes the lowest free number: the store's, now free
    try:
        del rendezvous
        gc.collect()
        os.fstat(later.fileno())  # raised "Bad file descriptor": the socket object closed the number again
    finally:
        later.close()


def test_the_port_is_known_before_torch_is_imported_and_a_client_that_came_early_is_served():
    script = textwrap.dedent("""
        import sys, threading
        from reshard.server.planner.rendezvous import Rendezvous
        r = Rendezvous("127.0.0.1", 10)
        print("torch imported before start:", "torch" in sys.modules)
        import torch.distributed as dist
        from datetime import timedelta
        got = []
        def early():  # connects while nothing but the bound socket is there
            c = dist.TCPStore("127.0.0.1", r.port, is_master=False, timeout=timedelta(seconds=10))
            c.set("k", b"v")
            got.append(c.get("k"))
        t = threading.Thread(target=early)
        t.start()
        t.join(0.5)
        print("served before start:", bool(got))
        r.start()
        t.join(10)
        print("served after start:", got)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["torch imported before start: False", "served before start: False",
                                       "served after start: [b'v']"]


def test_a_store_that_fails_to_start_closes_its_socket_and_the_planner_stops_offering_it(monkeypatch):
    rendezvous = Rendezvous("127.0.0.1", 5)
    port = rendezvous.port
    registry = Registry(heartbeat_timeout_s=5.0)
    group = GroupCoordinator(registry, port)

    def broken():
        raise ImportError("libtorch_cpu.so: cannot open shared object file")

    monkeypatch.setattr("reshard.server.planner.rendezvous.require_torch", broken)
    rendezvous.start_in_background(group.store_failed).join(10)
    assert rendezvous.store is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    view = group.register("h0", "auto", "gloo", admit=lambda: registry.register("h0", 1, "h0:1", 10.0,
                                                                             secret=bytes(16)))
    assert view.store_port == 0
    assert "libtorch_cpu.so" in group.reason("h0")
    with pytest.raises(FailedPreconditionError, match="rendezvous store did not start: ImportError: libtorch_cpu"):
        group.register("h1", "collective", "gloo")
    rendezvous.forget_job(1, "job", {0: ["h0"]})  # nothing to forget, and no store to ask
    assert not [t for t in threading.enumerate() if t.name == "rendezvous-start"]
