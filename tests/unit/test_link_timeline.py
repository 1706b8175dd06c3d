"""`LinkTimeline`: what the lab's link sampler's counters say about a move, on made-up samples (the sampler itself
runs in tests/lab/test_lab.py, on real shaped links)."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.server.devtools.links import READY, LinkTimeline, parse

RATE = 125e6  # 1 Gbit/s


def timeline() -> LinkTimeline:
    """host0 sends 10 MB at line rate from t=1.00 to 1.08 s, which host1 receives; host1 sends nothing."""
    times = np.array([0.98, 1.00, 1.02, 1.04, 1.06, 1.08, 1.10, 1.12])
    moved = np.clip((times - 1.0) * RATE, 0, 10e6)
    sent = np.stack([moved + 500, np.full_like(times, 700)], axis=1)
    received = np.stack([np.full_like(times, 300), moved + 900], axis=1)
    return LinkTimeline(("host0", "host1"), times, sent, received, RATE)


def test_totals_bins_and_the_first_and_last_bytes_follow_the_counters():
    t = timeline()
    assert t.totals(1.0, 1.1) == {"host0": (10_000_000, 0), "host1": (0, 10_000_000)}
    assert t.totals(1.01, 1.03) == {"host0": (2_500_000, 0), "host1": (0, 2_500_000)}  # read between samples
    starts, sent, received = t.bins(1.0, 1.1, 0.05)
    assert starts.tolist() == pytest.approx([0.0, 0.05])
    assert sent[:, 0].tolist() == pytest.approx([6.25e6, 3.75e6]) and not sent[:, 1].any()
    assert received[:, 1].tolist() == pytest.approx([6.25e6, 3.75e6])
    assert t.first_byte(1.0, 1_000_000) == pytest.approx(0.02)
    assert t.first_byte(1.0, 20_000_000) is None  # never that many
    assert t.last_byte(1.0, 1.12) == pytest.approx(0.08)
    assert t.busiest_rate(1.0, 1.1, 0.04) == pytest.approx(RATE)


def test_the_sampler_s_text_reads_into_the_hosts_sent_and_received_bytes():
    # bridge ends: a port transmits what its host receives, receives what its host sends
    text = f"{READY}\n1.0 10 20 30 40\n1.5 11 25 33 48\n"
    t = parse(text, ("a", "b"), RATE)
    assert t.totals(1.0, 1.5) == {"a": (5, 1), "b": (8, 3)}
    with pytest.raises(ValueError, match="not a time and 2 counters for each of 3 hosts"):
        parse(text, ("a", "b", "c"), RATE)
    with pytest.raises(ValueError, match="at least 2 samples"):
        parse(f"{READY}\n1.0 10 20 30 40\n", ("a", "b"), RATE)
