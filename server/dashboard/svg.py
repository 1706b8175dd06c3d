"""Drawing helpers the dashboard's inline SVG shares: a stable colour per key, distinct colours for the keys of one
picture, short labels, an arrowhead."""

from __future__ import annotations

import colorsys
import hashlib

__all__ = ["colour", "Palette", "shorten", "arrow_marker"]

# ColorBrewer's Set3 less its grey (which reads as "nothing here"): light colours that stay apart from each
# other and under black text.
_DISTINCT = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5", "#bc80bd",
             "#ccebc5", "#ffed6f")


def colour(key: str) -> str:
    """A light colour that is the same for the same key on every page (tiles, hosts, tensors, groups)."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:6], 16) / 0xFFFFFF
    r, g, b = colorsys.hls_to_rgb(h, 0.72, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


class Palette:
    """Colours for the keys of one picture, each new key the next of eleven distinct colours, then hues a golden
    angle apart: two tiles side by side never get near-equal colours, as hashed colours can."""

    def __init__(self):
        self._given: dict[str, str] = {}

    def __getitem__(self, key: str) -> str:
        if key not in self._given:
            n = len(self._given)
            if n < len(_DISTINCT):
                self._given[key] = _DISTINCT[n]
            else:
                r, g, b = colorsys.hls_to_rgb((n * 0.618034) % 1.0, 0.78 if n % 2 else 0.66, 0.6)
                self._given[key] = f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"
        return self._given[key]


def shorten(text: str, limit: int = 16) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def arrow_marker(marker_id: str) -> str:
    """A ``<defs>`` block with an arrowhead that lines refer to as ``marker-end="url(#marker_id)"``.

    Several SVGs share one page, so each names its own marker."""
    return (f'<defs><marker id="{marker_id}" markerWidth="8" markerHeight="8" refX="7" refY="3" orient="auto">'
            f'<path d="M0,0 L7,3 L0,6 z" fill="#555"/></marker></defs>')
