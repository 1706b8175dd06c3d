"""Hostile input over gRPC (issue 11, must-show 1): every RPC of both services answers a clean status,
the processes stay up, and a tensor stored before the run is bit-exact after it.

Requests are generated from the descriptors of reshard.proto, for every method of the Planner and the
Agent: every field of the request message, scalars at their hostile edges (empty, huge, negative, NaN
and infinities, NUL bytes, very long strings), nested messages, repeated fields, maps and oneofs; a
streaming request is a short list of generated messages. Fields the services read by name draw also
from values that get past the first check: the cluster's own tensors, hosts and devices, and JSON that
is valid, deep, null, of the wrong type or huge. Random bytes go as requests too, undecodable. Calls
carry the cluster token, none, or a wrong one.

Allowed answers, with the right token (`ALLOWED`)

===================== ===================================================================================
OK                    a request that happens to be valid (a registration, a plan, a read)
INVALID_ARGUMENT      malformed input: the domain's ValueErrors, and bytes that do not decode
NOT_FOUND             an unknown tensor, job, upload or shard
ALREADY_EXISTS        a tensor name that is taken
FAILED_PRECONDITION   a well-formed request the cluster cannot carry out now (a host is down, no GPU)
PERMISSION_DENIED     an agent call without the planner's ticket; a host name another live agent holds
RESOURCE_EXHAUSTED    over a limit: JSON size or depth, plan size, memory, gRPC's largest message
DEADLINE_EXCEEDED     GetJob only: it blocks up to ``wait_s`` (capped by the planner's ``max_wait_s``)
===================== ===================================================================================

Without the token, or with a wrong one, the only answer is UNAUTHENTICATED, for every method. Never
INTERNAL or UNKNOWN (a bug: an exception no servicer mapped), UNAVAILABLE (a process died or stopped
answering), DATA_LOSS (stored bytes damaged), or DEADLINE_EXCEEDED elsewhere (a call that hangs);
OUT_OF_RANGE, ABORTED and CANCELLED are answers no servicer gives.

The default run makes `EXAMPLES` generated calls per method and `RAW_EXAMPLES` of random bytes
(derandomized: the same calls every run), against a cluster of gRPC agents; ``-m slow`` runs `SLOW_EXAMPLES` of
each, and every test against clusters of collective and nixl agents too. The agent calls that
need the planner's ticket are fuzzed twice: refused without it, and, against an agent in this process whose
secret the test knows, with valid tickets signed over the generated fields, so the code behind the check is
reached too.
"""

from __future__ import annotations

import json
import math
import re

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from reshard import Mesh, Sharding
from reshard.client.cluster import LocalCluster
from reshard.proto import reshard_pb2 as pb
from reshard.proto.errors import InvalidArgumentError
from reshard.proto.auth import METADATA_KEY
from reshard.proto.layout import Checksum
from reshard.server.agent.service import Agent
from reshard.server.common.config import AgentConfig
from reshard.server.common.contract import prepare_reads
from reshard.server.common.tickets import (abort_fields, commit_fields, deltas_digest, execute_fields, prepare_fields,
                                           program_digest, put_fields, sign, signed_reads)
from reshard.strategies import STRATEGIES

from .conftest import TRANSPORTS

# make test fuzzes on the gRPC cluster only, the slow suite on every transport's: the servicers behind a method are
# the same whichever transport the agents run, and each other transport's cluster cost make test a start of its own
# (10 s for collective's on the CI-sized machine) to call the same handlers
pytestmark = pytest.mark.grpc_in_make_test

# 20 generated calls a method in make test (30 took 40 s of its time alone, 20 take 27 s: make test was within
# seconds of its 10-minute limit on a fresh clone here); the slow suite makes SLOW_EXAMPLES of each
EXAMPLES = 20
RAW_EXAMPLES = 10
SLOW_EXAMPLES = 400
CALL_TIMEOUT_S = 20.0

C = grpc.StatusCode
DOMAIN_ERROR_MARK = "reshard-domain-error"  # trailing metadata of a servicer's refusal (reshard.proto.status)
GRPC_SIZE_LIMIT = "larger than max"  # gRPC's RESOURCE_EXHAUSTED for a message over the receiver's limit
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION, C.PERMISSION_DENIED,
           C.RESOURCE_EXHAUSTED}
ALLOWED_BY_METHOD = {"GetJob": ALLOWED | {C.DEADLINE_EXCEEDED}}

HOSTS = ("host0", "host1")
DEVICES_PER_HOST = 2
DEVICES = tuple(f"{h}/{i}" for h in HOSTS for i in range(DEVICES_PER_HOST))
MESH = Mesh.from_hosts({"x": 2, "y": 2}, HOSTS, DEVICES_PER_HOST)
KEPT = "fuzz_kept"  # stored before the run; no call may change it
VICTIM = "fuzz_victim"  # calls may reshard or delete it, to reach the code behind a known name
KEPT_ARRAY = np.arange(56, dtype=np.float32).reshape(8, 7) / 7
# the planner methods that would change KEPT by its name
CHANGES_A_TENSOR = {"DeleteTensor", "DeleteTensors", "Reshard", "ReshardMany"}

SERVICES = {name: pb.DESCRIPTOR.services_by_name[name] for name in ("Planner", "Agent")}
METHODS = [(service, method) for service, d in SERVICES.items() for method in d.methods_by_name]


def _sharding_json(sharding: Sharding) -> str:
    return json.dumps(sharding.to_json())


GOOD_SHARDING = _sharding_json(Sharding(MESH, ("x", "y")))
OTHER_SHARDING = _sharding_json(Sharding(MESH, (None, "x")))
# Each pool starts with the values that get furthest (a valid sharding, the kept tensor's name): hypothesis
# tries the first entries first and most often.
HOSTILE_JSON = [
    GOOD_SHARDING,
    OTHER_SHARDING,
    _sharding_json(Sharding(Mesh.from_hosts({"x": 2}, ["ghost", "host1"], 1), ("x",))),
    "", "null", "[]", "{}", "0", "-1", '"x"', "true", "NaN", "Infinity", "1e999", "9" * 5000, "\x00", "{",
    "[" * 100_000, '{"a":' * 50_000, "[" * 100_000 + "]" * 100_000, "\xff\xfe", '{"mesh": "\ud7ff"}',
    json.dumps({"mesh": None, "spec": []}),
    json.dumps({"mesh": {"axes": "xy", "devices": 5}, "spec": {"0": "x"}}),
    json.dumps({"mesh": {"axes": [["x", 2**40]], "devices": None}, "spec": [["x"]]}),
    json.dumps({"mesh": {"axes": [["x", 2**62], ["y", -1]]}, "spec": [["x"], ["y"]]}),
    json.dumps({"mesh": {"axes": [["x", 4]], "devices": ["host0/0"] * 4}, "spec": [["x"]]}),
    json.dumps({"mesh": {"axes": [["x", 4]], "devices": list(DEVICES)}, "spec": [["x", "x"]]}),
    json.dumps({"mesh": {"axes": [["x", 4]], "devices": list(DEVICES)}, "spec": [None] * 70}),
    json.dumps({"mesh": MESH.to_json(), "spec": [[1], [None]]}),
    "[" + "0," * 1_000_000 + "0]",  # 2 MB, all of it read before it turns out not to be a sharding
]
NAMES = [KEPT, VICTIM, "fuzz_new", "", "nope", "\x00", "n" * 5000, "../../etc/passwd", "fuzz victim"]
HOST_NAMES = [*HOSTS, "fuzzhost", "ghost", "", "\x00", "h" * 300, "a/b", "host0\x00"]
DEVICE_IDS = [*DEVICES, "host0/99", "host0/-1", "ghost/0", "", "/", "host0/0\x00", "host0", "host0/0/0"]
IDS = ["", "0" * 64, "x" * 1000, "\x00", "job-1"]
POOLS = {
    "name": NAMES, "tensor": NAMES,
    "host": HOST_NAMES, "from_host": HOST_NAMES,
    "device": DEVICE_IDS, "devices": DEVICE_IDS,
    "address": ["127.0.0.1:1", "", "[::1]:0", "unix:/nonexistent", "x:99999999", "256.0.0.1:80", "\x00:1"],
    "dtype": ["float32", "int64", "bool", "", "object", "float32\x00", "S10", "x" * 500],
    "strategy": ["", *STRATEGIES, "fastest"],
    "transport": ["", "grpc", "collective", "nixl", "auto", "pigeon"],
    "backend": ["gloo", "nccl", "", "mpi"],
    "kind": ["numpy", "torch", "", "pickle"],
    "secret": [b"s" * 32, b"t" * 16, b"", b"\x00" * 15],
    "inputs": NAMES, "out": [n for n in NAMES if n != KEPT],  # a compute job may replace any tensor but the kept one
    "names": NAMES,
    # reshard_many's scale pairs: a scale follows its weight to a new version, so neither may be the kept tensor
    "weight": [n for n in NAMES if n != KEPT], "scale": [n for n in NAMES if n != KEPT],
    "op": ["einsum", "add", "sum", "max", "softmax_xent", "axpy", "relu", "", "frobnicate"],
    **{f: IDS for f in ("job", "job_id", "upload_id", "group_id", "program_id", "plan_id", "id", "ticket", "proof")},
    **{f: HOSTILE_JSON for f in ("sharding_json", "src_json", "dst_json", "program_json", "plan_json",
                                 "out_sharding_json")},
}
SHAPES = [[8, 7], [4, 7], [], [0], [-1], [2**40, 2**40], [2**62, 2**62], [2**63 - 1], [1] * 65, [2] * 30, [3, -3]]
SHAPE_FIELDS = ("shape", "shard_shape", "lo", "hi", "stride", "block")

_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-2**31, 2**31 - 1), FieldDescriptor.CPPTYPE_INT64: (-2**63, 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
    st.sampled_from(["", "\x00", "x" * 100_000, "\u202e\u0000\uffff", "é" * 1000]),
)
_BYTES = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"\x00" * 16, bytes(range(256)) * 4096]))


def _ints(cpp_type: int) -> st.SearchStrategy:
    lo, hi = _INT_RANGES[cpp_type]
    edges = [e for e in (1, 0, -1, 2, 7, 2**31 - 1, 2**32, 2**40, 2**62, hi, lo) if lo <= e <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _scalar(field: FieldDescriptor, method: str) -> st.SearchStrategy:
    t = field.cpp_type
    if t in _INT_RANGES:
        return _ints(t)
    if t in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        if field.name == "wait_s":  # GetJob blocks this long on a known job; unknown ones answer at once
            return st.sampled_from([0.0, -1.0, 0.05, float("nan"), float("-inf"), float("inf")])
        width = 32 if t == FieldDescriptor.CPPTYPE_FLOAT else 64
        return st.one_of(st.floats(width=width), st.sampled_from([0.0, -0.0, 1e308, -1e308, 5e-324]))
    if t == FieldDescriptor.CPPTYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.sampled_from(POOLS[field.name]), _BYTES) if field.name in POOLS else _BYTES
    pool = POOLS.get(field.name)
    if pool and method in CHANGES_A_TENSOR and field.name in ("name", "names"):
        pool = [n for n in pool if n != KEPT]
    return st.one_of(st.sampled_from(pool), st.sampled_from(pool), _TEXT) if pool else _TEXT


def _repeated(field: FieldDescriptor, method: str) -> st.SearchStrategy:
    if field.name in SHAPE_FIELDS:
        return st.one_of(st.sampled_from(SHAPES), st.lists(_scalar(field, method), max_size=4))
    return st.lists(_scalar(field, method), max_size=4)


def _value(field: FieldDescriptor, method: str, depth: int) -> st.SearchStrategy:
    """A value for one field: a scalar, a list, a dict for a map, a message."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        values = messages(value.message_type, method, depth + 1) if value.message_type is not None else \
            _scalar(value, method)
        return st.dictionaries(_scalar(key, method), values, max_size=3)
    if field.message_type is not None:
        inner = messages(field.message_type, method, depth + 1)
        return st.lists(inner, max_size=3) if field.is_repeated else inner
    return _repeated(field, method) if field.is_repeated else _scalar(field, method)


def _assign(msg, field: FieldDescriptor, value) -> None:
    msg.ClearField(field.name)
    target = getattr(msg, field.name)
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, Message):  # a map of messages is filled entry by entry
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        target.extend(value)
    elif field.message_type is not None:
        target.CopyFrom(value)
    else:
        setattr(msg, field.name, value)


@st.composite
def messages(draw, descriptor, method: str, depth: int = 0):
    """A message of type ``descriptor``: most fields set, one member of each oneof at most."""
    msg = getattr(pb, descriptor.name)()
    chosen = {o.name: draw(st.sampled_from([*(f.name for f in o.fields), None])) for o in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] != field.name:
            continue
        if oneof is None and draw(st.integers(0, 4)) == 4:  # mostly set: an unset field ends most calls early
            continue
        if field.message_type is not None and depth >= 3 and not field.message_type.GetOptions().map_entry:
            continue
        _assign(msg, field, draw(_value(field, method, depth)))
    return msg


# Valid requests (a fresh upload, a plan, a read of the kept tensor): `near_valid` changes one or two of their
# fields, which reaches the checks that come after the first.
TEMPLATES = {
    "Register": pb.RegisterRequest(host="fuzzhost", num_devices=2, address="127.0.0.1:1", nic_gbps=10.0,
                                   transport="grpc", secret=b"s" * 32),
    "BeginUpload": pb.BeginUploadRequest(name="fuzz_new", shape=[8, 7], dtype="float32", sharding_json=GOOD_SHARDING,
                                         kind="numpy"),
    "GetTensor": pb.TensorRequest(name=KEPT),
    "DeleteTensor": pb.TensorRequest(name=VICTIM),
    "DeleteTensors": pb.DeleteTensorsRequest(names=[VICTIM]),
    "Plan": pb.PlanRequest(shape=[8, 7], dtype="float32", src_json=GOOD_SHARDING, dst_json=OTHER_SHARDING,
                           strategy="auto"),
    "Reshard": pb.ReshardRequest(name=VICTIM, dst_json=OTHER_SHARDING, strategy="auto"),
    "GetShard": pb.GetShardRequest(tensor=KEPT, version=1, device="host0/0"),
    "Digest": pb.DigestRequest(tensor=KEPT, version=1, devices=["host0/0", "host0/1"]),
    "GetShardIpc": pb.IpcGetShardRequest(shard=pb.GetShardRequest(tensor=KEPT, version=1, device="host0/0")),
}


@st.composite
def near_valid(draw, method: str):
    msg = type(TEMPLATES[method])()
    msg.CopyFrom(TEMPLATES[method])
    fields = list(msg.DESCRIPTOR.fields)
    for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            msg.ClearField(field.name)
        else:
            _assign(msg, field, draw(_value(field, method, 1)))
    return msg


def requests(service: str, method: str) -> st.SearchStrategy:
    """What one call sends: a message (half of them near a valid one, where there is a template), or a short
    list of them for a streaming request."""
    d = SERVICES[service].methods_by_name[method]
    one = messages(d.input_type, method)
    if method in TEMPLATES:
        one = st.one_of(near_valid(method), one)
    return st.lists(one, max_size=4) if d.client_streaming else one


def raw_requests(service: str, method: str) -> st.SearchStrategy:
    d = SERVICES[service].methods_by_name[method]
    return st.lists(_BYTES, max_size=3) if d.client_streaming else _BYTES


TOKENS = st.sampled_from(["right", "right", "right", "none", "wrong"])


# -- calling ------------------------------------------------------------------------------------------------------


class Caller:
    """Raw calls to the planner and host0's agent: any request (a message or bytes), any token."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.channels = {"Planner": grpc.insecure_channel(cluster.address),
                         "Agent": grpc.insecure_channel(cluster.agent_addresses["host0"])}

    def metadata(self, token: str):
        value = {"right": self.cluster.token, "wrong": "x" * 43, "none": None}[token]
        return () if value is None else ((METADATA_KEY, f"Bearer {value}"),)

    def call(self, service: str, method: str, request, token: str = "right") -> tuple[grpc.StatusCode, str]:
        code, details, _ = self.answer(service, method, request, token)
        return code, details

    def answer(self, service: str, method: str, request, token: str = "right") -> tuple[grpc.StatusCode, str, bool]:
        """The status, its message, and whether a servicer refused on purpose (its trailing mark)."""
        d = SERVICES[service].methods_by_name[method]
        path = f"/{SERVICES[service].full_name}/{method}"
        raw = isinstance(request, bytes) or (isinstance(request, list) and all(isinstance(r, bytes) for r in request))
        serialize = None if raw else (lambda m: m.SerializeToString())
        ch = self.channels[service]
        kind = ("stream" if d.client_streaming else "unary") + "_" + ("stream" if d.server_streaming else "unary")
        rpc = getattr(ch, kind)(path, request_serializer=serialize, response_deserializer=None)
        arg = iter(request) if d.client_streaming else request
        try:
            reply = rpc(arg, timeout=CALL_TIMEOUT_S, metadata=self.metadata(token))
            if d.server_streaming:
                for _ in reply:
                    pass
        except grpc.RpcError as e:
            marked = any(k == DOMAIN_ERROR_MARK for k, _ in e.trailing_metadata() or ())
            return e.code(), e.details() or "", marked
        return C.OK, "", False

    def ask(self, service: str, method: str, request):
        """The reply to a unary call with the right token (which must succeed)."""
        d = SERVICES[service].methods_by_name[method]
        rpc = self.channels[service].unary_unary(
            f"/{SERVICES[service].full_name}/{method}", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=getattr(pb, d.output_type.name).FromString)
        return rpc(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata("right"))

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()


def _incident(cluster: LocalCluster, service: str, details: str) -> str:
    """The server's log lines for an INTERNAL answer's incident id, to show with the failure."""
    m = re.search(r"internal error ([0-9a-f]{12})", details)
    log = cluster.log_dir / ("planner.log" if service == "Planner" else "agent-host0.log")
    if not m or not log.exists():
        return ""
    text = log.read_text(errors="replace")
    at = text.find(m.group(1))
    return text[at:at + 3000] if at >= 0 else ""


def check_answer(caller: Caller, service: str, method: str, request, token: str) -> None:
    code, details, marked = caller.answer(service, method, request, token)
    if token != "right":
        assert code == C.UNAUTHENTICATED, f"{method} with {token} token answered {code.name}: {details[:300]}"
        return
    problem = f"{service}.{method} answered {code.name}: {details[:500]}\nrequest: {repr(request)[:600]}\n"
    assert code in ALLOWED_BY_METHOD.get(method, ALLOWED), problem + _incident(caller.cluster, service, details)
    # Every refusal is a servicer's decision, except gRPC's own limit on a message's size and a wait that
    # ran out; a refusal the client could not read (a message too long for its metadata limit) is not.
    assert code in (C.OK, C.DEADLINE_EXCEEDED) or marked or GRPC_SIZE_LIMIT in details, problem


# -- the cluster and what must survive ----------------------------------------------------------------------------


class Baseline:
    def __init__(self, client):
        info = client.info(KEPT)
        self.version, self.sharding = info.version, info.sharding
        self.bytes = client.get(KEPT).tobytes()
        self.digests = client.digests(KEPT)


def assert_intact(cluster: LocalCluster, caller: Caller, baseline: Baseline) -> None:
    """Both kinds of process up and serving, and the kept tensor as it was, to the bit."""
    procs = {"planner": cluster.planner, **cluster.agents}
    assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}
    for service, ch in caller.channels.items():
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    with cluster.connect() as c:
        up = {a["host"] for a in c.agents() if a["up"]}
        assert set(HOSTS) <= up, up
        info = c.info(KEPT)
        assert (info.version, info.sharding) == (baseline.version, baseline.sharding)
        got = c.get(KEPT)
        assert got.dtype == KEPT_ARRAY.dtype and got.shape == KEPT_ARRAY.shape and got.tobytes() == baseline.bytes
        assert c.digests(KEPT) == baseline.digests


@pytest.fixture(scope="module", params=TRANSPORTS)
def fuzzed(request):
    with LocalCluster(len(HOSTS), DEVICES_PER_HOST, host_names=HOSTS, transport=request.param) as cluster:
        with cluster.connect() as c:
            c.put(KEPT, KEPT_ARRAY, Sharding(MESH, ("x", "y")))
            c.put(VICTIM, KEPT_ARRAY * 2, Sharding(MESH, (None, "x")))
            baseline = Baseline(c)
        assert baseline.bytes == KEPT_ARRAY.tobytes()
        caller = Caller(cluster)
        yield cluster, caller, baseline
        caller.close()


class Shown:
    """A request, printed short in hypothesis's report: some are megabytes."""

    def __init__(self, request):
        self.request = request

    def __repr__(self) -> str:
        text = repr(self.request)
        return text if len(text) <= 800 else f"{text[:800]} ... ({len(text)} characters)"


def _fuzz(fuzzed, service: str, method: str, strategy, examples: int) -> None:
    cluster, caller, baseline = fuzzed
    with cluster.connect() as c:
        if VICTIM not in {t.name for t in c.tensors()}:  # an earlier method's calls deleted or moved it
            c.put(VICTIM, KEPT_ARRAY * 2, Sharding(MESH, (None, "x")))

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=strategy.map(Shown), token=TOKENS)
    def run(request, token):
        check_answer(caller, service, method, request.request, token)

    run()
    assert_intact(cluster, caller, baseline)


# -- the tests ----------------------------------------------------------------------------------------------------


# make test fuzzes each method on gRPC (`pytestmark`; the slow suite on every transport, and `_long` at length)
@pytest.mark.parametrize("service,method", METHODS, ids=[m for _, m in METHODS])
def test_generated_messages(fuzzed, service, method):
    _fuzz(fuzzed, service, method, requests(service, method), EXAMPLES)


@pytest.mark.parametrize("service,method", METHODS, ids=[m for _, m in METHODS])
def test_random_bytes(fuzzed, service, method):
    _fuzz(fuzzed, service, method, raw_requests(service, method), RAW_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("service,method", METHODS, ids=[m for _, m in METHODS])
def test_generated_messages_long(fuzzed, service, method):
    _fuzz(fuzzed, service, method, st.one_of(requests(service, method), raw_requests(service, method)),
          SLOW_EXAMPLES)


@pytest.mark.parametrize("service,method", METHODS, ids=[m for _, m in METHODS])
def test_without_the_token_every_method_is_unauthenticated(fuzzed, service, method):
    _, caller, _ = fuzzed
    empty = getattr(pb, SERVICES[service].methods_by_name[method].input_type.name)()
    streaming = SERVICES[service].methods_by_name[method].client_streaming
    for request in ([empty] if streaming else empty, [b"\xff\x00"] if streaming else b"\xff\x00"):
        for token in ("none", "wrong"):
            code, details = caller.call(service, method, request, token)
            assert code == C.UNAUTHENTICATED, (method, token, code, details)
            assert "token" in details


# Hostile values that once answered INTERNAL or hung, and what each answers now.
HOSTILE = [
    ("deep sharding", "Planner", "BeginUpload",
     pb.BeginUploadRequest(name="deep", shape=[8, 7], dtype="float32", sharding_json="[" * 100_000),
     C.RESOURCE_EXHAUSTED, r"sharding nests arrays and objects more than 32 levels deep"),
    ("deep objects", "Planner", "Reshard", pb.ReshardRequest(name=KEPT, dst_json='{"a":' * 50_000),
     C.RESOURCE_EXHAUSTED, r"more than 32 levels deep"),
    ("null sharding", "Planner", "Plan",
     pb.PlanRequest(shape=[8, 7], dtype="float32", src_json="null", dst_json=GOOD_SHARDING),
     C.INVALID_ARGUMENT, r"source sharding: sharding JSON must be a JSON object \{\.\.\.\}; got null"),
    ("a list for a sharding", "Planner", "Reshard", pb.ReshardRequest(name=KEPT, dst_json="[]"),
     C.INVALID_ARGUMENT, r"destination sharding: sharding JSON must be a JSON object"),
    ("NaN in a sharding", "Planner", "Plan",
     pb.PlanRequest(name=KEPT, dst_json='{"mesh": {"axes": [["x", NaN]]}, "spec": []}'),
     C.INVALID_ARGUMENT, r"destination sharding is not usable JSON: NaN is not a JSON value"),
    ("a mesh axis of 2**40 and no devices", "Planner", "Plan",
     pb.PlanRequest(name=KEPT, dst_json=json.dumps({"mesh": {"axes": [["x", 2**40]]}, "spec": [["x"]]})),
     C.INVALID_ARGUMENT, r"is abstract \(no devices\)"),
    ("30 dims", "Planner", "Plan",
     pb.PlanRequest(shape=[2] * 30, dtype="float32", src_json=GOOD_SHARDING,
                    dst_json=_sharding_json(Sharding(MESH, (None, "x")))),
     C.OK, ""),
    ("65 dims", "Planner", "Plan",
     pb.PlanRequest(shape=[1] * 65, dtype="float32", src_json=GOOD_SHARDING, dst_json=GOOD_SHARDING),
     C.INVALID_ARGUMENT, r"shape has 65 dims; a tensor has at most 64"),
    ("unknown tensor", "Agent", "GetShard", pb.GetShardRequest(tensor="nope", version=1, device="host0/0"),
     C.NOT_FOUND, r"nope"),
    ("unknown job", "Planner", "GetJob", pb.JobRequest(job="nope", wait_s=float("inf")), C.NOT_FOUND, r"no job"),
    ("an empty upload stream", "Agent", "PutShard", [], C.INVALID_ARGUMENT, r"must open with a header"),
    ("a push without its header", "Agent", "Push", [pb.PushChunk(trailer=pb.Trailer(nbytes=3))],
     C.INVALID_ARGUMENT, r"must open with a header"),
    ("bytes that are no message", "Planner", "Register", b"\xff\xff\xff", C.INVALID_ARGUMENT, r"does not decode"),
    ("a name that is not UTF-8", "Planner", "GetTensor", bytes([1 << 3 | 2, 1, 0xFF]), C.INVALID_ARGUMENT,
     r"GetTensor does not decode"),
    ("a push frame cut short", "Agent", "Push", [bytes([2 << 3 | 2, 0x80])], C.INVALID_ARGUMENT, r"does not decode"),
    # Read a bit at a time, 4 MiB of one varint took CPU time quadratic in its length, before the token check.
    ("a push frame of one endless varint", "Agent", "Push", [bytes([2 << 3 | 2]) + b"\xff" * 2**22],
     C.INVALID_ARGUMENT, r"varint longer than 10 bytes"),
]


@pytest.mark.parametrize("service,method,request_,code,message", [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_values(fuzzed, service, method, request_, code, message):
    _, caller, _ = fuzzed
    got, details = caller.call(service, method, request_)
    assert got == code and re.search(message, details), (got.name, details)


def test_uploads_with_a_real_ticket_and_hostile_pieces(fuzzed):
    """Past the ticket: an upload the planner opened, its streams' pieces and trailers generated."""
    _, caller, _ = fuzzed
    reply = caller.ask("Planner", "BeginUpload", pb.BeginUploadRequest(
        name="fuzz_upload", shape=[8, 7], dtype="float32", sharding_json=GOOD_SHARDING))
    loc = next(t for t in reply.locations if t.device == "host0/0")
    header = pb.ShardChunk(header=pb.ShardHeader(upload_id=reply.upload_id, tensor="fuzz_upload", device=loc.device,
                                                 dtype="float32", box=loc.box, ticket=loc.ticket))
    tile = bytes(4 * math.prod(hi - lo for lo, hi in zip(loc.box.lo, loc.box.hi)))  # the whole tile, zeros
    whole = Checksum()
    whole.update(tile)
    pieces = st.builds(lambda box, data: pb.ShardChunk(piece=pb.Piece(box=box, data=data)),
                       st.one_of(st.just(loc.box), messages(pb.Box.DESCRIPTOR, "PutShard")),
                       st.one_of(st.just(tile), _BYTES))
    trailers = st.one_of(st.just(pb.Trailer(nbytes=whole.nbytes, xxh3_64=whole.xxh3_64)),
                         messages(pb.Trailer.DESCRIPTOR, "PutShard")).map(lambda t: pb.ShardChunk(trailer=t))
    later = st.lists(st.one_of(pieces, trailers, messages(pb.ShardChunk.DESCRIPTOR, "PutShard")), max_size=4)
    _fuzz(fuzzed, "Agent", "PutShard", later.map(lambda rest: [header, *rest]), EXAMPLES)
    ipc = messages(pb.CudaIpcTensor.DESCRIPTOR, "PutShardIpc").map(
        lambda source: pb.IpcPutShardRequest(header=header.header, source=source))
    _fuzz(fuzzed, "Agent", "PutShardIpc", ipc, EXAMPLES // 2)


# -- past the ticket check --------------------------------------------------------------------------------------

TICKETED = ("Prepare", "Execute", "Push", "Commit", "Abort", "Release", "PutShard", "PutShardIpc")


def _sign_prepare(secret: bytes, r: pb.PrepareRequest) -> None:
    """The ticket of ``r`` as the agent checks it (`AgentServicer._prepare`): its reads as columns, named by their
    SHA-256, or by reads_at, and delta bases beside them."""
    program = program_digest(r.program_json) if r.program_json else r.program_sha256
    by_digest = bool(r.read_columns_sha256) and not r.read_tensors
    try:
        reads = {} if by_digest else prepare_reads(r)
    except InvalidArgumentError:  # columns of different lengths: the agent refuses them before the ticket
        reads = {}
    signed_by_digest = signed_reads(r.read_columns_sha256, r.read_versions) if by_digest else ""
    reads_at = r.reads_at if r.HasField("reads_at") else None
    if (reads or signed_by_digest) and reads_at is not None:
        return  # reads named twice: the agent refuses it before the ticket
    r.ticket = sign(secret, "prepare", *prepare_fields(r.job, program, r.tensor, r.src_version, r.dst_version,
                                                       r.transport, r.generation, r.job_seq, r.peers,
                                                       reads,
                                                       None, {t: (b.src_version, b.dst_version)
                                                              for t, b in r.delta_bases.items()},
                                                       signed_reads=signed_by_digest, reads_at=reads_at,
                                                       signed_deltas=deltas_digest(r.read_delta_src, r.read_delta_dst)
                                                       if r.read_delta_src else ""))


def signed(secret: bytes, method: str, request):
    """``request`` with the ticket the planner would have issued for exactly its fields."""
    first = request[0] if isinstance(request, list) and request else request
    if method == "Prepare":
        _sign_prepare(secret, request)
    elif method == "Execute":
        request.ticket = sign(secret, "execute", *execute_fields(request.job, request.program_id, request.commit))
        if request.HasField("prepare"):
            _sign_prepare(secret, request.prepare)
    elif method == "Commit":
        request.ticket = sign(secret, "commit", *commit_fields(request.upload_id, request.job_id, request.tensor,
                                                               request.version, request.devices))
    elif method == "Abort":
        request.ticket = sign(secret, "abort", request.upload_id, request.job_id)
    elif method == "Release":
        request.ticket = sign(secret, "release", request.tensor, request.version)
    elif method == "Push" and isinstance(first, pb.PushChunk) and first.HasField("header"):
        first.header.ticket = sign(secret, "push", first.header.job, first.header.plan_id)
    elif method in ("PutShard", "PutShardIpc"):
        h = first.header if method == "PutShardIpc" else (first.header if isinstance(first, pb.ShardChunk)
                                                           and first.HasField("header") else None)
        if h is not None and len(h.box.lo) == len(h.box.hi):
            h.ticket = sign(secret, "put", *put_fields(h.upload_id, h.tensor, h.device, h.dtype,
                                                       tuple(zip(h.box.lo, h.box.hi))))
    return request


@pytest.fixture(scope="module")
def ticketed_agent():
    """A cluster whose agent "fz" runs in this process, so the test knows its registration secret and can sign
    what the planner would: the agent calls get past the ticket check to the code behind it."""
    with LocalCluster(1, 1, host_names=["host0"], transport="grpc") as cluster:
        # A push with a valid ticket for a job never prepared here waits for its prepare (it may ride in the
        # host's Execute, sent at the same time as the pusher's) up to the stall timeout: the fuzzer's never come.
        agent = Agent(AgentConfig("fz", DEVICES_PER_HOST, cluster.address, transport="grpc", token=cluster.token,
                                  stall_timeout_s=0.5))
        agent.start()
        try:
            caller = Caller(cluster)
            caller.channels["Agent"] = grpc.insecure_channel(agent.address)
            yield cluster, caller, agent
            caller.close()
        finally:
            agent.stop()


@pytest.mark.parametrize("method", TICKETED)
def test_agent_calls_with_valid_tickets(ticketed_agent, method):
    # half the others' count in make test: a valid Prepare or Execute gets as far as the agent's runtime, about
    # 0.4 s a call on CI's 2 cores (9 s apiece at 20 calls); the slow suite makes SLOW_EXAMPLES of each
    _fuzz_ticketed(ticketed_agent, method, EXAMPLES // 2)


@pytest.mark.slow
@pytest.mark.parametrize("method", TICKETED)
def test_agent_calls_with_valid_tickets_long(ticketed_agent, method):
    _fuzz_ticketed(ticketed_agent, method, SLOW_EXAMPLES)


def _fuzz_ticketed(ticketed_agent, method: str, examples: int) -> None:
    cluster, caller, agent = ticketed_agent

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=requests("Agent", method).map(lambda r: Shown(signed(agent.secret, method, r))))
    def run(request):
        check_answer(caller, "Agent", method, request.request, "right")

    run()
    health = health_pb2_grpc.HealthStub(caller.channels["Agent"]).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with cluster.connect() as c:
        assert {a["host"]: a["up"] for a in c.agents()}["fz"]


def test_only_a_commit_or_abort_of_uploads_may_name_further_uploads(ticketed_agent):
    """A job's Commit or Abort that names further uploads, under a ticket that signs exactly that (as a planner's
    would), is refused for what it is: only an upload's may, and nothing is committed or dropped."""
    cluster, caller, agent = ticketed_agent
    store = agent.runtime.store
    held = store.held()
    more = [("further-u2", "b", 1, ["fz/0"])]
    commit = pb.StagingRequest(job_id="uploads-only", tensor="a", version=1, more=[
        pb.UploadCommit(upload_id=u, tensor=t, version=v, devices=d) for u, t, v, d in more])
    commit.ticket = sign(agent.secret, "commit", *commit_fields("", "uploads-only", "a", 1, [], more))
    code, details = caller.call("Agent", "Commit", commit)
    assert code == C.INVALID_ARGUMENT, (code, details)
    assert "Commit of job 'uploads-only' names 1 further uploads; only a Commit of uploads may" in details
    abort = pb.StagingRequest(job_id="uploads-only", more=[pb.UploadCommit(upload_id="further-u2")])
    abort.ticket = sign(agent.secret, "abort", *abort_fields("", "uploads-only", ["further-u2"]))
    code, details = caller.call("Agent", "Abort", abort)
    assert code == C.INVALID_ARGUMENT, (code, details)
    assert "Abort of job 'uploads-only' names 1 further uploads; only an Abort of uploads may" in details
    # The same calls with a ticket for other fields never reach that check: the ticket is refused first.
    commit.ticket = sign(agent.secret, "commit", *commit_fields("", "uploads-only", "a", 1, []))
    assert caller.call("Agent", "Commit", commit)[0] == C.PERMISSION_DENIED
    assert store.held() == held and not store.ended("further-u2") and not store.ended("uploads-only")
    health = health_pb2_grpc.HealthStub(caller.channels["Agent"]).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
