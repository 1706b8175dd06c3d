"""Reading JSON that may come from anyone: bounded decoding and typed access to fields.

Every JSON document a service reads (a sharding, a plan, a program) goes through
`loads`, which refuses a document over ``max_bytes`` or nested deeper than
``max_depth`` *before* it is parsed: a scan of the text bounds the nesting, so
a document of a million ``[`` costs a few passes over a string, not a
``RecursionError`` in the parser. ``NaN``, ``Infinity`` and numbers too large
for a float are refused too: standard JSON has none of them.

The ``from_json`` readers of the core check what they read with `need` and
`field_of`, so a malformed document raises the reader's own ``ValueError``
subclass with a message that names the field, the JSON type it must have and
what it has instead, never a ``TypeError`` or ``KeyError`` from deep inside.

============ ===================================================================
JSON type    Python value `need` accepts
============ ===================================================================
object       a mapping
array        a list or tuple
string       a str
integer      an int (not a bool)
number       an int or a finite float (not a bool)
boolean      a bool
============ ===================================================================
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping

from reshard.errors import InvalidJsonError, JsonLimitError

__all__ = ["loads", "nesting_bound", "need", "field_of", "describe", "brief", "quoted", "plain", "canonical",
           "MAX_BYTES", "MAX_DEPTH"]

# Defaults for callers with no configuration of their own; the planner's come from its config.
MAX_BYTES = 4 * 2**20
MAX_DEPTH = 32

_ESCAPE = re.compile(r"\\.", re.DOTALL)
_STRING = re.compile(r'"[^"]*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_AS_PARENS = str.maketrans("[]{}", "()()")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A document longer than this is scanned and decoded in pieces (`_brackets`, `_decode_in_pieces`): one C call over
# all of it holds the GIL throughout, and a 15 MiB program (8,000 tensors) held it for 0.6 s of json.loads and 0.3 s
# of scanning, which on a loaded host kept an agent's heartbeat thread from running for over 5 s: the planner marked
# the agent down in the middle of its job.
PIECE_CHARS = 1 << 18

_TYPES = {
    "object": (Mapping,),
    "array": (list, tuple),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
# The one Python type json.loads makes for each JSON type that has one (a number may be either int or float).
_PARSED = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool}
_EXPECTED = {"object": "a JSON object {...}", "array": "a JSON array [...]", "string": "a string",
             "integer": "an integer", "number": "a finite number", "boolean": "true or false"}
_NOUNS = ((Mapping, "an object"), ((list, tuple), "an array"), (str, "a string"), (int, "an integer"),
          (float, "a number"))
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 80, 80, 4, 4

_MISSING = object()

# A string as JSON text, exactly as json.dumps writes it, without json.dumps's set-up per call: for documents
# written piece by piece from hundreds of names (a state dict's tensor records and jobs).
quoted = json.encoder.encode_basestring_ascii
# Any value as JSON text, exactly as ``json.dumps(value)`` and ``json.dumps(value, sort_keys=True,
# separators=(",", ":"))`` (the canonical form ids hash) write it: json.dumps builds a new encoder per call when
# given options, and a program's writer calls these for every shared box and route of a million steps.
plain = json.encoder.JSONEncoder().encode
canonical = json.encoder.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def brief(value) -> str:
    """``repr(value)``, cut short however large or deep the value is, for error messages."""
    return _REPR.repr(value)


def describe(value) -> str:
    """A value's JSON type and `brief` rendering: ``an array [1, 2]``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    for types, noun in _NOUNS:
        if isinstance(value, types):
            return f"{noun} {brief(value)}"
    return f"a {type(value).__name__} {brief(value)}"


def _fits(value, kind: str) -> bool:
    """Whether ``value`` has the JSON type ``kind`` (see the module's table)."""
    if type(value) is _PARSED.get(kind):  # what json.loads makes: no bool posing as an int, no float to check
        return True
    if not isinstance(value, _TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
        return False
    return not (kind == "number" and isinstance(value, float) and not math.isfinite(value))


def need(value, kind: str, what: str, error: type[ValueError]):
    """``value`` if it has the JSON type ``kind`` (see the module's table), else ``error`` naming ``what``."""
    if not _fits(value, kind):
        raise error(f"{what} must be {_EXPECTED[kind]}; got {describe(value)}")
    return value


def field_of(data: Mapping, key: str, kind: str, what: str, error: type[ValueError], default=_MISSING):
    """Field ``key`` of the object ``data`` (already checked with `need`), of JSON type ``kind``.

    Without ``default`` the field is required; ``what`` names the document, e.g. ``"plan JSON"``.
    """
    if key not in data:
        if default is _MISSING:
            raise error(f"{what} lacks the field {key!r}, which must be {_EXPECTED[kind]}")
        return default
    value = data[key]
    # The field's name goes into a message only when there is one to give: a program has a hundred thousand fields.
    return value if _fits(value, kind) else need(value, kind, f"{what} field {key!r}", error)


def nesting_bound(text: str, limit: int | None = None) -> int:
    """An upper bound on how deeply arrays and objects nest in ``text``, exact for valid JSON; with
    ``limit``, the count stops early at some number over ``limit``.

    Escapes and strings are cut out (brackets inside strings do not nest), the
    brackets left become parentheses, and each pass removes every innermost
    ``()``: a pass lowers the deepest nesting by one at most, so the passes made
    plus the openers left unmatched bound how deep a parser would recurse, even
    in a document that is not valid JSON. Every step runs in C over the text,
    at most ``limit + 1`` passes.
    """
    brackets = _brackets(_ESCAPE.sub("", text)).translate(_AS_PARENS)
    passes = 0
    while "()" in brackets and (limit is None or passes <= limit):
        brackets = brackets.replace("()", "")
        passes += 1
    return passes + brackets.count("(")


def _brackets(text: str) -> str:
    """The brackets of ``text`` (escapes already cut out) outside its strings, in order: cut piece by piece, each
    piece ending after an even number of quotes, so none starts inside a string and each is cut exactly as the
    whole text would be (an unmatched quote leaves the rest of the text one piece)."""
    if len(text) <= PIECE_CHARS:
        return _NOT_BRACKET.sub("", _STRING.sub("", text))
    out, start = [], 0
    while start < len(text):
        end = start + PIECE_CHARS
        if text.count('"', start, end) % 2:
            close = text.find('"', end)
            end = len(text) if close < 0 else close + 1
        out.append(_NOT_BRACKET.sub("", _STRING.sub("", text[start:end])))
        start = end
    return "".join(out)


def _decode_in_pieces(text: str, decoder: json.JSONDecoder, levels: int = 2) -> object:
    """``decoder.decode(text)``, the members and items of the outer ``levels`` arrays and objects decoded one at a
    time (a program's steps, its tensors), so that no one call holds the GIL for the whole document; raises
    json.JSONDecodeError where json.loads would. The nesting was bounded before (`nesting_bound`)."""
    value, end = _piece(text, _WHITESPACE.match(text, 0).end(), decoder, levels)
    end = _WHITESPACE.match(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _piece(text: str, i: int, decoder: json.JSONDecoder, levels: int) -> tuple[object, int]:
    """The JSON value starting at ``i`` and the index after it, as `_decode_in_pieces` reads it."""
    opener = text[i:i + 1]
    if levels <= 0 or opener not in ("[", "{"):
        return decoder.raw_decode(text, i)
    closer, is_object = ("}", True) if opener == "{" else ("]", False)
    out: dict | list = {} if is_object else []
    i = _WHITESPACE.match(text, i + 1).end()
    if text.startswith(closer, i):
        return out, i + 1
    while True:
        if is_object:
            if not text.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
            key, i = decoder.raw_decode(text, i)
            i = _WHITESPACE.match(text, i).end()
            if not text.startswith(":", i):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
            item, i = _piece(text, _WHITESPACE.match(text, i + 1).end(), decoder, levels - 1)
            out[key] = item
        else:
            item, i = _piece(text, i, decoder, levels - 1)
            out.append(item)
        i = _WHITESPACE.match(text, i).end()
        if text.startswith(closer, i):
            return out, i + 1
        if not text.startswith(",", i):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
        i = _WHITESPACE.match(text, i + 1).end()
        if is_object and not text.startswith('"', i):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} does not fit a 64-bit float")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value (standard JSON has no NaN or Infinity)")


def loads(text, what: str, *, max_bytes: int | None = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """The value of the JSON document ``text`` (str, or UTF-8 bytes), read as ``what`` (e.g. "sharding_json").

    Raises `JsonLimitError` for a document over ``max_bytes`` bytes (None: any
    size, for text already trusted to be as large as it is) or nested deeper
    than ``max_depth``, and `InvalidJsonError` for one that is not standard
    JSON; both name ``what``.
    """
    if max_bytes is None:
        max_bytes = math.inf
    if isinstance(text, (bytes, bytearray, memoryview)):
        size = len(text)
        if size > max_bytes:
            raise JsonLimitError(f"{what} is {size} bytes, over the limit of {max_bytes} bytes for a JSON document")
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidJsonError(f"{what} is not UTF-8: {e.reason} at byte {e.start}") from None
    elif isinstance(text, str):
        size = _utf8_size(text)
        if size > max_bytes:
            raise JsonLimitError(f"{what} is {size} bytes, over the limit of {max_bytes} bytes for a JSON document")
    else:
        raise InvalidJsonError(f"{what} must be JSON text (a string); got {describe(text)}")
    if nesting_bound(text, max_depth) > max_depth:
        raise JsonLimitError(f"{what} nests arrays and objects more than {max_depth} levels deep, the limit for a "
                             f"JSON document")
    try:
        if len(text) > PIECE_CHARS:
            return _decode_in_pieces(text, json.JSONDecoder(parse_float=_finite, parse_constant=_no_constant))
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise InvalidJsonError(f"{what} is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # a number JSON allows but Python will not convert, e.g. 1e999 or 5,000 digits
        raise InvalidJsonError(f"{what} is not usable JSON: {e}") from None
