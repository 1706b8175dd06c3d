"""A Prepare carries its reads as columns (`PrepareRequest.read_tensors`, ``read_names``, ``read_versions``): a
state dict's job reads a hundred thousand tensors, and a message per read cost the planner more than a microsecond
each. The agent reads them back in the order sent (which the ticket signs), each tensor its own stored name where
the request names none, and refuses columns of different lengths, naming them. A program cut per host hands each
host its slice with the reads of its own tensors, each ticket signing exactly what its host gets."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError, PermissionDeniedError
from reshard.server.common.contract import code_versions, prepare_reads, read_versions
from reshard.server.common.tickets import (columns_digest, prepare_fields, program_digest, sign,
                                           signed_coded_reads, signed_reads)


def test_reads_come_back_in_order_with_their_own_names_where_none_are_given():
    r = pb.PrepareRequest(job="j", read_tensors=["b", "a"], read_versions=[3, 1])
    assert list(prepare_reads(r).items()) == [("b", ("b", 3)), ("a", ("a", 1))]
    r = pb.PrepareRequest(job="j", read_tensors=["x@0", "out"], read_names=["x", "y"], read_versions=[2, 5])
    assert prepare_reads(r) == {"x@0": ("x", 2), "out": ("y", 5)}
    assert prepare_reads(pb.PrepareRequest(job="j")) == {}


@pytest.mark.parametrize("names, versions", [(["x"], [1, 2]), ([], [1]), (["x", "y", "z"], [1, 2])])
def test_columns_of_different_lengths_are_refused_naming_them(names, versions):
    r = pb.PrepareRequest(job="job-1", read_tensors=["a", "b"], read_names=names, read_versions=versions)
    with pytest.raises(InvalidArgumentError, match=rf"Prepare of job 'job-1' reads 2 tensors with {len(names)} "
                                                   rf"stored names and {len(versions)} versions"):
        prepare_reads(r)


def _ticket_of(secret: bytes, r: pb.PrepareRequest, text: str) -> str:
    """The ticket an agent expects for ``r`` (`Agent._prepare`'s check), its program being ``text``: its reads
    carried as columns, named by the columns' SHA-256 (`signed_reads` of it and the versions), or by reads_at, as
    the agent reads them (`CarriedReads`: versions given plain or coded)."""
    from reshard.server.agent.reads import CarriedReads

    carried = CarriedReads.of(r)
    return sign(secret, "prepare", *prepare_fields(r.job, program_digest(text), r.tensor, r.src_version,
                                                   r.dst_version, r.transport, r.generation, r.job_seq, r.peers,
                                                   None, dict(r.nixl_peers),
                                                   {t: (b.src_version, b.dst_version)
                                                    for t, b in r.delta_bases.items()},
                                                   signed_reads=carried.signed, reads_at=carried.at,
                                                   signed_deltas=carried.signed_deltas))


def test_a_cut_programs_prepares_carry_each_hosts_slice_and_reads_signed_for_it():
    """A program cut per host (`reshard.host_slice`): each host's Prepare carries its slice (or names it by its
    SHA-256) and the reads and delta bases of its slice's tensors alone, signed for exactly those; hosts whose
    slices declare the same tensors get the same reads. A program handed whole carries every read to every host."""
    from reshard.server.planner.jobs import Preparation
    from reshard.server.planner.service import GrpcAgentCalls

    secrets = {h: h.encode() * 8 for h in "abc"}
    calls = GrpcAgentCalls(secrets.__getitem__)
    reads = {"x": ("x", 3), "y": ("y", 4), "z@0": ("z", 5)}
    both = frozenset({"x", "y"})
    cut = Preparation("job", "WHOLE", "t", 1, 2, {h: h for h in "abc"}, program_id="pid", reads=reads,
                      delta_bases={"y": (4, 2), "z@0": (5, 1)}, host_texts={"a": "A", "b": "B", "c": "C"},
                      host_tensors={"a": both, "b": frozenset(both), "c": frozenset({"z@0"})})
    got = {h: calls.prepare_request(h, cut) for h in "abc"}
    assert {h: r.program_json for h, r in got.items()} == {"a": "A", "b": "B", "c": "C"}
    assert prepare_reads(got["a"]) == prepare_reads(got["b"]) == {"x": ("x", 3), "y": ("y", 4)}
    assert prepare_reads(got["c"]) == {"z@0": ("z", 5)}
    # the delta bases go beside the reads, one pair per read (-1: none)
    assert not got["a"].delta_bases
    assert {t: (a, b) for t, a, b in zip(got["a"].read_tensors, got["a"].read_delta_src, got["a"].read_delta_dst)
            if a >= 0} == {"y": (4, 2)}
    assert {t: (a, b) for t, a, b in zip(got["c"].read_tensors, got["c"].read_delta_src, got["c"].read_delta_dst)
            } == {"z@0": (5, 1)}
    for h, r in got.items():
        assert r.ticket == _ticket_of(secrets[h], r, cut.text_for(h))
        assert set(r.push_tickets) == set("abc") - {h}
    held = calls.prepare_request("c", cut, held=True)
    assert not held.program_json and held.program_sha256 == program_digest("C")
    assert held.ticket == _ticket_of(secrets["c"], held, "C")
    # Columns the agent holds go by their SHA-256 and the versions alone, signed the same
    named = calls.prepare_request("c", cut, held=True, columns_held=True)
    assert not named.read_tensors and not named.read_names and read_versions(named) == [5]
    assert named.read_columns_sha256 == held.read_columns_sha256 == columns_digest(["z@0"], ["z"])
    assert named.ticket == held.ticket == _ticket_of(secrets["c"], named, "C")
    whole = Preparation("job2", "WHOLE", "t", 1, 2, {h: h for h in "abc"}, program_id="pid", reads=reads)
    for h in "abc":
        r = calls.prepare_request(h, whole)
        assert r.program_json == "WHOLE" and prepare_reads(r) == reads
        assert r.ticket == _ticket_of(secrets[h], r, "WHOLE")


def test_reads_at_one_version_go_as_that_version_alone_and_the_ticket_signs_it():
    """A state dict's sync at one version: every host's Prepare carries ``reads_at`` and no column, whatever its
    slice (so one request serves every host without deltas), and its ticket signs the version: a Prepare whose
    version was changed on the way fails the agent's check. With delta bases, each host gets its own beside
    its reads as columns."""
    from reshard.server.common.tickets import TicketCheck
    from reshard.server.planner.jobs import Preparation
    from reshard.server.planner.service import GrpcAgentCalls

    secrets = {h: h.encode() * 8 for h in "ab"}
    calls = GrpcAgentCalls(secrets.__getitem__)
    reads = {n: (n, 7) for n in ("x", "y", "z")}
    slices = {"a": frozenset({"x", "y"}), "b": frozenset({"z"})}
    cut = Preparation("job", "WHOLE", "t", 1, 2, {h: h for h in "ab"}, program_id="pid", reads=reads,
                      host_texts={"a": "A", "b": "B"}, host_tensors=slices, reads_at=7)
    for h in "ab":
        r = calls.prepare_request(h, cut)
        assert r.HasField("reads_at") and r.reads_at == 7
        assert not r.read_tensors and not r.read_names and not read_versions(r)
        assert r.ticket == _ticket_of(secrets[h], r, cut.text_for(h))
        check = TicketCheck(h, secrets[h])
        fields = prepare_fields(r.job, program_digest(cut.text_for(h)), r.tensor, r.src_version, r.dst_version,
                                r.transport, r.generation, r.job_seq, r.peers, {}, {}, {}, reads_at=7)
        check.check(r.ticket, "prepare", *fields, what="Prepare")
        tampered = fields[:-1] + ("reads_at:6",)
        with pytest.raises(PermissionDeniedError, match="carries a ticket this agent.s planner did not issue"):
            check.check(r.ticket, "prepare", *tampered, what="Prepare")
    with pytest.raises(ValueError, match="columns or reads_at, not both"):
        prepare_fields("j", "", "t", 1, 2, "grpc", 0, 0, {}, None, None, None, signed_reads="abc", reads_at=1)
    deltas = Preparation("job2", "WHOLE", "t", 1, 2, {h: h for h in "ab"}, program_id="pid", reads=reads,
                         delta_bases={"x": (6, 5), "z": (6, 5)}, host_texts={"a": "A", "b": "B"},
                         host_tensors=slices, reads_at=7)
    got = {h: calls.prepare_request(h, deltas) for h in "ab"}
    # a delta sync's bases go beside its reads as columns, so its reads go as columns too (each host's own)
    assert {h: {t: (a, b) for t, a, b in zip(r.read_tensors, r.read_delta_src, r.read_delta_dst) if a >= 0}
            for h, r in got.items()} == {"a": {"x": (6, 5)}, "b": {"z": (6, 5)}}
    assert all(not r.HasField("reads_at") and not r.delta_bases and set(read_versions(r)) == {7}
               for r in got.values())
    for h, r in got.items():
        assert r.ticket == _ticket_of(secrets[h], r, deltas.text_for(h))


def test_versions_coded_as_a_dictionary_read_back_as_given_and_bad_codes_are_refused():
    """A Prepare's read versions as a dictionary (`code_versions`: a byte a read), where few distinct versions are
    read (a quantizing sync's); none where too many or too far apart; codes naming no value are refused."""
    rng = np.random.default_rng(0)
    versions = rng.choice([7, 8, 15, 1_000], size=50_000).astype(np.int64)
    values, codes = code_versions(versions)
    assert values.tolist() == [7, 8, 15, 1_000] and codes.dtype == np.uint8
    r = pb.PrepareRequest(job="j", read_tensors=[f"t{i}" for i in range(len(versions))],
                          read_version_values=values.tolist(), read_version_codes=codes.tobytes())
    assert read_versions(r) == versions.tolist()
    assert list(prepare_reads(r).values())[:3] == [(f"t{i}", v) for i, v in enumerate(versions[:3].tolist())]
    assert code_versions(np.arange(300, dtype=np.int64)) is None  # more than 256 distinct
    assert code_versions(np.array([1, 2 << 20], np.int64)) is None  # too far apart to count through
    assert code_versions(np.zeros(0, np.int64)) is None
    with pytest.raises(InvalidArgumentError, match="codes its read versions by 2 values, and a code names value 2"):
        read_versions(pb.PrepareRequest(job="j", read_version_values=[1, 2], read_version_codes=bytes([0, 2])))
    with pytest.raises(InvalidArgumentError, match="gives its read versions twice"):
        read_versions(pb.PrepareRequest(job="j", read_versions=[1], read_version_values=[1], read_version_codes=b"\0"))
    # signed as coded: not the same ticket field as the same versions given plain
    assert signed_coded_reads("abc", [1], b"\0") != signed_reads("abc", [1])
