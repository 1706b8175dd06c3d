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
from reshard.server.dashboard.svg import arrow_marker, colour, shorten

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

    # -- svg ----------------------------------------------------------------------------

    def mesh_svg(self, which: str) -> str:
        return _mesh_svg(self.plan.src if which == "src" else self.plan.dst, self.plan.shape, which)

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


def _mesh_svg(sharding: Sharding, shape, which: str) -> str:
    """Devices as a grid (last axis across, the others down), coloured by tile."""
    mesh = sharding.mesh
    cols = mesh.shape[-1]
    rows = mesh.size // cols
    cw, ch = 92, 40
    tiles = sharding.tiles(shape)
    parts = [f'<svg class="mesh" data-mesh="{which}" xmlns="http://www.w3.org/2000/svg" '
             f'width="{cols * cw + 2}" height="{rows * ch + 2}">']
    for pos, dev in enumerate(mesh.devices):
        r, c = divmod(pos, cols)
        tile = box_str(tiles[dev])
        parts.append(
            f'<g class="device" data-device="{escape(dev)}" data-tile="{escape(tile)}">'
            f'<title>{escape(dev)} holds {escape(tile)}</title>'
            f'<rect x="{c * cw + 1}" y="{r * ch + 1}" width="{cw - 4}" height="{ch - 4}" rx="4" '
            f'fill="{colour(tile)}" stroke="#333"/>'
            f'<text x="{c * cw + cw / 2 - 1}" y="{r * ch + 17}" text-anchor="middle" font-size="11">{escape(dev)}</text>'
            f'<text x="{c * cw + cw / 2 - 1}" y="{r * ch + 30}" text-anchor="middle" font-size="9">{escape(shorten(tile))}</text>'
            f'</g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _heatmap_svg(hosts: list[str], matrix: dict[tuple[str, str], int]) -> str:
    """Bytes each host sends (rows) to each host (columns) over the network."""
    n = len(hosts)
    cell, pad = 34, 90
    peak = max(matrix.values(), default=0) or 1
    parts = [f'<svg class="heatmap" xmlns="http://www.w3.org/2000/svg" width="{pad + n * cell + 10}" '
             f'height="{pad + n * cell + 10}">']
    for i, h in enumerate(hosts):
        parts.append(f'<text x="{pad - 6}" y="{pad + i * cell + cell / 2 + 4}" text-anchor="end" font-size="11">{escape(h)}</text>')
        parts.append(f'<text transform="translate({pad + i * cell + cell / 2 + 4},{pad - 6}) rotate(-60)" font-size="11">{escape(h)}</text>')
    for i, a in enumerate(hosts):
        for j, b in enumerate(hosts):
            v = matrix.get((a, b), 0)
            shade = int(255 - 200 * v / peak)
            parts.append(
                f'<rect class="cell" data-from="{escape(a)}" data-to="{escape(b)}" data-bytes="{v}" '
                f'x="{pad + j * cell}" y="{pad + i * cell}" width="{cell - 2}" height="{cell - 2}" '
                f'fill="rgb({shade},{shade},255)"><title>{escape(a)} -> {escape(b)}: {v / 2**20:.1f} MiB</title></rect>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _nic_svg(hosts: list[str], send: dict[str, float], recv: dict[str, float], bound: float) -> str:
    """Each host's NIC send and receive seconds, with the plan's lower bound as a line."""
    width, label, row = 520, 90, 30
    peak = max([*send.values(), *recv.values(), bound], default=0) or 1
    scale = (width - label - 140) / peak
    parts = [f'<svg class="nic" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{len(hosts) * row + 24}">']
    for i, h in enumerate(hosts):
        y = i * row + 4
        parts.append(f'<text x="{label - 6}" y="{y + 15}" text-anchor="end" font-size="11">{escape(h)}</text>')
        for k, (what, val, fill) in enumerate((("send", send.get(h, 0.0), "#e08a3c"), ("recv", recv.get(h, 0.0), "#3c8ae0"))):
            parts.append(
                f'<rect class="nic-bar" data-host="{escape(h)}" data-direction="{what}" data-seconds="{val:.6g}" '
                f'x="{label}" y="{y + k * 11}" width="{max(val * scale, 0.5):.1f}" height="10" fill="{fill}">'
                f'<title>{escape(h)} {what}: {val:.4g} s</title></rect>'
            )
    x = label + bound * scale
    parts.append(f'<line class="bound" data-seconds="{bound:.6g}" x1="{x:.1f}" x2="{x:.1f}" y1="0" '
                 f'y2="{len(hosts) * row + 4}" stroke="#c00" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x:.1f}" y="{len(hosts) * row + 18}" font-size="10" fill="#c00">lower bound {bound:.3g}s</text>')
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
