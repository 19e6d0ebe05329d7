"""Validate graph files: load, apply overrides, resolve, check, and report.

Prints ``ok: FILE (N nodes, M keys)`` per valid file and each warning to stderr; a file with a mistake
prints the error to stderr and the command exits with status 2 after checking every file.

Example: ``rlflow validate examples/*.yaml nodes.actor_train.args.lr=1e-6``
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from dataflow.errors import RlflowError
from dataflow.graph import GraphWarning


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Separate graph files from dotted ``key=value`` overrides (an existing file is always a file)."""
    files: list[str] = []
    overrides: list[str] = []
    for item in items:
        (overrides if "=" in item and not Path(item).exists() else files).append(item)
    return files, overrides


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items",
        nargs="+",
        metavar="FILE|KEY=VALUE",
        help="graph files, and dotted overrides (key.path=value) applied to every file",
    )


def run(args: argparse.Namespace) -> int:
    from dataflow.loader import load_graph

    files, overrides = split_items(args.items)
    if not files:
        raise RlflowError("no graph file given (only overrides: " + " ".join(overrides) + ")")
    status = 0
    for file in files:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GraphWarning)
                graph = load_graph(file, overrides)
        except RlflowError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
            continue
        for w in caught:
            if issubclass(w.category, GraphWarning):
                print(f"warning: {w.message}", file=sys.stderr)
        print(f"ok: {file} ({len(graph.nodes)} nodes, {len(graph.keys())} keys)")
    return status
