"""The dashboard's drawings as data: distinct tile colours, tile labels whole, heat map numbers and legends."""

from __future__ import annotations

import re

from reshard import Mesh, Sharding, Topology, plan
from reshard.server.dashboard.plan_view import plan_view
from reshard.server.dashboard.svg import Palette


def test_a_palette_gives_every_key_its_own_colour_and_keeps_it():
    p = Palette()
    colours = [p[f"tile{i}"] for i in range(40)]
    assert len(set(colours)) == 40
    assert [p[f"tile{i}"] for i in range(40)] == colours
    assert "#d9d9d9" not in colours  # no grey: it reads as an empty tile


def test_the_plan_drawings_carry_numbers_whole_labels_and_legends():
    src = Sharding(Mesh.from_hosts({"x": 2, "y": 4}, ["a", "b"]), (None, ("x", "y"), None))
    dst = Sharding(Mesh.from_hosts({"x": 2, "y": 4}, ["c", "d"]), ("x", None, None))
    view = plan_view(plan((1024, 1024, 512), "float32", src, dst, Topology(nic_gbps=10), "auto"))
    mesh = view.mesh_svg("src")
    tiles = re.findall(r'data-tile="([^"]+)" data-fill="([^"]+)"', mesh)
    assert len({fill for _, fill in tiles}) == len({tile for tile, _ in tiles}) == 8
    labels = re.findall(r'<text class="tile-label"[^>]*>(.*?)</text>', mesh)
    assert re.findall(r">([^<]*)</tspan>", labels[0]) == ["[0:1024,", " 0:128,", " 0:512]"]
    heat = view.heatmap_svg()
    cells = re.findall(r'data-from="(\w)" data-to="(\w)" data-bytes="(\d+)"[^>]*>.*?</rect>'
                       r'<text class="cell-value"[^>]*>([^<]*)<', heat)
    # 2 GiB from hosts a, b to c, d: each source host sends each destination host a quarter, written in its cell
    assert {(a, b): text for a, b, n, text in cells if int(n)} == {
        (a, b): "512.0M" for a in "ab" for b in "cd"}
    assert {text for a, b, n, text in cells if a == b} == {"local"}
    assert sum(int(n) for n in re.findall(r'class="cell" [^>]*data-bytes="(\d+)"', heat)) == view.plan.network_bytes()
    assert 'class="legend-peak"' in heat and "bytes sent over the network" in heat
    assert re.findall(r">(send|receive)</text>", view.nic_svg()) == ["send", "receive"]
