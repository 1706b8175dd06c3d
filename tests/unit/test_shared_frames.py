"""`SharedFrames`: a delta frame that several move steps of a run send (a star's streams of one box from one device)
is encoded once, whichever step asks first, held until the last of them takes it, and a failed encode is raised in
each."""

from __future__ import annotations

import threading

import pytest

from reshard.server.transport.session import SharedFrames


def test_a_frame_several_steps_send_is_made_once_and_forgotten_once_the_last_has_it():
    frames, made = SharedFrames(), []
    for _ in range(3):
        frames.expect(("d0/0", "box"))
    frames.expect(("d0/1", "other"))

    def make(what):
        made.append(what)
        return object()

    got = []
    threads = [threading.Thread(target=lambda: got.append(frames.frame(("d0/0", "box"), lambda: make("box"))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["box"] and len(got) == 3 and got[0] is got[1] is got[2]
    assert frames.frame(("d0/1", "other"), lambda: make("other")) is not None and made == ["box", "other"]
    # nothing is held any more: asked for again (a step not counted), each is made anew
    assert frames.frame(("d0/0", "box"), lambda: make("again")) is not got[0] and made[-1] == "again"
    assert not frames._users and not frames._made


def test_a_failed_encode_is_raised_in_every_step_that_shares_it():
    frames = SharedFrames()
    frames.expect("k")
    frames.expect("k")

    def fail():
        raise RuntimeError("DELTA_BASE_MISMATCH: tensor 'w'")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="DELTA_BASE_MISMATCH: tensor 'w'"):
            frames.frame("k", fail)
