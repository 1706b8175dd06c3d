"""What the plan page shows, computed from a `reshard.Plan`: plain data, then inline SVG.

The page answers "why is this plan fast or slow": the two meshes coloured by the
tile each device holds, a host-by-host matrix of network bytes, every host's NIC
send and receive time against the lower bound, and the broadcast chains.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from html import escape
from typing import Optional

from reshard import Plan, Sharding
from reshard.box import box_str
from reshard.cost import NIC, HostCache, phase_loads, transfer_flows
from reshard.mesh import host_of
from reshard.server.common.sizes import format_size
from reshard.server.dashboard.svg import Palette, arrow_marker, colour, shorten

__all__ = ["PlanView", "plan_view"]


@dataclass(frozen=True)
class PlanView:
    plan: Plan
    host_matrix: dict[tuple[str, str], int]
    hosts: list[str]
    nic_send_s: dict[str, float]
    nic_recv_s: dict[str, float]
    chains: list[tuple[str, tuple[str, ...], int]]
    measured_seconds: Optional[float]

    @property
    def estimate(self) -> float:
        return self.plan.estimate_seconds

    @property
    def lower_bound(self) -> float:
        return self.plan.lower_bound_seconds

    @property
    def nic_rates(self) -> str:
        """The NIC rates (Gbit/s) the plan's hosts have in its topology, each once: ``10`` or ``10, 25``."""
        return ", ".join(f"{r:g}" for r in sorted({self.plan.topology.nic_bytes_per_s(h) * 8 / 1e9
                                                   for h in self.hosts}))

    @property
    def measured_ratio(self) -> Optional[float]:
        """Measured seconds over the estimate: 1 is the cost model's prediction, above 1 slower."""
        return self.measured_seconds / self.estimate if self.measured_seconds and self.estimate else None

    # -- svg ----------------------------------------------------------------------------

    def mesh_svg(self, which: str) -> str:
        return _mesh_svg(self.plan.src if which == "src" else self.plan.dst, self.plan.shape, which,
                         _tile_colours(self.plan))

    def heatmap_svg(self) -> str:
        return _heatmap_svg(self.hosts, self.host_matrix)

    def nic_svg(self) -> str:
        return _nic_svg(self.hosts, self.nic_send_s, self.nic_recv_s, self.lower_bound)

    def chains_svg(self, limit: int = 40) -> str:
        return _chains_svg(self.chains[:limit])


def plan_view(plan: Plan, measured_seconds: Optional[float] = None) -> PlanView:
    hosts_of = HostCache()
    matrix: dict[tuple[str, str], int] = defaultdict(int)
    chains = []
    size = plan.itemsize
    for t in plan.transfers:
        for f in transfer_flows(t, size, hosts_of):
            if f.link == NIC:
                matrix[f.src, f.dst] += f.nbytes
        if t.method == "broadcast" and t.route:
            chains.append((t.sender, t.route, t.num_elements * size))
    send: dict[str, float] = defaultdict(float)
    recv: dict[str, float] = defaultdict(float)
    for load in phase_loads(plan.transfers, size, hosts_of):
        for h, b in load.send.items():
            send[h] += b / plan.topology.nic_bytes_per_s(h)
        for h, b in load.recv.items():
            recv[h] += b / plan.topology.nic_bytes_per_s(h)
    hosts = list(dict.fromkeys([*plan.src.mesh.hosts, *plan.dst.mesh.hosts]))
    return PlanView(plan, dict(matrix), hosts, dict(send), dict(recv), chains, measured_seconds)


# -- drawing helpers ----------------------------------------------------------------------


def _tile_colours(plan: Plan) -> Palette:
    """One colour per distinct tile, source tiles first: a tile has the same colour in both meshes."""
    palette = Palette()
    for sharding in (plan.src, plan.dst):
        for tile in sharding.tiles(plan.shape).values():
            palette[box_str(tile)]
    return palette


_TILE_LINE = 18  # characters of a tile's label on one line; longer labels wrap one dim per line


def _tile_lines(tile) -> list[str]:
    """A tile's box as short lines: ``[0:1024, 0:512]`` whole when it fits, else one dim per line."""
    text = box_str(tile)
    if len(text) <= _TILE_LINE:
        return [text]
    dims = [f"{lo}:{hi}" for lo, hi in tile]
    return [("[" if i == 0 else " ") + d + ("]" if i == len(dims) - 1 else ",") for i, d in enumerate(dims)]


def _mesh_svg(sharding: Sharding, shape, which: str, palette: Palette) -> str:
    """Devices as a grid (last axis across, the others down), coloured by tile; every tile label shown whole."""
    mesh = sharding.mesh
    cols = mesh.shape[-1]
    rows = mesh.size // cols
    tiles = sharding.tiles(shape)
    lines = {dev: _tile_lines(tiles[dev]) for dev in mesh.devices}
    longest = max((len(t) for ls in lines.values() for t in [*ls]), default=0)
    cw = max(92, int(longest * 5.6) + 14, max(len(d) for d in mesh.devices) * 7 + 14)
    ch = 26 + 11 * max(len(ls) for ls in lines.values())
    parts = [f'<svg class="mesh" data-mesh="{which}" xmlns="http://www.w3.org/2000/svg" '
             f'width="{cols * cw + 2}" height="{rows * ch + 2}">']
    for pos, dev in enumerate(mesh.devices):
        r, c = divmod(pos, cols)
        tile = box_str(tiles[dev])
        x = c * cw + cw / 2 - 1
        label = "".join(f'<tspan x="{x}" dy="{0 if i == 0 else 11}">{escape(t)}</tspan>'
                        for i, t in enumerate(lines[dev]))
        parts.append(
            f'<g class="device" data-device="{escape(dev)}" data-tile="{escape(tile)}" data-fill="{palette[tile]}">'
            f'<title>{escape(dev)} holds {escape(tile)}</title>'
            f'<rect x="{c * cw + 1}" y="{r * ch + 1}" width="{cw - 4}" height="{ch - 4}" rx="4" '
            f'fill="{palette[tile]}" stroke="#333"/>'
            f'<text x="{x}" y="{r * ch + 17}" text-anchor="middle" font-size="11">{escape(dev)}</text>'
            f'<text class="tile-label" x="{x}" y="{r * ch + 30}" text-anchor="middle" font-size="9" '
            f'font-family="monospace">{label}</text>'
            f'</g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _short_size(n: int) -> str:
    """A byte count in at most about six characters, for a heat map cell."""
    return format_size(n).replace(" ", "").replace("iB", "")


def _heatmap_svg(hosts: list[str], matrix: dict[tuple[str, str], int]) -> str:
    """Bytes each host sends (rows) to each host (columns) over the network, written in every cell that has any,
    with a scale from none to the largest cell."""
    n = len(hosts)
    cell, pad, legend = 50, 90, 56
    peak = max(matrix.values(), default=0) or 1
    grid = pad + n * cell
    parts = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{max(grid + 10, pad + 340)}" '
             f'height="{grid + legend}">',
             f'<text x="{pad + n * cell / 2}" y="12" text-anchor="middle" font-size="11" font-weight="600">'
             f'receiving host</text>',
             f'<text transform="translate(12,{pad + n * cell / 2}) rotate(-90)" text-anchor="middle" font-size="11" '
             f'font-weight="600">sending host</text>']
    for i, h in enumerate(hosts):
        parts.append(f'<text x="{pad - 6}" y="{pad + i * cell + cell / 2 + 4}" text-anchor="end" font-size="11">{escape(h)}</text>')
        parts.append(f'<text transform="translate({pad + i * cell + cell / 2 + 4},{pad - 6}) rotate(-60)" font-size="11">{escape(h)}</text>')
    for i, a in enumerate(hosts):
        for j, b in enumerate(hosts):
            v = matrix.get((a, b), 0)
            shade = _shade(v / peak)
            x, y = pad + j * cell, pad + i * cell
            text = _short_size(v) if v else ("local" if a == b else "")
            ink = "#fff" if v / peak > 0.55 else "#222"
            parts.append(
                f'<g class="cell-group"><rect class="cell" data-from="{escape(a)}" data-to="{escape(b)}" '
                f'data-bytes="{v}" '
                f'x="{x}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{shade}" stroke="#e3e6ee">'
                f'<title>{escape(a)} -> {escape(b)}: {format_size(v)} over the network</title></rect>'
                f'<text class="cell-value" x="{x + cell / 2 - 1}" y="{y + cell / 2 + 3}" text-anchor="middle" '
                f'font-size="{10 if v else 8}" fill="{ink if v else "#999"}">{text}</text></g>'
            )
    # the scale: a gradient from no bytes to the largest cell
    y = grid + 18
    parts.append(f'<defs><linearGradient id="heat-scale"><stop offset="0" stop-color="{_shade(0)}"/>'
                 f'<stop offset="1" stop-color="{_shade(1)}"/></linearGradient></defs>'
                 f'<g class="legend heat-legend"><rect x="{pad}" y="{y}" width="160" height="10" '
                 f'fill="url(#heat-scale)" stroke="#999"/>'
                 f'<text x="{pad}" y="{y + 23}" font-size="10">0</text>'
                 f'<text class="legend-peak" data-bytes="{peak}" x="{pad + 160}" y="{y + 23}" text-anchor="end" '
                 f'font-size="10">{format_size(peak)}</text>'
                 f'<text x="{pad + 168}" y="{y + 9}" font-size="10">bytes sent over the network</text>'
                 f'<text x="{pad}" y="{y + 36}" font-size="10" fill="#555">"local": a host to itself, '
                 f'inside the host, not on its NIC</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _shade(fraction: float) -> str:
    """White for nothing, deep blue for the most bytes."""
    return f"rgb({int(255 - 215 * fraction)},{int(255 - 185 * fraction)},{int(255 - 40 * fraction)})"


_SEND, _RECV = "#e08a3c", "#3c8ae0"


def _nic_svg(hosts: list[str], send: dict[str, float], recv: dict[str, float], bound: float) -> str:
    """Each host's NIC send and receive seconds, with the plan's lower bound as a line, and a legend."""
    width, label, row, top = 560, 90, 30, 26
    peak = max([*send.values(), *recv.values(), bound], default=0) or 1
    scale = (width - label - 150) / peak
    height = top + len(hosts) * row + 24
    parts = [f'<svg class="nic" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<g class="legend nic-legend">'
             f'<rect x="{label}" y="4" width="14" height="10" fill="{_SEND}"/>'
             f'<text x="{label + 18}" y="13" font-size="11">send</text>'
             f'<rect x="{label + 64}" y="4" width="14" height="10" fill="{_RECV}"/>'
             f'<text x="{label + 82}" y="13" font-size="11">receive</text>'
             f'<line x1="{label + 146}" x2="{label + 166}" y1="9" y2="9" stroke="#c00" stroke-dasharray="4 3"/>'
             f'<text x="{label + 170}" y="13" font-size="11">lower bound (busiest NIC at full rate)</text></g>']
    for i, h in enumerate(hosts):
        y = top + i * row + 4
        parts.append(f'<text x="{label - 6}" y="{y + 15}" text-anchor="end" font-size="11">{escape(h)}</text>')
        for k, (what, val, fill) in enumerate((("send", send.get(h, 0.0), _SEND), ("recv", recv.get(h, 0.0), _RECV))):
            w = max(val * scale, 0.5)
            parts.append(
                f'<rect class="nic-bar" data-host="{escape(h)}" data-direction="{what}" data-seconds="{val:.6g}" '
                f'x="{label}" y="{y + k * 11}" width="{w:.1f}" height="10" fill="{fill}">'
                f'<title>{escape(h)} {"receive" if what == "recv" else what}: {val:.4g} s</title></rect>'
            )
            if val:
                parts.append(f'<text class="nic-value" x="{label + w + 4:.1f}" y="{y + k * 11 + 9}" font-size="9">'
                             f'{val:.3g} s</text>')
    x = label + bound * scale
    parts.append(f'<line class="bound" data-seconds="{bound:.6g}" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" '
                 f'y2="{top + len(hosts) * row + 4}" stroke="#c00" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x:.1f}" y="{top + len(hosts) * row + 18}" font-size="10" fill="#c00">lower bound '
                 f'{bound:.3g}s</text>')
    parts.append("</svg>")
    return "".join(parts)


def _chains_svg(chains: list[tuple[str, tuple[str, ...], int]]) -> str:
    """One row per broadcast: sender's host, then each hop of the chain."""
    row, step = 28, 96
    longest = max((len(route) for _, route, _ in chains), default=0) + 1
    parts = [f'<svg class="chains" xmlns="http://www.w3.org/2000/svg" width="{longest * step + 20}" '
             f'height="{len(chains) * row + 8}">',
             arrow_marker("arrow")]
    for i, (sender, route, n) in enumerate(chains):
        hops = [host_of(sender), *route]
        y = i * row + 16
        parts.append(f'<g class="chain" data-route="{escape(",".join(hops))}" data-bytes="{n}">')
        for k, h in enumerate(hops):
            x = 10 + k * step
            if k:
                parts.append(f'<line x1="{x - step + 70}" y1="{y - 4}" x2="{x - 4}" y2="{y - 4}" stroke="#555" marker-end="url(#arrow)"/>')
            parts.append(f'<rect x="{x}" y="{y - 14}" width="70" height="18" rx="3" fill="{colour(h)}" stroke="#333"/>'
                         f'<text x="{x + 35}" y="{y}" text-anchor="middle" font-size="10">{escape(shorten(h, 11))}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)
