"""Drawing helpers the dashboard's inline SVG shares: a stable colour per key, short labels, an arrowhead."""

from __future__ import annotations

import colorsys
import hashlib

__all__ = ["colour", "shorten", "arrow_marker"]


def colour(key: str) -> str:
    """A light colour that is the same for the same key on every page (tiles, hosts, tensors, groups)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:6], 16) / 0xFFFFFF
    r, g, b = colorsys.hls_to_rgb(h, 0.72, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def shorten(text: str, limit: int = 16) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def arrow_marker(marker_id: str) -> str:
    """A ``<defs>`` block with an arrowhead that lines refer to as ``marker-end="url(#marker_id)"``.

    Several SVGs share one page, so each names its own marker."""
    return (f'<defs><marker id="{marker_id}" markerWidth="8" markerHeight="8" refX="7" refY="3" orient="auto">'
            f'<path d="M0,0 L7,3 L0,6 z" fill="#555"/></marker></defs>')
