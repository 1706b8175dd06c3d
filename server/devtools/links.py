"""What crossed the emulated lab's shaped links, and when: every host link's byte counters sampled every few
milliseconds by a process of its own inside the bridge's namespace (`main`, started by `Lab.sample_links`), and
what a bench or test reads from them (`LinkTimeline`).

A total over a whole run (`Lab.link_bytes`) shows that a move's bytes crossed the links; a timeline shows how
busy each link was while they did: when the first bytes crossed after a request, at what share of the line rate
each link ran, bin by bin, and how long the last bytes took. That is where a sync that misses its lower bound
loses its time (``bench/link_timeline.py``).

The counters are the bridge ends' (a host's received bytes are its port's transmitted ones), with the headers the
links carry; times are this machine's monotonic clock, which the namespaces share.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["LinkTimeline", "READY", "main", "parse"]

READY = "ready"  # the sampler's first line: its first sample is taken


@dataclass(frozen=True, eq=False)  # arrays: compared as values they would be ambiguous
class LinkTimeline:
    """Each host's link counters at each sample: ``times`` (n,) monotonic seconds, ``sent`` and ``received`` (n,
    hosts) cumulative bytes each host sent and received over its link; ``rate`` the links' shaped bytes a second."""

    hosts: tuple[str, ...]
    times: np.ndarray
    sent: np.ndarray
    received: np.ndarray
    rate: float

    def __post_init__(self):
        n = len(self.times)
        if n < 2 or self.sent.shape != (n, len(self.hosts)) or self.received.shape != self.sent.shape:
            raise ValueError(f"a link timeline needs at least 2 samples of {len(self.hosts)} hosts' sent and "
                             f"received bytes; got {n} times, sent {self.sent.shape}, received {self.received.shape}")

    def _at(self, counters: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Each host's counter at times ``t`` (k,), read linearly between samples: (k, hosts)."""
        return np.stack([np.interp(t, self.times, counters[:, h]) for h in range(len(self.hosts))], axis=1)

    def totals(self, t0: float, t1: float) -> dict[str, tuple[int, int]]:
        """Bytes each host sent and received over its link from ``t0`` to ``t1``."""
        ends = np.array([t0, t1])
        sent, received = (np.diff(self._at(c, ends), axis=0)[0] for c in (self.sent, self.received))
        return {h: (round(s), round(r)) for h, s, r in zip(self.hosts, sent, received)}

    def bins(self, t0: float, t1: float, width: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bin starts after ``t0`` in seconds, bytes each host sent in each, bytes each host received in each):
        ``width``-second bins from ``t0`` to past ``t1``."""
        edges = t0 + np.arange(max(1, int(np.ceil((t1 - t0) / width - 1e-9))) + 1) * width
        sent, received = (np.diff(self._at(c, edges), axis=0) for c in (self.sent, self.received))
        return edges[:-1] - t0, sent, received

    def first_byte(self, t0: float, least: int) -> float | None:
        """Seconds after ``t0`` until the hosts together had received ``least`` bytes since; None if they never
        did while sampled."""
        total = self.received.sum(axis=1)
        got = total - np.interp(t0, self.times, total)
        after = np.nonzero((self.times >= t0) & (got >= least))[0]
        return float(self.times[after[0]] - t0) if len(after) else None

    def last_byte(self, t0: float, t1: float, least: int = 1) -> float:
        """Seconds after ``t0`` of the last sample up to ``t1`` at which some host's link counter had grown by
        ``least`` bytes or more since the one before (a move's last bytes crossed no later; a larger ``least``
        passes over the heartbeats' few hundred bytes)."""
        grew = np.nonzero(np.any(np.diff(self.received, axis=0) >= least, axis=1)
                          | np.any(np.diff(self.sent, axis=0) >= least, axis=1))[0] + 1
        grew = grew[(self.times[grew] >= t0) & (self.times[grew] <= t1)]
        return float(self.times[grew[-1]] - t0) if len(grew) else 0.0

    def busiest_rate(self, t0: float, t1: float, width: float) -> float:
        """The most bytes a second any host sent or received over a ``width``-second bin from ``t0`` to ``t1``."""
        _, sent, received = self.bins(t0, t1, width)
        return float(max(sent.max(initial=0), received.max(initial=0)) / width)


def parse(text: str, hosts: tuple[str, ...], rate: float) -> LinkTimeline:
    """The timeline in the sampler's output ``text`` (`main`: its `READY` line, then a line per sample: the time,
    then each host's link's bridge-end transmitted and received bytes)."""
    rows = np.array([[float(v) for v in line.split()] for line in text.splitlines()
                     if line.strip() and line.strip() != READY])
    if rows.ndim != 2 or rows.shape[1] != 1 + 2 * len(hosts):
        raise ValueError(f"the link sampler wrote {len(rows)} samples that are not a time and 2 counters for each "
                         f"of {len(hosts)} hosts")
    # the bridge end transmits what its host receives, and receives what its host sends
    return LinkTimeline(hosts, rows[:, 0], rows[:, 2::2], rows[:, 1::2], rate)


def main(argv: list[str] | None = None) -> int:
    """``python -m reshard.server.devtools.links PORT,PORT,... INTERVAL_S``, inside the bridge's namespace: sample
    the ports' counters every ``INTERVAL_S`` until standard input closes, then write every sample (see `parse`).
    The samples are held until then, so that writing them costs nothing while a move runs."""
    ports, interval = (argv if argv is not None else sys.argv[1:])
    files = [(open(f"/sys/class/net/{p}/statistics/tx_bytes"), open(f"/sys/class/net/{p}/statistics/rx_bytes"))
             for p in ports.split(",")]
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()

    def sample() -> list:
        row = [time.monotonic()]
        for tx, rx in files:
            tx.seek(0)
            rx.seek(0)
            row += [int(tx.read()), int(rx.read())]
        return row

    rows = [sample()]
    print(READY, flush=True)
    while not closed.wait(float(interval)):
        rows.append(sample())
    rows.append(sample())
    sys.stdout.write("".join(" ".join(str(v) for v in row) + "\n" for row in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
