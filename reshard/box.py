"""Boxes: axis-aligned regions of a tensor, ``((lo, hi), ...)`` per dim, half-open."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["volume", "volumes", "intersect", "contains", "uncovered", "to_slices", "chunk", "split", "box_str"]

Box = tuple[tuple[int, int], ...]


def volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def volumes(lo: np.ndarray, hi: np.ndarray, itemsize: int = 1) -> np.ndarray:
    """Per row, the element count of the box ``lo:hi`` (arrays of rows of bounds) times ``itemsize``: int64, or
    Python ints in an object array where a product could pass 2**62 (Python counts exactly; so must columns)."""
    if not len(lo):
        return np.zeros(0, dtype=np.int64)
    widest = math.prod(int(w) for w in (hi - lo).max(axis=0)) * itemsize
    if widest < 2**62:
        return np.prod(hi - lo, axis=1, dtype=np.int64) * itemsize
    return np.prod((hi - lo).astype(object), axis=1) * itemsize


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or None when it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def uncovered(box: Box, pieces) -> list[Box]:
    """The parts of ``box`` that no box of ``pieces`` covers, as disjoint non-empty boxes."""
    left = [box] if volume(box) else []
    for p in pieces:
        rest = []
        for b in left:
            if intersect(b, p) is None:
                rest.append(b)
                continue
            # Peel off the slabs of b below and above p, dim by dim; what remains lies inside p.
            core = list(b)
            for d, ((lo, hi), (plo, phi)) in enumerate(zip(b, p)):
                for a, z in ((lo, plo), (phi, hi)):
                    if a < z:
                        rest.append(tuple(core[:d]) + ((max(a, lo), min(z, hi)),) + tuple(core[d + 1:]))
                core[d] = (max(lo, plo), min(hi, phi))
        left = rest
        if not left:
            break
    return left


def to_slices(box: Box, origin: Optional[Box] = None) -> tuple:
    """numpy slices selecting ``box``, relative to ``origin``'s corner when given. A scalar's box ``()`` selects
    with ``...``, which gives a view of a 0-d array where ``()`` would give its value."""
    if not box:
        return (Ellipsis,)
    if origin is None:
        return tuple(slice(lo, hi) for lo, hi in box)
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(box, origin))


def chunk(box: Box, parts: int, dim: int) -> list[Box]:
    """Cut ``box`` into ``parts`` pieces along ``dim``, ``torch.chunk`` style.

    Every piece but the trailing ones is ceil(length / parts) long; empty pieces
    are kept so that piece ``i`` always belongs to part ``i``.
    """
    lo, hi = box[dim]
    c = -(-(hi - lo) // parts)
    out = []
    for i in range(parts):
        a, b = min(lo + i * c, hi), min(lo + (i + 1) * c, hi)
        out.append(box[:dim] + ((a, b),) + box[dim + 1:])
    return out


def split(box: Box, parts: int) -> list[Box]:
    """Cut ``box`` into ``parts`` pieces along one dim, `chunk` style.

    The first dim at least ``parts`` long is cut, so pieces stay contiguous in
    row-major memory where possible; otherwise the longest dim.
    """
    lengths = [hi - lo for lo, hi in box]
    dim = next((d for d, n in enumerate(lengths) if n >= parts), None)
    if dim is None:
        dim = max(range(len(box)), key=lambda d: lengths[d])
    return chunk(box, parts, dim)


def box_str(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"
