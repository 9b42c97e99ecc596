"""Shared command line of the seed examples: free ports, or the seed's own with --seed-ports."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import graphdist

SEED_CLUSTER = {"local": ["localhost:2020", "localhost:2021"]}


def run_example(description: str, body: Callable[[graphdist.LocalFleet], None]) -> None:
    """Start a two-task ``local`` fleet, run ``body(fleet)``, stop the fleet.

    A taken port or a bad spec prints one ``Error: ...`` line and exits 2 instead of hanging.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--seed-ports",
        action="store_true",
        help="use the seed's localhost:2020 and localhost:2021 instead of free ports",
    )
    args = parser.parse_args()
    spec: Any = SEED_CLUSTER if args.seed_ports else "local=2"
    try:
        with graphdist.LocalFleet(spec) as fleet:
            body(fleet)
    except graphdist.GraphdistError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(2)
