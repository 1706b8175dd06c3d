"""Byte counts as people write them: ``--memory-limit 4GiB`` in, ``4.0 GiB`` out.

Both ends of a memory-limit refusal speak them: the agent that refuses an
allocation and the planner that refuses a request before any agent is called.

=========  ======================  ===================================
suffix     meaning                 example
=========  ======================  ===================================
(none)     bytes                   ``1048576``
Ki Mi ..   powers of 1024          ``512Mi``, ``512MiB``, ``4GiB``
K M G T    powers of 1000          ``4G`` (as Kubernetes reads it)
=========  ======================  ===================================
"""

from __future__ import annotations

import re

__all__ = ["parse_size", "format_size"]

_UNITS = "KMGTPE"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(?:([KMGTPE])(i?))?B?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: a whole number of bytes, or a number with a unit (see the module)."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"size {text!r} is not a byte count like 1048576, 512MiB, 4GiB or 4G")
    number, unit, binary = m.groups()
    scale = (1024 if binary else 1000) ** (_UNITS.index(unit.upper()) + 1) if unit else 1
    return int(float(number) * scale) if "." in number else int(number) * scale


def format_size(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps the number at 1 or more: ``4.0 GiB``, ``17 B``."""
    n, unit = float(nbytes), ""
    for u in _UNITS:
        if n < 1024:
            break
        n, unit = n / 1024, u
    return f"{n:.1f} {unit}iB" if unit else f"{int(nbytes)} B"
