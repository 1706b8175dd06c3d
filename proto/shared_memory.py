"""Shared-memory segments between a client and an agent of one machine: the SDK's host path when no CUDA IPC applies.

A client on an agent's machine puts and reads shards through a segment instead of a byte stream: it makes a file
``/dev/shm/reshard-sdk-<pid namespace>-<pid>-<32 hex digits>`` (mode 0600, created exclusively, never followed
through a link), writes the shard's bytes into it (a CUDA tensor straight from the GPU) and names the region in one call; the agent
maps the file by that name and copies the bytes into its tile (reads run the other way round). Both ends keep their
mappings for the next call (`SegmentPool`, `Opened`): a training loop puts the same shapes every step, and a fresh
segment pays a page fault per page. Where CUDA is at hand, a segment a GPU copy uses is pinned once
(``cudaHostRegister``), so the copy to or from the GPU runs at the DMA engine's rate instead of through a pageable
bounce buffer.

The agent opens only names of this form, only regular files of its own user (or any user when it runs as root), and
only within the file's size. The client unlinks its files when it drops them, and removes files that clients of its
user left behind when they died (their pid is gone from the same pid namespace).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from typing import Optional

import numpy as np

from reshard.proto.errors import FailedPreconditionError, InvalidArgumentError

__all__ = ["SHM_DIR", "MIN_BYTES", "Segment", "SegmentPool", "Opened", "name_ok"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MIN_BYTES = 1 << 20  # smaller shards stream: a call costs less than a segment's set-up
_PREFIX = "reshard-sdk-"
_NAME = re.compile(r"^reshard-sdk-(\d+)-(\d+)-[0-9a-f]{32}$")


def name_ok(name: str) -> bool:
    """Whether ``name`` is a segment name this module makes (no path, no other file)."""
    return bool(_NAME.match(name))


class Segment:
    """One mapped segment: ``nbytes`` of shared memory, ``array`` its bytes as a uint8 numpy array."""

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, owner: bool):
        self.name, self.nbytes, self.owner = name, nbytes, owner
        self._mm = mm
        self.array = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self._pinned: Optional[bool] = None  # None: not tried

    @classmethod
    def create(cls, nbytes: int) -> "Segment":
        name = f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(16)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, owner=True)

    @classmethod
    def open(cls, name: str, end: int) -> "Segment":
        """Map the segment ``name`` of another process of this machine, which must hold at least ``end`` bytes."""
        if not name_ok(name):
            raise InvalidArgumentError(f"shared-memory segment {name!r}: not a name reshard makes "
                                       f"({_PREFIX}<pid namespace>-<pid>-<32 hex digits>)")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise FailedPreconditionError(f"shared-memory segment {path} cannot be opened here ({e.strerror}): the "
                                          f"client and this agent share no /dev/shm, or run as different users")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (os.getuid() != 0 and st.st_uid != os.getuid()):
                raise FailedPreconditionError(f"shared-memory segment {path} is not a regular file of this agent's "
                                              f"user (uid {os.getuid()})")
            if st.st_size < end:
                raise InvalidArgumentError(f"shared-memory segment {path} holds {st.st_size} bytes; the region asked "
                                           f"for ends at byte {end}")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        return cls(name, st.st_size, mm, owner=False)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidArgumentError(f"shared-memory segment {self.name}: bytes {offset}..{offset + nbytes} are "
                                       f"outside its {self.nbytes}")
        return self.array[offset:offset + nbytes]

    def pin(self) -> bool:
        """Page-lock the segment for CUDA copies (once; the result is kept). False where CUDA refuses: copies then
        go through CUDA's pageable path, slower but the same bytes."""
        if self._pinned is None:
            self._pinned = False
            try:
                import torch

                if torch.cuda.is_available():
                    err = torch.cuda.cudart().cudaHostRegister(self.array.ctypes.data, self.nbytes, 0)
                    self._pinned = int(getattr(err, "value", err)) == 0
                    if not self._pinned:
                        log.info("cudaHostRegister of %d bytes refused (%s): copies of segment %s are pageable",
                                 self.nbytes, err, self.name)
            except Exception as e:  # noqa: BLE001 - no torch, no CUDA, an old cudart binding: stay pageable
                log.info("shared-memory segment %s stays pageable: %s", self.name, e)
        return self._pinned

    def close(self) -> None:
        """Unpin and unmap; the owner also removes the file. Views still held keep the memory mapped until freed."""
        if self._pinned:
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            except Exception:  # noqa: BLE001 - best effort: the mapping goes away with the process anyway
                pass
            self._pinned = False
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view: the mapping goes when the last one does
            pass


class SegmentPool:
    """A client's segments, reused call after call: ``take`` lends one of at least the bytes asked for (a free one
    at most twice as large, else a new one), ``give`` takes it back. Free segments beyond ``keep_bytes`` in all are
    dropped, the least recently used first."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: list[Segment] = []  # least recently given back first
        _remove_orphans()

    def take(self, nbytes: int) -> Segment:
        with self._lock:
            fits = [s for s in self._free if nbytes <= s.nbytes <= 2 * max(nbytes, MIN_BYTES)]
            if fits:
                best = min(fits, key=lambda s: s.nbytes)
                self._free.remove(best)
                return best
        return Segment.create(max(nbytes, 1))

    def give(self, segment: Segment) -> None:
        with self._lock:
            self._free.append(segment)
            total = sum(s.nbytes for s in self._free)
            while total > self.keep_bytes and self._free:
                old = self._free.pop(0)
                total -= old.nbytes
                old.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for s in free:
            s.close()


class Opened:
    """An agent's mappings of clients' segments by name: the least recently used is unmapped past ``keep`` of them
    or ``keep_bytes`` in all. A segment whose file was removed stays usable while mapped here."""

    def __init__(self, keep: int, keep_bytes: int):
        self.keep, self.keep_bytes = keep, keep_bytes
        self._lock = threading.Lock()
        self._open: OrderedDict[str, Segment] = OrderedDict()

    def get(self, name: str, end: int) -> Segment:
        with self._lock:
            seg = self._open.get(name)
            if seg is not None and seg.nbytes >= end:
                self._open.move_to_end(name)
                return seg
        seg = Segment.open(name, end)
        with self._lock:
            old = self._open.pop(name, None)
            self._open[name] = seg
            total = sum(s.nbytes for s in self._open.values())
            while len(self._open) > 1 and (len(self._open) > self.keep or total > self.keep_bytes):
                _, dropped = self._open.popitem(last=False)
                total -= dropped.nbytes
                dropped.close()
        if old is not None:
            old.close()
        return seg

    def clear(self) -> None:
        with self._lock:
            segs, self._open = list(self._open.values()), OrderedDict()
        for s in segs:
            s.close()


def _remove_orphans() -> None:
    """Remove segments of this user whose client process is gone (it died before unlinking them). Only those made
    in this pid namespace: a pid seen from another container means nothing here."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    here = _pid_namespace()
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(1)) != here or _alive(int(m.group(2))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                log.info("removed %s, left by client process %s, which is gone", path, m.group(2))
        except OSError:
            pass


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
