"""The rendezvous store owns its listening descriptor: nothing else may close that number later."""

import gc
import os
import socket

import pytest

pytest.importorskip("torch")

from reshard.server.planner.rendezvous import Rendezvous  # noqa: E402


def test_a_gone_store_does_not_close_a_descriptor_opened_after_it():
    rendezvous = Rendezvous("127.0.0.1", 5)
    del rendezvous.store  # the store closes its listening socket as it goes
    gc.collect()
    later = socket.socket()  # takes the lowest free number: the store's, now free
    try:
        del rendezvous
        gc.collect()
        os.fstat(later.fileno())  # raised "Bad file descriptor": the socket object closed the number again
    finally:
        later.close()
