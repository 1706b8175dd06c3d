"""Command-line notation for meshes and specs, and the ``reshard plan`` command.

Notation a person can type
--------------------------
mesh   ``x=2,y=4``            axes; hosts default to one per row of the last axis
                              (``PREFIX0``, ``PREFIX1``, ...), the last axis being the
                              devices of a host
       ``x=2,y=4@a0,a1``      the same on hosts ``a0`` and ``a1``
       ``x=2,y=4@node[0-1]``  a host range
spec   ``x,_,_``              per dim: an axis, ``_`` (or ``None``) for not split,
                              ``x+y`` for a dim split over two axes (``x`` major);
                              ``P('x', None)`` is accepted too
"""

from __future__ import annotations

import argparse
import json
import math
import re

from reshard.errors import InvalidMeshError, InvalidShapeError, InvalidShardingError, ReshardError
from reshard.mesh import Mesh
from reshard.strategies import STRATEGIES, plan
from reshard.sharding import Sharding, normalise_shape
from reshard.topology import Topology

__all__ = ["parse_mesh", "parse_spec", "parse_shape", "parse_hosts", "add_plan_command", "run_plan", "positive_int",
           "non_negative_int", "positive_float"]

_RANGE = re.compile(r"^(?P<prefix>[^\[\]]*)\[(?P<lo>\d+)-(?P<hi>\d+)\](?P<suffix>[^\[\]]*)$")


def parse_hosts(text: str) -> list[str]:
    """``a0,a1`` or ``node[0-3]`` (inclusive range) or a mix of both."""
    hosts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _RANGE.match(part)
        if m:
            lo, hi = int(m["lo"]), int(m["hi"])
            if hi < lo:
                raise InvalidMeshError(f"host range {part!r} runs backwards; write node[0-3]")
            hosts.extend(f"{m['prefix']}{i}{m['suffix']}" for i in range(lo, hi + 1))
        else:
            hosts.append(part)
    return hosts


def parse_mesh(text: str, default_prefix: str = "node") -> Mesh:
    """``x=2,y=4`` or ``x=2,y=4@a0,a1`` (see the module notes)."""
    axes_text, _, hosts_text = text.partition("@")
    axes = []
    for part in filter(None, (p.strip() for p in axes_text.split(","))):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit():
            raise InvalidMeshError(
                f"mesh axis {part!r} in {text!r} is not NAME=SIZE; write a mesh like 'x=2,y=4' or 'x=2,y=4@a0,a1'"
            )
        axes.append((name.strip(), int(size)))
    if not axes:
        raise InvalidMeshError(f"mesh {text!r} names no axes; write a mesh like 'x=2,y=4'")
    if hosts_text:
        hosts = parse_hosts(hosts_text)
        size = math.prod(n for _, n in axes)
        if hosts and size % len(hosts):
            counts = [str(d) for d in range(1, size + 1) if size % d == 0][:6]
            choices = " or ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 1 else counts)
            raise InvalidMeshError(
                f"mesh {text!r} has {size} positions, which do not divide evenly over its {len(hosts)} hosts; name "
                f"{choices} host{'s' if size > 1 else ''} (every host holds the same number of devices), "
                f"or none ({axes_text.strip()!r}: one host per row of the last axis)"
            )
        return Mesh.from_hosts(axes, hosts)
    return Mesh.grid(axes, axes[-1][1], default_prefix)


def parse_spec(text: str) -> tuple:
    """``x,_,_`` or ``x+y,None`` or ``P('x', None)`` into a spec tuple."""
    t = text.strip()
    if t.startswith("P(") and t.endswith(")"):
        t = t[2:-1]
    out = []
    depth, item = 0, ""
    for ch in t + ",":
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(item.strip())
            item = ""
        else:
            item += ch
    if out and out[-1] == "":
        out.pop()
    spec = []
    for entry in out:
        e = entry.strip().strip("()").replace("'", "").replace('"', "")
        if e in ("", "-", "_", "None", "none"):
            spec.append(None)
            continue
        axes = [a.strip() for a in re.split(r"[+,]", e) if a.strip()]
        for a in axes:
            if not a.isidentifier():
                raise InvalidShardingError(
                    f"spec entry {entry!r} in {text!r} is not an axis name, '_' or 'x+y'; write a spec like 'x,_,_'"
                )
        spec.append(axes[0] if len(axes) == 1 else tuple(axes))
    return tuple(spec)


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        sizes = [int(s) for s in text.replace("x", ",").split(",") if s.strip()]
    except ValueError:
        raise InvalidShapeError(f"shape {text!r} is not a list of sizes like 1024,1024,512") from None
    return normalise_shape(sizes)


def non_negative_int(text: str) -> int:
    """An argparse type: a count of 0 or more (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (``None``: the help text says it)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_plan_command(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan a reshard and print it (no data moves)",
        description="Plan moving a tensor between two mesh layouts and print the plan. "
        "Meshes: 'x=2,y=4' (hosts src0.. / dst0.., last axis = devices of a host) or "
        "'x=2,y=4@a0,a1' or 'x=2,y=4@node[0-1]'. Specs: per dim an axis, '_' (not split) or 'x+y'.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--shape", required=True, help="tensor shape, e.g. 1024,1024,512")
    p.add_argument("--dtype", default="float32", help="element type")
    p.add_argument("--src", required=True, help="source mesh, e.g. x=2,y=4")
    p.add_argument("--src-spec", required=True, help="source spec, e.g. x,_,_")
    p.add_argument("--dst", required=True, help="destination mesh, e.g. x=2,y=4")
    p.add_argument("--dst-spec", required=True, help="destination spec, e.g. _,x,_")
    p.add_argument("--strategy", default="auto", choices=[*STRATEGIES, "all"], help="'all' compares every strategy")
    p.add_argument("--nic-gbps", type=float, default=10.0, help="NIC bandwidth per host")
    p.add_argument("--intra-gbps", type=float, default=100.0, help="device-to-device bandwidth inside a host")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--max-transfers", type=int, default=20, help="transfers to list in the summary")
    p.set_defaults(func=run_plan)


def _flag(flag: str, parse, *args):
    """``parse(*args)``, its error prefixed with the flag whose value broke the rule (a flag once, innermost)."""
    try:
        return parse(*args)
    except ReshardError as e:
        if str(e).startswith("--"):
            raise
        raise type(e)(f"{flag}: {e}") from None


def run_plan(args) -> int:
    # Parsed here, not as an argparse type, so that the message states the rule.
    args.shape = _flag("--shape", parse_shape, args.shape)
    src = _flag("--src/--src-spec", lambda: Sharding(_flag("--src", parse_mesh, args.src, "src"),
                                                     _flag("--src-spec", parse_spec, args.src_spec)))
    dst = _flag("--dst/--dst-spec", lambda: Sharding(_flag("--dst", parse_mesh, args.dst, "dst"),
                                                     _flag("--dst-spec", parse_spec, args.dst_spec)))
    topo = Topology(nic_gbps=args.nic_gbps, intra_host_gbps=args.intra_gbps)
    if args.strategy == "all":
        plans = [plan(args.shape, args.dtype, src, dst, topo, s).validate() for s in STRATEGIES]
        if args.json:
            print(json.dumps([p.to_json() for p in plans]))
            return 0
        lb = plans[0].lower_bound_seconds
        print(f"{src} -> {dst}, {args.dtype}{list(args.shape)}, lower bound {lb:.4g}s")
        print(f"{'strategy':<16} {'estimate s':>11} {'/ bound':>8} {'network MiB':>12} {'transfers':>10}")
        for p in plans:
            ratio = p.estimate_seconds / lb if lb else 1.0
            print(f"{p.strategy:<16} {p.estimate_seconds:>11.4g} {ratio:>8.3f} "
                  f"{p.network_bytes() / 2**20:>12.2f} {len(p.transfers):>10}")
        return 0
    result = plan(args.shape, args.dtype, src, dst, topo, args.strategy).validate()
    print(result.dumps() if args.json else result.summary(args.max_transfers))
    return 0
