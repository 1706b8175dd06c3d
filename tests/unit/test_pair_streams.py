"""Streams numbered per pair of hosts (`reshard.routes.PairStreams`), which the collective transport's message tags
carry: gloo matches a message by its peer and tag, so two hosts must give each stream between them the same number,
no two streams between them may share one, and the numbers must fit the tag's 20 bits where the job's streams in all
do not (a Kimi-K2-sized state dict's program has 16.8 million)."""

from __future__ import annotations

from itertools import permutations

import pytest

from reshard.host_slice import HostCut
from reshard.mesh import host_of
from reshard.server.agent.programs import HostLayout, load_program
from tests.unit.test_host_slice import _programs


def _numbering(layout: HostLayout, src: str, dst: str, num_streams: int) -> dict[int, int]:
    """Job-wide stream number -> its number between ``src`` and ``dst``, for every stream ``layout``'s host numbers."""
    out = {}
    for g in range(num_streams):
        try:
            out[g] = layout.pair_streams.number(src, dst, g)
        except KeyError:
            pass
    return out


def test_both_hosts_of_a_pair_number_its_streams_alike_from_0_and_the_slices_as_the_whole_program():
    rings = 0
    for program in _programs():  # a quantized MoE (runs, buckets), a dense state dict, einsums with reduces
        cut = HostCut(program.validate())
        hosts = sorted(cut.hosts)
        layouts = {h: HostLayout(program, h) for h in hosts}
        sliced = {h: HostLayout(load_program(cut.text(h))[0], h) for h in hosts}
        n = layouts[hosts[0]].num_streams
        widest = reduces = 0
        for a, b in permutations(hosts, 2):
            mine = _numbering(layouts[a], a, b, n)
            assert mine == _numbering(layouts[b], a, b, n), (a, b)
            assert sorted(mine.values()) == list(range(len(mine))), (a, b)  # 0, 1, ...: none shared, none skipped
            assert [g for g in sorted(mine, key=mine.get)] == sorted(mine)  # in the order of the job-wide numbers
            assert mine == _numbering(sliced[a], a, b, n) == _numbering(sliced[b], a, b, n), (a, b)
            widest = max(widest, len(mine))
        for h in hosts:
            assert layouts[h].pair_streams.widest()[0] <= widest
            for t in layouts[h].tasks:  # every stream a host receives is numbered, and a ring's messages
                first = layouts[h].streams[t.step.id]
                if t.role == "recv":
                    layouts[h].pair_streams.number(t.peer, h, first + t.hop)
                elif t.role == "reduce":  # message round * n + i goes from member i to member i + 1 (reduce.py)
                    members = [host_of(d) for d in t.step.devices]
                    for i, a in enumerate(members):
                        b = members[(i + 1) % len(members)]
                        if a != b and h in (a, b):
                            reduces += 1
                            layouts[h].pair_streams.number(a, b, first + i)
        if widest:
            assert max(layouts[h].pair_streams.widest()[0] for h in hosts) == widest
        rings += reduces
    assert rings, "no program here has a reduce between hosts"


def test_a_state_dict_numbers_far_fewer_streams_between_two_hosts_than_in_all():
    moe = next(iter(_programs()))
    cut = HostCut(moe.validate())
    layouts = [HostLayout(moe, h) for h in sorted(cut.hosts)]
    widest, pair = max(layout.pair_streams.widest() for layout in layouts)
    assert pair is not None and widest * len(layouts) <= layouts[0].num_streams


def test_a_stream_the_host_takes_no_part_in_is_named_not_numbered():
    program = next(iter(_programs()))
    host = sorted(HostCut(program.validate()).hosts)[0]
    layout = HostLayout(program, host)
    with pytest.raises(KeyError, match=f"host {host} takes part in no stream 7 from nowhere to {host}"):
        layout.pair_streams.number("nowhere", host, 7)
