"""What a consumer of a state dict expects to receive: every tensor's name, shape and dtype, and the gate that
refuses a transfer which does not match it.

A weight sync that installs an incomplete model passes every digest check, since digests cover only what the plan
moves (a trainer that published its per-rank names instead of the global ones once refitted half a model and
looked faster). The consumer therefore declares what it expects, built in one call from its module or state dict
(`Manifest.from_module`, `Manifest.from_state_dict`), and a sync compares it with what it is about to move before a
byte moves (`Manifest.check`): each missing, extra or mismatched name is listed. The manifest is a plain value: it
prints as a short summary, travels as JSON and has a stable content digest, which the job that checked it records.

Tensors are duck-typed on ``.shape`` and ``.dtype`` (numpy arrays, torch tensors and DTensors, jax arrays), so the
core imports no framework; a DTensor's shape is its global shape.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from reshard.dtypes import dtype_name
from reshard.errors import ReshardError
from reshard.jsonio import MAX_BYTES, MAX_DEPTH, field_of, loads, need

__all__ = ["Manifest", "ManifestError", "ManifestDiff", "MANIFEST_FORMAT"]

MANIFEST_FORMAT = 1  # the "format" field of a manifest's JSON
_SHOWN = 8  # names a message lists of each kind, before "... and N more"


class ManifestError(ReshardError, ValueError):
    """What a transfer would move differs from the consumer's manifest (names missing, extra, or of another shape
    or dtype); nothing moved. A caller's mistake, so the service answers INVALID_ARGUMENT."""


@dataclass(frozen=True)
class ManifestDiff:
    """How what is offered differs from a manifest: names it lacks (with why, when known), names it has besides,
    and names whose (shape, dtype) differ, as (name, expected, offered)."""

    missing: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, tuple, tuple], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.mismatched)

    def __str__(self) -> str:
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing: " + _listed(
                [f"{n!r}" + (f" ({why})" if why else "") for n, why in self.missing]))
        if self.extra:
            parts.append(f"{len(self.extra)} extra: " + _listed([repr(n) for n in self.extra]))
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} mismatched: " + _listed(
                [f"{n!r} is {_entry_str(got)} where the manifest has {_entry_str(want)}"
                 for n, want, got in self.mismatched]))
        return "; ".join(parts) or "no difference"


@dataclass(frozen=True)
class Manifest:
    """Tensors by name, each with its global shape and dtype name, sorted by name.

    ``Manifest({"w": ((4, 8), "float32")})``, or built from a module or a state dict. Prints as a summary
    (``Manifest(21 tensors, 2.4 MiB, sha256 3f2a...)``); `digest` is the SHA-256 of its canonical JSON, the same
    on every machine and for every order of the names.
    """

    tensors: Mapping[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.tensors, Mapping):
            raise ManifestError(f"a Manifest holds {{name: (shape, dtype)}}; got {type(self.tensors).__name__}")
        checked = {}
        for name, entry in self.tensors.items():
            if not isinstance(name, str) or not name:
                raise ManifestError(f"manifest names are non-empty strings; got {name!r}")
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise ManifestError(f"manifest entry of {name!r} must be (shape, dtype); got {entry!r}")
            shape, dtype = entry
            if not isinstance(shape, (tuple, list)) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise ManifestError(f"manifest shape of {name!r} must be a tuple of sizes >= 0; got {shape!r}")
            try:
                dtype = dtype_name(dtype)
            except ValueError as e:
                raise ManifestError(f"manifest dtype of {name!r}: {e}") from None
            checked[name] = (tuple(int(n) for n in shape), dtype)
        # Frozen means frozen: a private sorted copy, so a caller's later change to its dict cannot reach it.
        object.__setattr__(self, "tensors", _FrozenDict(sorted(checked.items())))

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, state_dict: Mapping) -> "Manifest":
        """The manifest of ``state_dict`` (name -> anything with ``.shape`` and ``.dtype``; a DTensor counts with
        its global shape)."""
        if not isinstance(state_dict, Mapping):
            raise ManifestError(f"Manifest.from_state_dict takes a mapping {{name: tensor}}; got "
                                f"{type(state_dict).__name__} (for a module, use Manifest.from_module)")
        entries = {}
        for name, t in state_dict.items():
            if not (hasattr(t, "shape") and hasattr(t, "dtype")):
                raise ManifestError(f"state dict entry {name!r} is a {type(t).__name__}, which has no .shape and "
                                    f".dtype; a manifest lists tensors only")
            entries[name] = (tuple(int(n) for n in t.shape), t.dtype)
        return cls(entries)

    @classmethod
    def from_module(cls, module) -> "Manifest":
        """The manifest of ``module.state_dict()``: what loading that module's weights needs, buffers included."""
        state_dict = getattr(module, "state_dict", None)
        if not callable(state_dict):
            raise ManifestError(f"Manifest.from_module takes a module with .state_dict(); got "
                                f"{type(module).__name__} (for a dict of tensors, use Manifest.from_state_dict)")
        return cls.from_state_dict(state_dict())

    def with_prefix(self, prefix: str) -> "Manifest":
        """The same tensors named ``prefix + name``: a consumer's manifest for weights published under a prefix."""
        return Manifest({prefix + n: e for n, e in self.tensors.items()})

    # -- reading -------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    @property
    def nbytes(self) -> int:
        from reshard.dtypes import itemsize

        total = 0
        for shape, dtype in self.tensors.values():
            n = itemsize(dtype)
            for s in shape:
                n *= s
            total += n
        return total

    def to_json(self) -> dict:
        return {"format": MANIFEST_FORMAT,
                "tensors": [{"name": n, "shape": list(s), "dtype": d} for n, (s, d) in self.tensors.items()]}

    def json_text(self) -> str:
        """The canonical JSON text: names sorted, no spaces; what `digest` hashes and the wire carries."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of `json_text`: equal manifests have equal digests, whatever order they were built in."""
        return hashlib.sha256(self.json_text().encode()).hexdigest()

    @classmethod
    def from_json(cls, data, *, max_bytes: int | None = MAX_BYTES, max_depth: int = MAX_DEPTH) -> "Manifest":
        """A manifest from `to_json`'s dict, or from its text (read with the size and nesting limits given)."""
        if isinstance(data, (str, bytes)):
            data = loads(data, "manifest_json", max_bytes=max_bytes, max_depth=max_depth)
        need(data, "object", "manifest", ManifestError)
        fmt = field_of(data, "format", "integer", "manifest", ManifestError)
        if fmt != MANIFEST_FORMAT:
            raise ManifestError(f"manifest format {fmt} is not one this version reads ({MANIFEST_FORMAT}); "
                                f"build the manifest with the same reshard version as the service")
        entries = {}
        for i, t in enumerate(field_of(data, "tensors", "array", "manifest", ManifestError)):
            what = f"manifest tensors[{i}]"
            need(t, "object", what, ManifestError)
            name = field_of(t, "name", "string", what, ManifestError)
            if name in entries:
                raise ManifestError(f"manifest names {name!r} twice; each tensor is listed once")
            shape = field_of(t, "shape", "array", what, ManifestError)
            entries[name] = (tuple(shape), field_of(t, "dtype", "string", what, ManifestError))
        return cls(entries)

    # -- the gate ------------------------------------------------------------------------------

    def diff(self, offered: Mapping[str, tuple], absent: Iterable[tuple[str, str]] = ()) -> ManifestDiff:
        """How ``offered`` ({name: (shape, dtype)}) differs from this manifest. ``absent`` gives, for names the
        caller knows why it lacks, the reason (e.g. "not in the catalog"), shown beside them."""
        why = dict(absent)
        missing = tuple((n, why.get(n, "")) for n in self.tensors if n not in offered)
        extra = tuple(sorted(n for n in offered if n not in self.tensors))
        mismatched = []
        for name, (shape, dtype) in self.tensors.items():
            if name in offered:
                got_shape, got_dtype = offered[name]
                got = (tuple(int(n) for n in got_shape), dtype_name(got_dtype))
                if got != (shape, dtype):
                    mismatched.append((name, (shape, dtype), got))
        return ManifestDiff(missing, extra, tuple(mismatched))

    def check(self, offered: Mapping[str, tuple], what: str, absent: Iterable[tuple[str, str]] = ()) -> None:
        """Raise `ManifestError` listing every difference of ``offered`` from this manifest; ``what`` names the
        transfer in the message ("reshard_many of 21 tensors")."""
        found = self.diff(offered, absent)
        if found:
            raise ManifestError(
                f"{what} does not match the consumer's manifest ({len(self)} tensors, sha256 {self.digest[:12]}): "
                f"{found}. Nothing moved. Publish every tensor the manifest lists under its global name, shape and "
                f"dtype (a state dict's own names, not per-rank ones), or build the manifest from the module that "
                f"will load the weights (Manifest.from_module)")

    def __str__(self) -> str:
        return f"Manifest({len(self)} tensors, {_size(self.nbytes)}, sha256 {self.digest[:12]})"

    def __repr__(self) -> str:
        shown = ", ".join(f"{n!r}: {_entry_str(e)}" for n, e in list(self.tensors.items())[:3])
        more = f", ... {len(self) - 3} more" if len(self) > 3 else ""
        return f"Manifest({{{shown}{more}}})"


class _FrozenDict(dict):
    """A dict that refuses changes and hashes by content: the inside of a frozen `Manifest`."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a Manifest is immutable; build a new one")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))


def _entry_str(entry: tuple) -> str:
    shape, dtype = entry
    return f"{dtype}{list(shape)}"


def _listed(items: list[str]) -> str:
    more = len(items) - _SHOWN
    return ", ".join(items[:_SHOWN]) + (f", ... and {more} more" if more > 0 else "")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
