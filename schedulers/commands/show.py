"""Show a graph: its nodes in execution order with their keys, and drawings (PNG, SVG, Graphviz DOT).

Data edges are solid and labelled by key; version edges (a train node's weights read at the next
iteration) are dashed; order edges (read the weights before the train node overwrites them) are dotted.

Example: ``rlflow show examples/ppo.yaml``  (writes out/ppo.png, out/ppo.svg, out/ppo.dot)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from rlflow.dataflow.errors import RlflowError
from rlflow.dataflow.graph import GraphWarning
from rlflow.schedulers.commands import OUT_DIR
from rlflow.schedulers.commands.validate import split_items


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items", nargs="+", metavar="FILE|KEY=VALUE", help="a graph file, then dotted overrides"
    )
    parser.add_argument(
        "--out",
        metavar="PREFIX",
        default=None,
        help=f"write PREFIX.png, PREFIX.svg and PREFIX.dot (default: {OUT_DIR}/ and the graph file's stem)",
    )
    parser.add_argument("--no-draw", action="store_true", help="only print the execution order")


def run(args: argparse.Namespace) -> int:
    from rlflow.dataflow.draw import describe, write_drawings
    from rlflow.dataflow.loader import load_graph

    files, overrides = split_items(args.items)
    if len(files) != 1:
        raise RlflowError(
            f"show takes exactly one graph file, got {len(files)}: {' '.join(files) or '(none)'}"
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GraphWarning)
        graph = load_graph(files[0], overrides)
    for w in caught:
        if issubclass(w.category, GraphWarning):
            print(f"warning: {w.message}", file=sys.stderr)
    print(describe(graph))
    if not args.no_draw:
        prefix = args.out if args.out is not None else OUT_DIR / Path(files[0]).stem
        for path in write_drawings(graph, prefix):
            print(f"wrote {path}")
    return 0
