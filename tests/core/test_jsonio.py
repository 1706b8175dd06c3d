"""`reshard.jsonio`: JSON read within limits, refused before parsing when too large or too deep.

The depth bound is checked against the real nesting of generated documents, and
arbitrary text (brackets and quotes weighted in) is shown to raise nothing but
`InvalidJsonError`: never a ``RecursionError`` from the parser. A long document is
scanned and decoded in pieces, with the same value or the same refusal as in one
piece, and lets other threads run while it is read.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import InvalidJsonError, InvalidShardingError, JsonLimitError, ReshardError
from reshard import jsonio
from reshard.jsonio import MAX_DEPTH, describe, field_of, loads, need, nesting_bound

# (name, text, limits, error, message)
CASES = [
    ("an object", '{"a": [1, 2.5, "x", null, true]}', {}, None, None),
    ("32 levels, the limit", "[" * 32 + "]" * 32, {}, None, None),
    ("33 levels", "[" * 33 + "]" * 33, {}, JsonLimitError,
     r"^doc nests arrays and objects more than 32 levels deep, the limit for a JSON document$"),
    ("a million unclosed brackets", "[" * 1_000_000, {"max_bytes": 2**21}, JsonLimitError, r"more than 32 levels"),
    ("unclosed brackets, then closers of the other kind", "[" * 100_000 + "}" * 100_000, {}, JsonLimitError,
     r"more than 32 levels"),
    ("deep objects", '{"a":' * 40 + "1" + "}" * 40, {}, JsonLimitError, r"more than 32 levels"),
    ("brackets inside strings do not nest", json.dumps(["[" * 1000 + '\\"{' * 100]), {}, None, None),
    ("a lower depth limit", "[[[1]]]", {"max_depth": 2}, JsonLimitError, r"more than 2 levels deep"),
    ("over the size limit", "[" + "1," * 600 + "1]", {"max_bytes": 1000}, JsonLimitError,
     r"^doc is 1203 bytes, over the limit of 1000 bytes for a JSON document$"),
    ("size counts UTF-8 bytes", json.dumps("é" * 500, ensure_ascii=False), {"max_bytes": 1000}, JsonLimitError,
     r"is 1002 bytes"),
    ("bytes over the limit", b"[1, 2]", {"max_bytes": 5}, JsonLimitError, r"is 6 bytes, over the limit of 5"),
    ("UTF-8 bytes", '{"é": 1}'.encode(), {}, None, None),
    ("bytes that are not UTF-8", b'{"a": "\xff"}', {}, InvalidJsonError,
     r"^doc is not UTF-8: invalid start byte at byte 7$"),
    ("empty", "", {}, InvalidJsonError, r"^doc is not JSON: Expecting value at line 1 column 1$"),
    ("cut off", '{"a": [1, 2', {}, InvalidJsonError, r"is not JSON: Expecting ',' delimiter"),
    ("trailing data", "{} {}", {}, InvalidJsonError, r"is not JSON: Extra data at line 1 column 4"),
    ("NaN", '{"a": NaN}', {}, InvalidJsonError, r"NaN is not a JSON value \(standard JSON has no NaN or Infinity\)"),
    ("-Infinity", "[-Infinity]", {}, InvalidJsonError, r"-Infinity is not a JSON value"),
    ("a number too large for a float", "[1e999]", {}, InvalidJsonError,
     r"the number 1e999 does not fit a 64-bit float"),
    ("an integer of 5000 digits", "9" * 5000, {}, InvalidJsonError, r"is not usable JSON: .*integer string"),
    ("not text at all", 5, {}, InvalidJsonError, r"^doc must be JSON text \(a string\); got an integer 5$"),
]


@pytest.mark.parametrize("text,limits,error,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_loads(text, limits, error, message):
    if error is None:
        assert loads(text, "doc", **limits) == json.loads(text)
        return
    with pytest.raises(error, match=message) as e:
        loads(text, "doc", **limits)
    assert isinstance(e.value, ValueError) and isinstance(e.value, ReshardError)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


BRACKETY = st.text(st.sampled_from('[]{}"\\,:ab '), max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | BRACKETY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(BRACKETY, inner, max_size=4),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_the_nesting_bound_is_the_depth_of_valid_json(value, indent):
    text = json.dumps(value, indent=1 if indent else None, ensure_ascii=indent)
    assert nesting_bound(text) == _depth(value)
    assert nesting_bound(text, limit=1) >= min(_depth(value), 2)


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from('[]{}"\\:,0 a'), max_size=400) | st.text(max_size=50))
def test_any_text_reads_or_raises_invalid_json(text):
    try:
        loads(text, "doc", max_depth=4)
    except InvalidJsonError:
        pass


def test_the_bound_covers_what_a_parser_would_recurse_into_in_a_broken_document():
    # Strings the parser never reaches still count, and unmatched openers count as levels.
    assert nesting_bound('[[["]]]') == 3
    assert nesting_bound("]]][[[") == 3
    assert nesting_bound("[" * 10, limit=3) >= 4


@pytest.mark.parametrize("value,kind,message", [
    (None, "object", r"^sharding JSON field 'mesh' must be a JSON object \{\.\.\.\}; got null$"),
    ([1, 2], "object", r"must be a JSON object \{\.\.\.\}; got an array \[1, 2\]$"),
    ({"a": 1}, "array", r"must be a JSON array \[\.\.\.\]; got an object \{'a': 1\}$"),
    (True, "integer", r"must be an integer; got true$"),
    (2.0, "integer", r"must be an integer; got a number 2\.0$"),
    (float("nan"), "number", r"must be a finite number; got a number nan$"),
    ("x" * 1000, "integer", r"got a string 'x{30,}\.\.\.x+'$"),
    ([[[[[1]]]]], "string", r"got an array \[\[\[\[\.\.\.\]\]\]\]$"),
])
def test_need_names_the_field_the_type_it_must_have_and_what_it_has(value, kind, message):
    with pytest.raises(InvalidShardingError, match=message):
        need(value, kind, "sharding JSON field 'mesh'", InvalidShardingError)


def test_field_of():
    doc = {"mesh": {}, "spec": None}
    assert field_of(doc, "mesh", "object", "sharding JSON", InvalidShardingError) == {}
    assert field_of(doc, "other", "array", "sharding JSON", InvalidShardingError, default=()) == ()
    with pytest.raises(InvalidShardingError, match=r"^sharding JSON lacks the field 'x', which must be a string$"):
        field_of(doc, "x", "string", "sharding JSON", InvalidShardingError)
    with pytest.raises(InvalidShardingError, match=r"^sharding JSON field 'spec' must be a JSON array \[\.\.\.\]; "
                                                   r"got null$"):
        field_of(doc, "spec", "array", "sharding JSON", InvalidShardingError)


def test_describe_is_short_however_large_the_value():
    assert len(describe(list(range(10**5)))) < 100
    assert len(describe({"k" * 10**5: "v" * 10**5})) < 300
    assert describe(1.5) == "a number 1.5" and describe("a") == "a string 'a'" and describe(False) == "false"


def test_the_default_depth_admits_every_document_the_core_writes():
    assert MAX_DEPTH >= 12  # program JSON nests 8 deep: program, tensors, decl, src, mesh, axes, pair


def _read(text: str, piece_chars: int):
    """``loads(text)`` (depth up to 64) with documents over ``piece_chars`` read in pieces: its value, or the class
    of its refusal."""
    kept = jsonio.PIECE_CHARS
    jsonio.PIECE_CHARS = piece_chars
    try:
        return "value", loads(text, "doc", max_bytes=None, max_depth=64), nesting_bound(text)
    except (InvalidJsonError, JsonLimitError) as e:
        return type(e).__name__, None, nesting_bound(text)
    finally:
        jsonio.PIECE_CHARS = kept


DOCUMENT = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | BRACKETY,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(BRACKETY, inner, max_size=6),
    max_leaves=60,
)
# Valid documents as json.dumps writes them (spaced or not), and the same cut, spliced or salted with the characters
# that decide where a piece may end and how a value closes.
TEXT = st.one_of(
    st.builds(lambda v, indent: json.dumps(v, indent=indent, ensure_ascii=False), DOCUMENT, st.sampled_from([None, 1])),
    st.builds(lambda v, cut: json.dumps(v)[:cut], DOCUMENT, st.integers(0, 200)),
    st.builds(lambda v, at, extra: (lambda t: t[:at] + extra + t[at:])(json.dumps(v)), DOCUMENT, st.integers(0, 200),
              st.text(st.sampled_from('[]{}"\\,: 1'), max_size=3)),
    st.text(st.sampled_from('[]{}"\\:,0 a'), max_size=200),
)


@settings(max_examples=200, deadline=None)
@given(TEXT, st.integers(1, 40))
def test_a_long_document_reads_in_pieces_as_it_reads_whole(text, piece_chars):
    assert _read(text, piece_chars) == _read(text, 10**9)


@pytest.mark.slow  # the same at length, in make bench: 600 more documents
@settings(max_examples=600, deadline=None)
@given(TEXT, st.integers(1, 40))
def test_a_long_document_reads_in_pieces_as_it_reads_whole_long(text, piece_chars):
    assert _read(text, piece_chars) == _read(text, 10**9)


# Run in a fresh interpreter, whose heap is the document's alone: the cyclic collector's passes, which hold the GIL
# too and grow with the heap, are then the same for both ways of reading it.
_HELD_UP = r"""
import json, sys, threading, time
from reshard import jsonio

steps = [{"id": i, "kind": "move", "tensor": f"t{i // 8}", "after": [i - 1] if i % 8 else [],
          "transfer": {"box": [[0, 8], [i % 8, i % 8 + 1]], "sender": f"host{i % 4}/gpu0",
                       "receivers": [f"host{4 + i % 4}/gpu0", f"host{4 + (i + 1) % 4}/gpu0"],
                       "method": "broadcast", "route": [], "chunk_bytes": 0}} for i in range(32_000)]
text = json.dumps({"kind": "program", "tensors": [{"name": f"t{i}"} for i in range(4_000)], "steps": steps})
del steps
assert len(text) > 5 * 2**20 > 16 * jsonio.PIECE_CHARS


def held_up(piece_chars):
    jsonio.PIECE_CHARS = piece_chars
    worst, stop = [0.0], threading.Event()

    def tick():
        # What the reading thread held it up: the wall time past its 5 ms sleep, but no more than this process's
        # CPU time past it (the reader ran while it waited), so that a spell in which the whole process is not
        # scheduled (a loaded host: make test's two workers) is not taken for a hold of the GIL
        while not stop.is_set():
            t0, c0 = time.perf_counter(), time.process_time()
            time.sleep(0.005)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            worst[0] = max(worst[0], min(wall, cpu) - 0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    value = jsonio.loads(text, "program_json", max_bytes=None)
    stop.set()
    ticker.join()
    assert len(value["steps"]) == 32_000 and value["steps"][-1]["id"] == 31_999
    return worst[0]


# The best of three in pieces: a thread also waits while this process is not scheduled at all, which on a loaded
# host (every suite at once) is a spike in one reading, not a hold of the GIL in each; the median of three whole,
# which such a spike only lengthens
pieces = min(held_up(jsonio.PIECE_CHARS) for _ in range(3))
whole = sorted(held_up(10**12) for _ in range(3))[1]
print(json.dumps({"pieces": pieces, "whole": whole}))
"""


def test_a_program_sized_document_reads_in_pieces_and_lets_other_threads_run():
    """A 15 MiB document of 64,000 small objects (a program of 8,000 tensors is that): one json.loads of it held the
    GIL for 0.6 s here, its own decoding and the collector's passes it set off, and an agent's heartbeat thread,
    which cannot run meanwhile, then missed the planner's 5 s on a loaded host and the agent was marked down in the
    middle of its job. Read in pieces, a thread that sleeps 5 ms at a time waits at most for one piece or one
    collector pass. The test reads half of that document (7.5 MiB, still 30 pieces), six times: the whole of it
    took 13 s of make test. A collector pass over the half document's heap takes about 0.1 s here, so read in pieces
    a thread waits up to 0.08-0.12 s against 0.15-0.29 s whole (idle machine, three runs of three): the bound is
    two thirds of the whole's hold, which reading it whole in pieces' place (about the whole's hold) still fails."""
    run = subprocess.run([sys.executable, "-c", _HELD_UP], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    held = json.loads(run.stdout.splitlines()[-1])
    assert held["pieces"] < held["whole"] / 1.5, (
        f"a sleeping thread was held up {held['pieces']:.3f} s while the document was read in pieces, "
        f"{held['whole']:.3f} s while it was read whole")
