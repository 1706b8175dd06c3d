"""The planner's catalog of tensors, and the uploads that may add to it.

A tensor enters the catalog only when every device of its sharding holds its
shard: an upload is a transaction that commits whole or leaves nothing. An
upload that goes quiet for ``upload_timeout_s`` (a client that died midway) is
expired and its staged shards dropped. Uploads opened as a group (put_many)
commit together, entering the catalog in one step (`Catalog.commit`), and
expire together, once no member has been active for the timeout. A group opened
by a key (`Uploads.begin_group`) is shared by several callers, the ranks of a
DTensor publish: each opens it with the same declarations, hands over its own
devices' shards and marks them done (`Uploads.mark_group`); it commits when every
device of every tensor is in, and every caller can wait for that outcome.

A tensor also records the devices whose shards are gone (``lost``): those of a
host whose agent restarted, as a new process holds nothing of the old one's. A
tile whose every copy is lost makes the tensor lost: reads raise a data-loss
error naming the tiles, and reshards are refused (see `Planner.reshard`); a
new version (a reshard, or a delete and a new upload) starts with nothing lost.

A name holds versions: an upload of a name that exists publishes its next version (of the same shape and
dtype), labeled with an optional ``step`` (the training step) that a reshard carries over. Readers may pin
versions (`Catalog.pin`), which keeps them on their agents after newer ones commit, until released or expired.

Delta sync (issue 40): every version records a content id (``TensorRecord.content``): an upload's is fresh, a
reshard's copies its source's, so two versions of a name with one content id hold the same values in whatever
layouts. As a reshard_many commits tensor n from version c (the senders' sharding A) to d (sharding B), the
catalog holds (c, d) as n's *base pair* (`BasePair`): the next sync of n moves only what changed since c, diffed
on the senders against c and applied on the receivers to d. The pair is held as a pin is (the same hold counts,
so `versions` and the kept and freed versions stay right), replaces n's previous pair (whose versions are then
freed unless current or pinned), is saved with the planner's state, expires after ``pin_timeout_s`` without a
job using it, and goes with a delete of n. Its cost: one extra version per layout per tensor on the agents (c on
the senders' devices once a newer upload supersedes it, d on the receivers' once the next sync does), at most
one pair per name, freed at the next sync or on expiry; a catalog made with ``delta=False`` (the planner's
--no-delta) holds none.
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from itertools import repeat
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from reshard.box import Box, volume
from reshard.dtypes import dtype_name
from reshard.jsonio import quoted
from reshard.mesh import host_of
from reshard.proto.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from reshard.sharding import Sharding, normalise_shape
from reshard.server.planner.columns import Columns

__all__ = ["TensorRecord", "PinRecord", "BasePair", "Catalog", "Upload", "Uploads", "repeated_names", "check_step",
           "new_content"]

KINDS = ("numpy", "torch")
OUTCOMES_KEPT = 1024  # settled groups whose outcome a caller that waits for it can still read


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding
    version: int
    kind: str = "numpy"
    lost: frozenset[str] = frozenset()  # devices whose shard of this version is gone with their agent
    step: int | None = None  # the label its publisher gave it (a training step); None: unlabeled
    # Which values it holds (`new_content`): a reshard's copy shares its source's; "" unknown (a record saved
    # before content ids, a compute output), which matches nothing
    content: str = ""
    # The dtype of the version a job quantized on the way into this one ("" for any other version): its
    # publisher's next version may come back in it (a trainer publishes bf16 every step; the sync serves fp8).
    converted_from: str = ""

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "sharding": self.sharding.to_json(), "version": self.version, "kind": self.kind,
               "lost": sorted(self.lost), "step": self.step, "content": self.content}
        if self.converted_from:
            out["converted_from"] = self.converted_from
        return out

    def json_text(self) -> str:
        """``json.dumps(self.to_json())``, with the sharding's part written once per sharding: a state dict's job
        saves hundreds of records that share a few layouts; the strings are written by `jsonio.quoted`."""
        lost = ", ".join(map(quoted, sorted(self.lost)))
        return (f'{{"name": {quoted(self.name)}, "shape": [{", ".join(map(str, self.shape))}], '
                f'"dtype": {quoted(self.dtype)}, "sharding": {self.sharding.json_text()}, '
                f'"version": {self.version}, "kind": {quoted(self.kind)}, "lost": [{lost}], '
                f'"step": {"null" if self.step is None else self.step}, "content": {quoted(self.content)}'
                + (f', "converted_from": {quoted(self.converted_from)}}}' if self.converted_from else "}"))

    @classmethod
    def from_json(cls, data: dict) -> "TensorRecord":
        return cls(data["name"], tuple(data["shape"]), data["dtype"], Sharding.from_json(data["sharding"]),
                   int(data["version"]), data.get("kind", "numpy"), frozenset(data.get("lost", ())),
                   data.get("step"), data.get("content", ""), data.get("converted_from", ""))

    def lost_tiles(self) -> dict[Box, list[str]]:
        """The non-empty tiles whose every copy is lost, with the devices that held them."""
        if not self.lost:
            return {}
        holders: dict[Box, list[str]] = {}
        for dev, tile in self.sharding.tiles(self.shape).items():
            if volume(tile):
                holders.setdefault(tile, []).append(dev)
        return {tile: devs for tile, devs in holders.items() if self.lost.issuperset(devs)}


def new_content() -> str:
    """A fresh content id: values no other version is known to hold."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class BasePair:
    """Tensor ``name``'s delta base pair: ``src``, a version in the sharding it was last moved from (held on the
    senders' devices), and ``dst``, its copy in the sharding it was moved to (the receivers'), of one content."""

    name: str
    src: int
    dst: int

    def to_json(self) -> dict:
        return {"name": self.name, "src": self.src, "dst": self.dst}

    @classmethod
    def from_json(cls, data: dict) -> "BasePair":
        return cls(data["name"], int(data["src"]), int(data["dst"]))


_NONE_KEPT = {0: None}  # a name without kept versions, as `_top_locked` reads it


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
        raise InvalidArgumentError(f"tensor name {name!r} must be 1 to 256 printable characters")
    return name


def check_step(step) -> int | None:
    """A version label as given: None, or an int >= 0 (the training step)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgumentError(f"step {step!r} must be an int >= 0 (such as the training step), or None")
    return step


def check_same_layout(current: TensorRecord, new: TensorRecord) -> None:
    """Refuse a new version of ``current``'s name whose shape or dtype differs (its sharding may), but for the
    dtype a job quantized it from (``converted_from``): the training side publishes that one again."""
    if current.shape != new.shape or new.dtype not in (current.dtype, current.converted_from or current.dtype):
        was = (f", quantized on the way from {current.converted_from}, so a new version is "
               f"{current.converted_from} or {current.dtype}" if current.converted_from else "")
        raise InvalidArgumentError(
            f"tensor {new.name!r} is {current.dtype}{list(current.shape)} (v{current.version}{was}), and a new "
            f"version keeps its shape and dtype: this one is {new.dtype}{list(new.shape)}; delete it first to "
            f"change its shape or dtype, or put it under another name")


def _same_declaration(old: TensorRecord | None, new: TensorRecord) -> bool:
    """Whether ``new`` keeps ``old``'s shape, dtype, kind and lost devices (a weight sync's next version does)."""
    return old is not None and (old.shape, old.dtype, old.kind, old.lost) == (new.shape, new.dtype, new.kind, new.lost)


def _converted(old: TensorRecord | None, new: TensorRecord) -> bool:
    """Whether ``new`` keeps ``old``'s shape, kind and lost devices and changes its dtype only as a conversion does:
    quantized on the way from ``old``'s, or published again in the dtype ``old`` was quantized from."""
    return old is not None and (old.shape, old.kind, old.lost) == (new.shape, new.kind, new.lost) and (
        new.converted_from == old.dtype or (old.converted_from == new.dtype and not new.converted_from))


def label(rec: TensorRecord) -> str:
    return "unlabeled" if rec.step is None else f"step {rec.step}"


def held_text(held: list[TensorRecord]) -> str:
    """Versions held, as an error names them: ``v3 (step 5), v4 (step 6)``."""
    shown = [f"v{r.version} ({label(r)})" for r in held[-10:]]
    return ("..., " if len(held) > 10 else "") + ", ".join(shown)


@dataclass(frozen=True)
class PinRecord:
    """A reader's hold on one version of each of its tensors (`Catalog.pin`): a lease that keeps those versions
    on their agents, renewed by every read through it, until released or expired."""

    id: str
    versions: dict[str, int]  # tensor -> the version held
    step: int | None = None  # the label it was pinned by, if any

    def to_json(self) -> dict:
        return {"id": self.id, "versions": self.versions, "step": self.step}

    @classmethod
    def from_json(cls, data: dict) -> "PinRecord":
        return cls(data["id"], {n: int(v) for n, v in data["versions"].items()}, data.get("step"))


def repeated_names(names: list[str]) -> list[str]:
    """The names that appear more than once in ``names``, sorted: in linear time, as a state dict of ten thousand
    tensors is one request (counting each name's copies took 1.7 s there)."""
    return sorted(n for n, k in Counter(names).items() if k > 1)


class Catalog:
    """The current version of every tensor, the older versions pins still hold, and the pins.

    A name's versions number on from its highest version ever held (a job's or an upload's new version is
    claimed first: `claim`, `publishing`), so no two versions of a name ever share a number on an agent, also
    after a delete while a pin holds one. A version that stops being current (superseded by a commit, or its
    name deleted) is freed at once unless a pin holds it; then it is kept, readable through the pin or by its
    step label, until the last pin on it is released or expires (`release_pin`, `expired_pins`). A name's delta
    base pair (`BasePair`, see the module docstring) holds its two versions the same way, until replaced,
    expired (`expired_bases`) or its name deleted (`delete`); with ``delta`` False none is ever held. With a
    ``store`` the kept versions, the pins and the base pairs are saved as they change, and `restore` reads them
    back."""

    def __init__(self, store=None, pin_timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic,
                 delta: bool = True):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an upload's commit ended (`publishing`)
        self._tensors: dict[str, TensorRecord] = {}
        self._old: dict[str, dict[int, TensorRecord]] = {}  # name -> version -> one no longer current, pinned
        self._pins: dict[str, PinRecord] = {}
        self._used: dict[str, float] = {}  # pin id -> when it was last used (clock)
        self._holds: Counter[tuple[str, int]] = Counter()  # (name, version) -> pins on it
        # Beside the records, per name: the current version, sharding object, dtype and step label, the version a
        # job in flight commits it as (its claim) and how many uploads are committing it now (`Columns`)
        self._columns = Columns()
        self._bases: dict[str, BasePair] = {}  # name -> its delta base pair
        self._bases_used: dict[str, float] = {}  # name -> when a job last made or used its pair (clock)
        # Bumped by every change to which names exist or to a name's shape, dtype, kind or lost devices: what a
        # registered sync was checked against (`Planner.sync`). A new version of the same shape and dtype, in any
        # sharding (a weight sync's tensors go back and forth between two every step), leaves it. ``_shapes`` the
        # same but for a conversion's dtype: a weight quantized on the way (fp8 from bf16) and published again in
        # its source dtype changes dtype twice a step, which a sync that quantizes it checks itself.
        self._declared = 0
        self._shapes = 0
        self._store = store
        self.pin_timeout_s = pin_timeout_s
        self._clock = clock
        self.delta = delta

    def restore(self) -> None:
        """Read the current versions, the kept older ones, the pins and the base pairs back from the store (a
        restarted planner); every pin's lease and pair's starts again now. A catalog without ``delta`` (a planner
        restarted with --no-delta) reads its pairs back as expired already: the next `expired_bases` frees them."""
        self.load(TensorRecord.from_json(d) for d in self._store.tensors())
        now = self._clock()
        with self._lock:
            for d in self._store.held_versions():
                self._keep_locked(TensorRecord.from_json(d))
            for d in self._store.pins():
                pin = PinRecord.from_json(d)
                self._pins[pin.id] = pin
                self._used[pin.id] = now
                self._holds.update(pin.versions.items())
            for d in self._store.delta_bases():
                pair = BasePair.from_json(d)
                self._bases[pair.name] = pair
                self._bases_used[pair.name] = now if self.delta else -math.inf
                self._holds.update(((pair.name, pair.src), (pair.name, pair.dst)))

    @property
    def declared(self) -> int:
        """How many times the catalog's names, shapes, dtypes, kinds or lost devices changed (``_declared``)."""
        return self._declared

    @property
    def shapes(self) -> int:
        """`declared`, less the dtype changes of conversions (a weight quantized on the way, and its source
        dtype published again): see ``_shapes``."""
        return self._shapes

    def _redeclared_locked(self, changed: bool, converted: bool = False) -> None:
        """Count a change to the declarations (``changed``: names, shapes, dtypes, kinds or lost devices), or one
        of a conversion's dtype alone (``converted``), which `declared` counts and `shapes` does not."""
        self._declared += changed or converted
        self._shapes += changed

    def get(self, name: str) -> TensorRecord:
        with self._lock:
            rec = self._tensors.get(name)
            names = sorted(self._tensors) if rec is None else []  # only for the error: a lookup stays O(1)
        if rec is None:
            shown = names[:10] + (["..."] if len(names) > 10 else [])
            raise NotFoundError(f"no tensor named {name!r}; the catalog holds {shown}")
        return rec

    def contains(self, name: str) -> bool:
        with self._lock:
            return name in self._tensors

    def list(self) -> list[TensorRecord]:
        with self._lock:
            return sorted(self._tensors.values(), key=lambda r: r.name)

    def add(self, rec: TensorRecord) -> None:
        self.commit([(None, rec)])

    def swap(self, old: TensorRecord, new: TensorRecord) -> None:
        """Replace ``old`` by ``new`` if ``old`` is still current (the commit point of a reshard)."""
        self.commit([(old, new)])

    def commit(self, changes: list[tuple[TensorRecord | None, TensorRecord]],
               bases: dict[str, tuple[int, int]] | None = None) -> list[TensorRecord]:
        """Make every new record current at once, or none: the commit point of a job (one tensor, or many in a
        reshard_many) and of an upload (one tensor, or a put_many). Each old record must still be current; a new
        record without one publishes its name's next version, of the current one's shape and dtype. ``bases``
        (a reshard_many's: name -> (version moved, version committed)) become those names' base pairs, replacing
        their previous ones (none without ``delta``). Returns the versions this made free (superseded, or held by
        a replaced pair, and held by nothing else): the caller releases them on their agents."""
        with self._lock:
            for old, new in changes:
                current = self._tensors.get(new.name)
                if old is None and current is not None:
                    check_same_layout(current, new)
                if old is not None and current is not old and current != old:
                    raise NotFoundError(f"tensor {old.name!r} v{old.version} changed or was deleted during the "
                                        f"reshard")
            bases = (bases or {}) if self.delta else {}
            unpaired = self._free_locked(self._set_bases_locked(bases))
            freed, kept = list(unpaired), []
            changed = converted = False
            for _, new in changes:
                current = self._tensors.get(new.name)
                self._tensors[new.name] = new
                if not _same_declaration(current, new):
                    if _converted(current, new):
                        converted = True
                    else:
                        changed = True
                if current is not None and current.version != new.version:
                    (kept if self._holds[current.name, current.version] else freed).append(current)
            self._redeclared_locked(changed, converted)
            self._columns.set([new for _, new in changes])
            for rec in kept:
                self._keep_locked(rec)
        self._save_old(kept)
        self._save_bases(bases, [])
        self._forget_held(unpaired)
        return freed

    def current(self, names) -> list[TensorRecord | None]:
        """The records of ``names`` as they are at one instant, None for a name without one."""
        with self._lock:
            return list(map(self._tensors.get, names))

    def snapshot(self, names) -> list[TensorRecord]:
        """The records of ``names`` as they are at one instant (no commit between two of them)."""
        with self._lock:
            records = list(map(self._tensors.get, names))
            missing = [n for n, r in zip(names, records) if r is None] if not all(records) else []
            held = sorted(self._tensors) if missing else []
        if missing:
            shown = held[:10] + (["..."] if len(held) > 10 else [])
            raise NotFoundError(f"no tensor named {missing[0]!r}"
                                f"{f' (nor {len(missing) - 1} more of those asked for)' if len(missing) > 1 else ''}; "
                                f"the catalog holds {shown}")
        return records

    def delete(self, name: str) -> tuple[TensorRecord, list[TensorRecord]]:
        """Take ``name`` out of the catalog with its base pair; returns its record and the versions this made free:
        the current one unless a pin holds it (then readable through the pin until released), and the older one
        only the pair held."""
        with self._lock:
            pair = self._bases.pop(name, None)
            self._bases_used.pop(name, None)
            freed = self._free_locked(self._unhold_locked(pair)) if pair is not None else []
        if pair is not None:
            self._save_bases({}, [name])
            self._forget_held(freed)
        rec, free = self.remove(name)
        return rec, [rec, *freed] if free else freed

    def remove(self, name: str) -> tuple[TensorRecord, bool]:
        """Take ``name`` out of the catalog; returns its record and whether its version is free now (a pin or a base
        pair on it keeps it; `delete` drops the pair first)."""
        with self._lock:
            rec = self._tensors.pop(name, None)
            self._redeclared_locked(rec is not None)
            self._columns.clear(name)
            pinned = rec is not None and bool(self._holds[rec.name, rec.version])
            if pinned:
                self._keep_locked(rec)
        if rec is None:
            raise NotFoundError(f"no tensor named {name!r} to delete")
        if pinned:
            self._save_old([rec])
        return rec, not pinned

    def reconcile(self, host: str, held: Collection[tuple[str, int]]) -> list[TensorRecord]:
        """What the agent of ``host`` says it holds (tensor, version): every catalogued version it does not hold
        has lost its shards on ``host``'s devices, and every one it does hold has them back (an agent that came
        back after another registrant took its name for a while). Returns the current records that changed (the
        kept older versions that changed are saved here)."""
        held = set(held)

        def reconciled(rec: TensorRecord) -> TensorRecord | None:
            devices = {d for d in rec.sharding.mesh.require_devices() if host_of(d) == host}
            lost = (rec.lost - devices) if (rec.name, rec.version) in held else (rec.lost | devices)
            return replace(rec, lost=frozenset(lost)) if lost != rec.lost else None

        with self._lock:
            out = [r for r in map(reconciled, self._tensors.values()) if r is not None]
            old = [r for kept in self._old.values() for r in map(reconciled, kept.values()) if r is not None]
            for rec in out:
                self._tensors[rec.name] = rec
            self._redeclared_locked(bool(out))
            self._columns.set(out)
            for rec in old:
                self._keep_locked(rec)
        self._save_old(old)
        return out

    def load(self, records) -> None:
        records = list(records)
        with self._lock:
            for r in records:
                self._tensors[r.name] = r
            self._redeclared_locked(True)
            self._columns.set(records)

    # -- version numbers ------------------------------------------------------------------------------------------

    def _top_locked(self, name: str) -> int:
        """The highest version of ``name`` held, current or kept, or claimed by a job in flight (0: none)."""
        current = self._tensors.get(name)
        return max(current.version if current is not None else 0, self._columns.claimed(name),
                   max(self._old.get(name, {0: None})))

    def next_version(self, name: str) -> int:
        """The version an upload of ``name`` opened now would likely commit as (`publishing` decides)."""
        with self._lock:
            return self._top_locked(name) + 1

    def slots(self, names: list[str]) -> np.ndarray:
        """The slots of ``names`` in the catalog's columns (`Columns`): a name keeps its slot for the planner's
        life, so a registered sync works its tensors' out once."""
        with self._lock:
            return self._columns.of(names)

    def claim(self, names: list[str], slots: np.ndarray | None = None) -> dict[str, int]:
        """The version each of ``names`` (at ``slots``: `slots`, or worked out here) commits as in a job starting
        now (one job per name at a time: the job runner's locks); waits while an upload of one of them commits, so
        a job that reads a current version commits the version after it (the agents' rule for a job that commits
        several tensors)."""
        with self._changed:
            if slots is None:
                slots = self._columns.of(names)
            self._changed.wait_for(lambda: not self._columns.publishing[slots].any())
            # `_top_locked` of each, a column at a time: a state dict's job claims 139,583. A current version is
            # above every kept one (each numbers on from the highest), so where each name has one and no job in
            # flight claimed any, it is the top.
            current = list(map(self._tensors.get, names))
            claims = self._columns.claim[slots]
            if all(current) and not claims.any():
                versions = [r.version + 1 for r in current]
            else:
                kept = map(max, map(self._old.get, names, repeat(_NONE_KEPT)))
                versions = [max(r.version if r is not None else 0, c, k) + 1 for r, c, k in
                            zip(current, claims.tolist(), kept)]
            self._columns.claim[slots] = versions
        return dict(zip(names, versions))

    def claim_current(self, slots: np.ndarray, step: int | None = None, labeled: np.ndarray | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """`claim` of the names at ``slots`` (`slots`) where every one has a current version (labeled ``step``,
        where given, those ``labeled`` marks, default all: a block scale a job makes carries no label of its own
        publisher's) and none is claimed: each commits as its current version's next. Returns their current
        versions, sharding objects' ids and dtype ids as columns (`Columns`); else None, claiming nothing (the
        caller takes `claim`'s way, whose checks name what differs). A registered sync's job at 139,583 tensors
        claims them in a few array operations."""
        with self._changed:
            columns = self._columns
            self._changed.wait_for(lambda: not self._columns.publishing[slots].any())
            versions = columns.version[slots]
            if step is not None:
                steps = columns.step[slots] if labeled is None else columns.step[slots[labeled]]
                if not (steps == step).all():
                    return None
            if not versions.all() or columns.claim[slots].any():
                return None
            columns.claim[slots] = versions + 1
            return versions, columns.layout[slots], columns.dtype[slots]

    def dtype_ids(self, dtypes: list[str]) -> np.ndarray:
        """``dtypes`` as `claim_current` returns them."""
        with self._lock:
            return self._columns.dtype_ids(dtypes)

    def same_dtypes(self, slots: np.ndarray, dtype_ids: np.ndarray) -> bool:
        """Whether the names at ``slots`` each have a current version, in the dtype ``dtype_ids`` gives it
        (`dtype_ids`)."""
        with self._lock:
            return bool(self._columns.version[slots].all() and (self._columns.dtype[slots] == dtype_ids).all())

    def unclaim(self, names: list[str], slots: np.ndarray | None = None) -> None:
        """The job that claimed ``names`` (at ``slots``, where given) ended (its versions committed, or released on
        failure)."""
        with self._lock:
            self._columns.claim[self._columns.of(names) if slots is None else slots] = 0

    @contextmanager
    def publishing(self, names) -> Iterator[dict[str, int]]:
        """While an upload of ``names`` commits: the version each commits as, above any a job in flight claimed
        (whose commit then finds its source superseded, and fails); jobs starting meanwhile wait (`claim`)."""
        with self._lock:
            versions = {n: self._top_locked(n) + 1 for n in names}
            slots = self._columns.of(names)
            np.add.at(self._columns.publishing, slots, 1)
        try:
            yield versions
        finally:
            with self._changed:
                np.subtract.at(self._columns.publishing, slots, 1)
                self._changed.notify_all()

    # -- versions held and pins -----------------------------------------------------------------------------------

    def _held_locked(self, name: str) -> list[TensorRecord]:
        """Every version of ``name`` held, oldest first: the kept ones, then the current one."""
        kept = [r for _, r in sorted(self._old.get(name, {}).items())]
        current = self._tensors.get(name)
        return kept + ([current] if current is not None else [])

    def _labeled_locked(self, name: str, step: int) -> TensorRecord:
        """The newest held version of ``name`` labeled ``step`` (a reshard_many commits the label again)."""
        held = self._held_locked(name)
        for rec in reversed(held):
            if rec.step == step:
                return rec
        if not held:
            raise NotFoundError(f"no tensor named {name!r}")
        raise NotFoundError(f"tensor {name!r} holds no version labeled step {step}; it holds {held_text(held)} (a "
                            f"version is held while it is current, pinned or half of its delta base pair)")

    def pin(self, names: list[str] | None, step: int | None) -> PinRecord:
        """Hold, for each of ``names`` (None: every tensor in the catalog), its current version, or its version
        labeled ``step``; the pin is a lease, renewed by every read through it (`resolve`)."""
        with self._lock:
            if names is None:
                names = sorted(self._tensors)
                if not names:
                    raise NotFoundError("the catalog holds no tensor to pin")
            repeated = repeated_names(names)
            if repeated:
                raise InvalidArgumentError(f"pin names tensors {repeated[:5]} more than once; name each once")
            versions = {}
            for n in names:
                if step is None:
                    rec = self._tensors.get(n)
                    if rec is None:
                        shown = sorted(self._tensors)[:10]
                        raise NotFoundError(f"no tensor named {n!r} to pin; the catalog holds {shown}")
                else:
                    rec = self._labeled_locked(n, step)
                versions[n] = rec.version
            pin = PinRecord(uuid.uuid4().hex, versions, step)
            self._pins[pin.id] = pin
            self._used[pin.id] = self._clock()
            self._holds.update(versions.items())
        if self._store is not None:
            self._store.save_pin(pin.id, json.dumps(pin.to_json()))
        return pin

    def release_pin(self, pin_id: str) -> list[TensorRecord]:
        """Let go of pin ``pin_id`` (unknown: nothing to do, a release is idempotent); returns the versions this
        made free, for the caller to release on their agents."""
        return self._drop_pins([pin_id])

    def expired_pins(self) -> tuple[list[str], list[TensorRecord]]:
        """The pins unused for ``pin_timeout_s`` (a reader that died), dropped, and the versions that made free."""
        now = self._clock()
        with self._lock:
            gone = [p for p, used in self._used.items() if now - used > self.pin_timeout_s]
        return gone, self._drop_pins(gone)

    def _drop_pins(self, pin_ids: list[str]) -> list[TensorRecord]:
        freed = []
        with self._lock:
            dropped = [self._pins.pop(p) for p in pin_ids if p in self._pins]
            for pin in dropped:
                del self._used[pin.id]
                for key in pin.versions.items():
                    self._holds[key] -= 1
                    if self._holds[key] <= 0:
                        del self._holds[key]
                        rec = self._unkeep_locked(*key)
                        if rec is not None:
                            freed.append(rec)
        if self._store is not None:
            for pin in dropped:
                self._store.delete_pin(pin.id)
            self._store.delete_held_versions([(r.name, r.version) for r in freed])
        return freed

    def resolve(self, names: list[str], pin_id: str = "", step: int | None = None) -> list[TensorRecord]:
        """The records of ``names`` that a read names: the versions pin ``pin_id`` holds (and the read renews it),
        or the versions labeled ``step``, or (neither) the current ones; all at one instant."""
        if not pin_id and step is None:
            return self.snapshot(names)
        with self._lock:
            if pin_id:
                pin = self._pins.get(pin_id)
                if pin is None:
                    raise NotFoundError(f"pin {pin_id[:12]} is not held: it was released, or it expired after "
                                        f"{self.pin_timeout_s:g}s without a read (the planner's --pin-timeout-s); "
                                        f"pin again")
                self._used[pin_id] = self._clock()
                missing = [n for n in names if n not in pin.versions]
                if missing:
                    shown = sorted(pin.versions)[:10] + (["..."] if len(pin.versions) > 10 else [])
                    raise NotFoundError(f"pin {pin_id[:12]} holds no version of {missing[0]!r}; it holds {shown}; "
                                        f"pin that tensor too")
                out = []
                for n in names:
                    v = pin.versions[n]
                    current = self._tensors.get(n)
                    out.append(current if current is not None and current.version == v else self._old[n][v])
                return out
            return [self._labeled_locked(n, step) for n in names]

    def current_named(self, names: list[str], pin_id: str = "", step: int | None = None,
                      unnamed: Collection[str] = ()) -> list[TensorRecord]:
        """The current records of ``names``, each checked to be the version ``pin_id`` or ``step`` names: a job
        moves a tensor's current version (moving an older one would commit it over a newer one). Those of
        ``unnamed`` are read as they are (a block scale a job makes on the way: its publisher never pins or labels
        it)."""
        current = self.snapshot(names)
        if not pin_id and step is None:
            return current
        checked = [r for r in current if r.name not in unnamed] if unnamed else current
        named = self.resolve([r.name for r in checked], pin_id, step)
        for old, now in zip(named, checked):
            if old.version != now.version:
                what = f"pin {pin_id[:12]}" if pin_id else f"step {step}"
                raise FailedPreconditionError(
                    f"{what} names {old.name!r} v{old.version} ({label(old)}), but v{now.version} ({label(now)}) is "
                    f"current, and a reshard moves the current version; reshard the current one, or read the older "
                    f"one with get_many(version=...)")
        return current

    def versions(self, name: str) -> list[tuple[TensorRecord, int, bool]]:
        """Every version of ``name`` held, current last, each with the number of readers' pins on it and whether it
        is half of the name's delta base pair (whose hold is not a pin: no reader made it)."""
        with self._lock:
            held = self._held_locked(name)
            pair = self._bases.get(name)
            based = {pair.src, pair.dst} if pair is not None else set()
            out = [(r, self._holds[r.name, r.version] - (r.version in based), r.version in based) for r in held]
        if not out:
            raise NotFoundError(f"no tensor named {name!r} holds any version")
        return out

    # -- delta base pairs -----------------------------------------------------------------------------------------

    def bases(self, names) -> dict[str, tuple[BasePair, TensorRecord, TensorRecord]]:
        """Of ``names``, those with a base pair: name -> (the pair, its src version's record, its dst version's);
        a job that reads them renews them (they expire ``pin_timeout_s`` after their last use)."""
        now = self._clock()
        out = {}
        with self._lock:
            for n in names:
                pair = self._bases.get(n)
                if pair is None:
                    continue
                src, dst = self._held_version_locked(n, pair.src), self._held_version_locked(n, pair.dst)
                if src is not None and dst is not None:
                    out[n] = (pair, src, dst)
                    self._bases_used[n] = now
        return out

    def base_pairs(self) -> dict[str, BasePair]:
        """Every base pair held, by name."""
        with self._lock:
            return dict(self._bases)

    def expired_bases(self) -> tuple[list[str], list[TensorRecord]]:
        """The base pairs no job made or used for ``pin_timeout_s`` (their names), dropped, and the versions that
        made free (held by nothing else, and not current)."""
        now = self._clock()
        with self._lock:
            gone = sorted(n for n, used in self._bases_used.items() if now - used > self.pin_timeout_s)
            dropped = []
            for n in gone:
                del self._bases_used[n]
                dropped += self._unhold_locked(self._bases.pop(n))
            freed = self._free_locked(dropped)
        if gone:
            self._save_bases({}, gone)
            self._forget_held(freed)
        return gone, freed

    def _set_bases_locked(self, bases: dict[str, tuple[int, int]]) -> list[tuple[str, int]]:
        """Hold each new pair of ``bases``, then let go of the pairs they replace (in that order, so a version both
        hold stays held); returns the (name, version) keys whose last hold that was."""
        now = self._clock()
        # dict methods, not Counter's (its update and __delitem__ are Python): a weight sync sets a pair per tensor
        # every step, at its commit (501 pairs: 3.5 ms with them)
        pairs, used, holds = self._bases, self._bases_used, self._holds
        get = holds.get
        old = []
        for n, (src, dst) in bases.items():
            old.append(pairs.get(n))
            pairs[n] = BasePair(n, src, dst)
            used[n] = now
            holds[n, src] = get((n, src), 0) + 1
            holds[n, dst] = get((n, dst), 0) + 1
        return [key for pair in old if pair is not None for key in self._unhold_locked(pair)]

    def _unhold_locked(self, pair: BasePair) -> list[tuple[str, int]]:
        """Drop ``pair``'s holds; returns the keys that no longer have any."""
        out = []
        holds = self._holds
        for key in ((pair.name, pair.src), (pair.name, pair.dst)):
            left = holds.get(key, 0) - 1
            if left <= 0:
                holds.pop(key, None)
                out.append(key)
            else:
                holds[key] = left
        return out

    def _free_locked(self, keys: list[tuple[str, int]]) -> list[TensorRecord]:
        """The kept versions of ``keys`` (held by nothing now), no longer kept; a current one stays."""
        return [rec for key in keys if (rec := self._unkeep_locked(*key)) is not None]

    def _held_version_locked(self, name: str, version: int) -> TensorRecord | None:
        current = self._tensors.get(name)
        if current is not None and current.version == version:
            return current
        return self._old.get(name, {}).get(version)

    @property
    def _saving(self) -> bool:
        """Whether changes are written to a store a restarted planner reads back (`StateStore.durable`)."""
        return self._store is not None and self._store.durable

    def _save_bases(self, bases: dict[str, tuple[int, int]], dropped: list[str]) -> None:
        if not self._saving:
            return
        if bases:
            self._store.save_delta_bases([(n, json.dumps(BasePair(n, s, d).to_json())) for n, (s, d) in bases.items()])
        if dropped:
            self._store.delete_delta_bases(dropped)

    def _forget_held(self, freed: list[TensorRecord]) -> None:
        """Drop the saved copies of kept versions ``freed`` (a current version freed had none: harmless)."""
        if self._saving and freed:
            self._store.delete_held_versions([(r.name, r.version) for r in freed])

    def pins_on(self, rec: TensorRecord) -> int:
        with self._lock:
            return self._holds[rec.name, rec.version]

    def _keep_locked(self, rec: TensorRecord) -> None:
        self._old.setdefault(rec.name, {})[rec.version] = rec

    def _unkeep_locked(self, name: str, version: int) -> TensorRecord | None:
        kept = self._old.get(name)
        rec = kept.pop(version, None) if kept else None
        if kept is not None and not kept:
            del self._old[name]
        return rec

    def _save_old(self, records: list[TensorRecord]) -> None:
        if self._saving and records:
            self._store.save_held_versions([(r.name, r.version, r.json_text()) for r in records])


@dataclass
class Upload:
    id: str
    record: TensorRecord
    per_shard: bool
    done: set[str] = field(default_factory=set)
    last_activity: float = 0.0
    group: str = ""  # the put_many transaction (or the shared group, `Uploads.begin_group`) it belongs to, if any

    @property
    def devices(self) -> tuple[str, ...]:
        return self.record.sharding.mesh.require_devices()


class Uploads:
    def __init__(self, catalog: Catalog, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self._catalog = catalog
        self._timeout = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, Upload] = {}
        self._by_name: dict[str, Upload] = {}
        self._groups: dict[str, list[Upload]] = {}
        self._keys: dict[str, str] = {}  # a shared group's key -> its id, while it is open
        self._committing: set[str] = set()  # shared groups whose every device is in: one caller commits them
        # group id -> "" (committed) or why it failed, for the callers that wait on a shared group; the last few only
        self._outcomes: OrderedDict[str, str] = OrderedDict()
        self._settled = threading.Condition(self._lock)

    def _record(self, name: str, shape, dtype: str, sharding: Sharding, kind: str,
                step: int | None = None) -> TensorRecord:
        """The record an upload would commit; its version is the likely one (`Catalog.publishing` decides)."""
        check_name(name)
        shape = sharding.check_shape(normalise_shape(shape))
        dtype = dtype_name(dtype)
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind {kind!r} must be one of {list(KINDS)}")
        return TensorRecord(name, shape, dtype, sharding, self._catalog.next_version(name), kind,
                            step=check_step(step), content=new_content())

    def _pending_locked(self, rec: TensorRecord) -> Upload | None:
        """Refuse a new version of a catalogued name in another shape or dtype; returns the upload of that name
        in progress, if any."""
        if self._catalog.contains(rec.name):
            check_same_layout(self._catalog.get(rec.name), rec)
        return self._by_name.get(rec.name)

    def _busy(self, pending: Upload) -> AlreadyExistsError:
        return AlreadyExistsError(
            f"tensor {pending.record.name!r} is being uploaded (transaction {pending.id[:8]}); wait for it to finish "
            f"or for it to expire {self._timeout:g}s after its last activity"
        )

    def begin(self, name: str, shape, dtype: str, sharding: Sharding, kind: str, per_shard: bool,
              step: int | None = None) -> Upload:
        rec = self._record(name, shape, dtype, sharding, kind, step)
        with self._lock:
            pending = self._pending_locked(rec)
            if pending is not None:
                if per_shard and pending.per_shard:
                    self._check_same(pending.record, rec)
                    pending.last_activity = self._clock()
                    return pending
                raise self._busy(pending)
            up = Upload(uuid.uuid4().hex, rec, per_shard, last_activity=self._clock())
            self._by_id[up.id] = up
            self._by_name[name] = up
            return up

    def begin_group(self, tensors: list[tuple[str, tuple, str, Sharding, str]],
                    step: int | None = None, key: str = "") -> tuple[str, list[Upload]]:
        """Open an upload of every (name, shape, dtype, sharding, kind) as one group (put_many), each labeled
        ``step``: they commit together (`group`, then `Catalog.commit`) and expire together. Returns the group's
        id and its uploads.

        With a ``key`` the group is shared (the ranks of a DTensor publish): the first call opens it, and a call
        with the same key while it is open returns it, once its tensors are declared the same way (else
        InvalidArgumentError naming the first difference). Each caller then hands over its own devices' shards
        and marks them (`mark_group`)."""
        records = [self._record(*t, step) for t in tensors]
        names = [r.name for r in records]
        repeated = repeated_names(names)
        if repeated:
            raise InvalidArgumentError(f"put_many names tensors {repeated[:5]} more than once; each tensor once")
        with self._lock:
            if key and key in self._keys:
                group = self._keys[key]
                ups = self._groups[group]
                self._check_declared(key, [u.record for u in ups], records)
                ups[0].last_activity = self._clock()  # a group is active while any member is
                return group, ups
            for rec in records:
                pending = self._pending_locked(rec)
                if pending is not None:
                    raise self._busy(pending)
            group = uuid.uuid4().hex
            now = self._clock()
            ups = [Upload(uuid.uuid4().hex, r, bool(key), last_activity=now, group=group) for r in records]
            for up in ups:
                self._by_id[up.id] = up
                self._by_name[up.record.name] = up
            self._groups[group] = ups
            if key:
                self._keys[key] = group
            return group, ups

    @staticmethod
    def _check_declared(key: str, opened: list[TensorRecord], records: list[TensorRecord]) -> None:
        """Refuse a caller of shared group ``key`` whose tensors differ from those it was opened with, naming the
        first difference: the ranks of one publish must describe one state dict."""
        way_out = "every rank of a publish declares the same tensors, in the same order, with the same step"
        if [r.name for r in opened] != [r.name for r in records]:
            i = next((i for i, (a, b) in enumerate(zip(opened, records)) if a.name != b.name),
                     min(len(opened), len(records)))
            here = repr(records[i].name) if i < len(records) else "nothing"
            there = repr(opened[i].name) if i < len(opened) else "nothing"
            raise InvalidArgumentError(
                f"upload group {key[:8]} was opened with {len(opened)} tensors and this caller declares "
                f"{len(records)}: tensor {i} is {here} here but {there} in the group; {way_out}")
        for a, b in zip(opened, records):
            for what in ("shape", "dtype", "sharding", "kind", "step"):
                if getattr(a, what) != getattr(b, what):
                    raise InvalidArgumentError(
                        f"upload group {key[:8]}: tensor {a.name!r} is declared with {what} {getattr(b, what)} here "
                        f"but {getattr(a, what)} in the group; {way_out}")

    def group(self, group: str) -> list[Upload]:
        with self._lock:
            ups = self._groups.get(group)
        if ups is None:
            raise NotFoundError(f"no upload group {group!r} open; it finished, failed or expired")
        return ups

    def is_shared(self, group: str) -> bool:
        """Whether ``group`` was opened by a key (its callers mark their devices) rather than by one put_many; a
        shared group that ended, whose outcome is kept, still is."""
        with self._lock:
            ups = self._groups.get(group)
            if ups is None and group in self._outcomes:
                return True
        if ups is None:
            raise NotFoundError(f"no upload group {group!r} open; it finished, failed or expired")
        return ups[0].per_shard

    def missing(self, group: str) -> list[str]:
        """The devices of open ``group`` whose shards are not in yet (none once it ended)."""
        with self._lock:
            return sorted({d for u in self._groups.get(group, ()) for d in u.devices if d not in u.done})

    def mark_group(self, group: str, done: list[tuple[str, list[str]]]) -> tuple[list[Upload], bool, list[str]]:
        """Record, for shared ``group``, the devices of each (upload id, devices) whose shards are in. Returns its
        uploads, whether this call is the one to commit it (every device of every tensor is in; only one call is),
        and the devices still missing."""
        with self._lock:
            ups = self._groups.get(group)
            if ups is None:
                raise NotFoundError(f"no upload group {group!r} open; it finished, failed or expired")
            by_id = {u.id: u for u in ups}
            for upload_id, devices in done:
                up = by_id.get(upload_id)
                if up is None:
                    raise InvalidArgumentError(f"upload {upload_id[:8]} is not one of group {group[:8]}'s "
                                               f"{len(ups)} uploads; mark the uploads BeginUploads returned")
                unknown = [d for d in devices if d not in up.devices]
                if unknown:
                    raise InvalidArgumentError(f"devices {unknown} are not in the mesh of {up.record.name!r}; its "
                                               f"devices are {list(up.devices)}")
            for upload_id, devices in done:
                by_id[upload_id].done.update(devices)
            ups[0].last_activity = self._clock()
            missing = sorted({d for u in ups for d in u.devices if d not in u.done})
            commit = not missing and group not in self._committing
            if commit:
                self._committing.add(group)
            return ups, commit, missing

    def close_group(self, group: str, error: str = "") -> None:
        """End ``group``: its uploads close, and a shared one's outcome (``error``, "" when it committed) is kept
        for the callers that wait for it (`outcome`)."""
        with self._settled:
            ups = self._groups.pop(group, [])
            self._settle_locked(group, ups, error)
        for up in ups:
            self.close(up.id)

    def _settle_locked(self, group: str, ups: list[Upload], error: str) -> None:
        if not ups or not ups[0].per_shard:
            return
        self._committing.discard(group)
        for key in [k for k, g in self._keys.items() if g == group]:  # one; few groups are open at once
            del self._keys[key]
        self._outcomes[group] = error
        while len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        self._settled.notify_all()

    def outcome(self, group: str, wait_s: float = 0.0) -> str | None:
        """How shared ``group`` ended: "" (committed) or why it failed; None while it is still open after waiting up
        to ``wait_s`` seconds."""
        with self._settled:
            self._settled.wait_for(lambda: group not in self._groups, timeout=wait_s)
            if group in self._groups:
                return None
            if group not in self._outcomes:
                raise NotFoundError(f"no upload group {group!r}: it ended too long ago to tell how (the planner keeps "
                                    f"the last {OUTCOMES_KEPT} outcomes), or it never existed")
            return self._outcomes[group]

    @staticmethod
    def _check_same(old: TensorRecord, new: TensorRecord) -> None:
        for what in ("shape", "dtype", "sharding", "step"):
            a, b = getattr(old, what), getattr(new, what)
            if a != b:
                raise InvalidArgumentError(
                    f"put_shard of {old.name!r} gives {what} {b} but earlier shards gave {a}; "
                    f"every rank must describe the same tensor"
                )

    def get(self, id: str) -> Upload:
        with self._lock:
            up = self._by_id.get(id)
        if up is None:
            raise NotFoundError(f"no upload transaction {id!r}; it finished, failed or expired")
        return up

    def mark(self, id: str, devices) -> tuple[Upload, bool]:
        """Record uploaded devices; returns the upload and whether every device now has its shard."""
        up = self.get(id)
        if up.group:
            raise FailedPreconditionError(
                f"upload {id[:8]} of {up.record.name!r} belongs to put_many transaction {up.group[:8]}, whose tensors "
                f"enter the catalog together: finish them with FinishUploads, not one by one")
        devices = list(devices)
        unknown = [d for d in devices if d not in up.devices]
        if unknown:
            raise InvalidArgumentError(
                f"devices {unknown} are not in the mesh of {up.record.name!r}; its devices are {list(up.devices)}"
            )
        with self._lock:
            up.done.update(devices)
            up.last_activity = self._clock()
            return up, len(up.done) == len(up.devices)

    def touch(self, ids) -> None:
        """Count uploads whose bytes are still streaming into an agent as active (unknown ones are ignored:
        they finished or expired)."""
        with self._lock:
            now = self._clock()
            for id in ids:
                up = self._by_id.get(id)
                if up is not None:
                    up.last_activity = now

    def close(self, id: str) -> None:
        with self._lock:
            up = self._by_id.pop(id, None)
            if up is not None and self._by_name.get(up.record.name) is up:
                del self._by_name[up.record.name]

    def expired(self) -> list[Upload]:
        """Uploads idle for the timeout, closed; a group's members count as active while any of them is. A shared
        group's callers that wait learn it expired, and which devices never came (`outcome`)."""
        now = self._clock()
        with self._settled:
            latest = {g: max(u.last_activity for u in ups) for g, ups in self._groups.items()}
            out = [u for u in self._by_id.values()
                   if now - (latest.get(u.group, 0.0) if u.group else u.last_activity) > self._timeout]
            for g in {u.group for u in out if u.group}:
                ups = self._groups.pop(g)
                missing = sorted({d for u in ups for d in u.devices if d not in u.done})
                shown = missing[:8] + (["..."] if len(missing) > 8 else [])
                self._settle_locked(g, ups, (
                    f"upload group {g[:8]} of {len(ups)} tensors expired after {self._timeout:g}s without activity, "
                    f"before devices {shown} handed over their shards (did a rank die midway?); nothing of it was "
                    f"committed: publish again from every rank"))
        for u in out:
            self.close(u.id)
        return out


def bumped(rec: TensorRecord, sharding: Sharding, version: int | None = None) -> TensorRecord:
    """``rec``'s next version (``version``, default the one after it), held in ``sharding`` with nothing lost and
    ``rec``'s step label and content id (built directly: `dataclasses.replace` took a millisecond of every state
    dict's job). A move between a pending sum and values stores other numbers: it gets a fresh content id."""
    same = rec.sharding.is_partial == sharding.is_partial
    return TensorRecord(rec.name, rec.shape, rec.dtype, sharding, rec.version + 1 if version is None else version,
                        rec.kind, step=rec.step, content=rec.content if same else new_content())
