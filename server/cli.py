"""The ``reshard`` command: planning, and (as the service grows) agents, planner, cluster and demo."""

from __future__ import annotations

import argparse
import logging
import sys

from reshard.cli import add_plan_command
from reshard.errors import ReshardError

__all__ = ["main", "build_parser"]


def _add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="compare the planning strategies on the paper's cases")
    p.add_argument("--nic-gbps", type=float, default=10.0)
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from reshard.cases import n_to_m_cases, one_to_m_cases
    from reshard.report import compare_strategies, format_rows
    from reshard.topology import Topology

    rows = compare_strategies(n_to_m_cases() + one_to_m_cases(), Topology(nic_gbps=args.nic_gbps))
    print(format_rows(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description="Cross-mesh resharding: plan, serve, move.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_command(sub)
    _add_demo_command(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except ReshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
