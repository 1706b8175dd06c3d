"""The planner's catalog of tensors, and the uploads that may add to it.

A tensor enters the catalog only when every device of its sharding holds its
shard: an upload is a transaction that commits whole or leaves nothing. An
upload that goes quiet for ``upload_timeout_s`` (a client that died midway) is
expired and its staged shards dropped. Uploads opened as a group (put_many)
commit together, entering the catalog in one step (`Catalog.commit`), and
expire together, once no member has been active for the timeout.

A tensor also records the devices whose shards are gone (``lost``): those of a
host whose agent restarted, as a new process holds nothing of the old one's. A
tile whose every copy is lost makes the tensor lost: reads raise a data-loss
error naming the tiles, and reshards are refused (see `Planner.reshard`); a
new version (a reshard, or a delete and a new upload) starts with nothing lost.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from reshard.box import Box, volume
from reshard.dtypes import dtype_name
from reshard.jsonio import quoted
from reshard.mesh import host_of
from reshard.proto.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from reshard.sharding import Sharding, normalise_shape

__all__ = ["TensorRecord", "Catalog", "Upload", "Uploads", "repeated_names"]

KINDS = ("numpy", "torch")


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding
    version: int
    kind: str = "numpy"
    lost: frozenset[str] = frozenset()  # devices whose shard of this version is gone with their agent

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "sharding": self.sharding.to_json(), "version": self.version, "kind": self.kind,
                "lost": sorted(self.lost)}

    def json_text(self) -> str:
        """``json.dumps(self.to_json())``, with the sharding's part written once per sharding: a state dict's job
        saves hundreds of records that share a few layouts; the strings are written by `jsonio.quoted`."""
        lost = ", ".join(map(quoted, sorted(self.lost)))
        return (f'{{"name": {quoted(self.name)}, "shape": [{", ".join(map(str, self.shape))}], '
                f'"dtype": {quoted(self.dtype)}, "sharding": {self.sharding.json_text()}, '
                f'"version": {self.version}, "kind": {quoted(self.kind)}, "lost": [{lost}]}}')

    @classmethod
    def from_json(cls, data: dict) -> "TensorRecord":
        return cls(data["name"], tuple(data["shape"]), data["dtype"], Sharding.from_json(data["sharding"]),
                   int(data["version"]), data.get("kind", "numpy"), frozenset(data.get("lost", ())))

    def lost_tiles(self) -> dict[Box, list[str]]:
        """The non-empty tiles whose every copy is lost, with the devices that held them."""
        if not self.lost:
            return {}
        holders: dict[Box, list[str]] = {}
        for dev, tile in self.sharding.tiles(self.shape).items():
            if volume(tile):
                holders.setdefault(tile, []).append(dev)
        return {tile: devs for tile, devs in holders.items() if self.lost.issuperset(devs)}


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
        raise InvalidArgumentError(f"tensor name {name!r} must be 1 to 256 printable characters")
    return name


def repeated_names(names: list[str]) -> list[str]:
    """The names that appear more than once in ``names``, sorted: in linear time, as a state dict of ten thousand
    tensors is one request (counting each name's copies took 1.7 s there)."""
    return sorted(n for n, k in Counter(names).items() if k > 1)


class Catalog:
    def __init__(self):
        self._lock = threading.Lock()
        self._tensors: dict[str, TensorRecord] = {}

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

    def commit(self, changes: list[tuple[TensorRecord | None, TensorRecord]]) -> None:
        """Make every new record current at once, or none: the commit point of a job (one tensor, or many in a
        reshard_many) and of an upload (one tensor, or a put_many). Each old record must still be current, and
        a name without one must be free."""
        with self._lock:
            for old, new in changes:
                current = self._tensors.get(new.name)
                if old is None and current is not None:
                    raise AlreadyExistsError(f"tensor name {new.name!r} is taken; delete it first or pick another "
                                             f"name")
                if old is not None and current != old:
                    raise NotFoundError(f"tensor {old.name!r} v{old.version} changed or was deleted during the "
                                        f"reshard")
            for _, new in changes:
                self._tensors[new.name] = new

    def snapshot(self, names) -> list[TensorRecord]:
        """The records of ``names`` as they are at one instant (no commit between two of them)."""
        with self._lock:
            records = [self._tensors.get(n) for n in names]
            missing = [n for n, r in zip(names, records) if r is None]
            held = sorted(self._tensors) if missing else []
        if missing:
            shown = held[:10] + (["..."] if len(held) > 10 else [])
            raise NotFoundError(f"no tensor named {missing[0]!r}"
                                f"{f' (nor {len(missing) - 1} more of those asked for)' if len(missing) > 1 else ''}; "
                                f"the catalog holds {shown}")
        return records

    def remove(self, name: str) -> TensorRecord:
        with self._lock:
            rec = self._tensors.pop(name, None)
        if rec is None:
            raise NotFoundError(f"no tensor named {name!r} to delete")
        return rec

    def reconcile(self, host: str, held: Collection[tuple[str, int]]) -> list[TensorRecord]:
        """What the agent of ``host`` says it holds (tensor, version): every catalogued version it does not hold
        has lost its shards on ``host``'s devices, and every one it does hold has them back (an agent that came
        back after another registrant took its name for a while). Returns the records that changed."""
        held = set(held)
        out = []
        with self._lock:
            for rec in self._tensors.values():
                devices = {d for d in rec.sharding.mesh.require_devices() if host_of(d) == host}
                lost = (rec.lost - devices) if (rec.name, rec.version) in held else (rec.lost | devices)
                if lost != rec.lost:
                    out.append(replace(rec, lost=frozenset(lost)))
            for rec in out:
                self._tensors[rec.name] = rec
        return out

    def load(self, records) -> None:
        with self._lock:
            for r in records:
                self._tensors[r.name] = r


@dataclass
class Upload:
    id: str
    record: TensorRecord
    per_shard: bool
    done: set[str] = field(default_factory=set)
    last_activity: float = 0.0
    group: str = ""  # the put_many transaction it belongs to, if any

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

    @staticmethod
    def _record(name: str, shape, dtype: str, sharding: Sharding, kind: str) -> TensorRecord:
        check_name(name)
        shape = sharding.check_shape(normalise_shape(shape))
        dtype = dtype_name(dtype)
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind {kind!r} must be one of {list(KINDS)}")
        return TensorRecord(name, shape, dtype, sharding, 1, kind)

    def _check_free_locked(self, name: str) -> Upload | None:
        """Raise if ``name`` is catalogued; returns the upload of that name in progress, if any."""
        if self._catalog.contains(name):
            raise AlreadyExistsError(f"tensor name {name!r} is taken; delete it first or pick another name")
        return self._by_name.get(name)

    def _busy(self, pending: Upload) -> AlreadyExistsError:
        return AlreadyExistsError(
            f"tensor {pending.record.name!r} is being uploaded (transaction {pending.id[:8]}); wait for it to finish "
            f"or for it to expire {self._timeout:g}s after its last activity"
        )

    def begin(self, name: str, shape, dtype: str, sharding: Sharding, kind: str, per_shard: bool) -> Upload:
        rec = self._record(name, shape, dtype, sharding, kind)
        with self._lock:
            pending = self._check_free_locked(name)
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

    def begin_group(self, tensors: list[tuple[str, tuple, str, Sharding, str]]) -> tuple[str, list[Upload]]:
        """Open an upload of every (name, shape, dtype, sharding, kind) as one group (put_many): they commit
        together (`group`, then `Catalog.commit`) and expire together. Returns the group's id and its uploads."""
        records = [self._record(*t) for t in tensors]
        names = [r.name for r in records]
        repeated = repeated_names(names)
        if repeated:
            raise InvalidArgumentError(f"put_many names tensors {repeated[:5]} more than once; each tensor once")
        with self._lock:
            for name in names:
                pending = self._check_free_locked(name)
                if pending is not None:
                    raise self._busy(pending)
            group = uuid.uuid4().hex
            now = self._clock()
            ups = [Upload(uuid.uuid4().hex, r, False, last_activity=now, group=group) for r in records]
            for up in ups:
                self._by_id[up.id] = up
                self._by_name[up.record.name] = up
            self._groups[group] = ups
            return group, ups

    def group(self, group: str) -> list[Upload]:
        with self._lock:
            ups = self._groups.get(group)
        if ups is None:
            raise NotFoundError(f"no put_many transaction {group!r}; it finished, failed or expired")
        return ups

    def close_group(self, group: str) -> None:
        with self._lock:
            ups = self._groups.pop(group, [])
        for up in ups:
            self.close(up.id)

    @staticmethod
    def _check_same(old: TensorRecord, new: TensorRecord) -> None:
        for what in ("shape", "dtype", "sharding"):
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
        """Uploads idle for the timeout, closed; a group's members count as active while any of them is."""
        now = self._clock()
        with self._lock:
            latest = {g: max(u.last_activity for u in ups) for g, ups in self._groups.items()}
            out = [u for u in self._by_id.values()
                   if now - (latest.get(u.group, 0.0) if u.group else u.last_activity) > self._timeout]
            for g in {u.group for u in out if u.group}:
                del self._groups[g]
        for u in out:
            self.close(u.id)
        return out


def bumped(rec: TensorRecord, sharding: Sharding) -> TensorRecord:
    """``rec``'s next version, held in ``sharding`` with nothing lost (built directly: `dataclasses.replace` took
    a millisecond of every state dict's job)."""
    return TensorRecord(rec.name, rec.shape, rec.dtype, sharding, rec.version + 1, rec.kind)
