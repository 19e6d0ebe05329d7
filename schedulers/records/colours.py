"""Colours of nodes in every chart (dashboard bars and timelines, the planner's Gantt chart).

A node's colour follows from its name alone, so ``actor_gen`` looks the same in every run, dashboard and
plan, whatever other nodes the graph has or the order they ran in: the name's CRC-32 picks a slot in
matplotlib's ``tab20`` palette (greys left out); a name whose slot is taken takes the next free one, in
sorted-name order (only then does a colour depend on the other names).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Final

__all__ = ["PALETTE", "SPECIAL_COLOURS", "node_colours"]

# matplotlib's tab20 as hex (no matplotlib import needed) without its greys (reallocation's): nine dark
# hues, then their light partners, so the next slot after a clash is another hue.
PALETTE: Final = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)  # fmt: skip
# Not nodes: drawn grey (and hatched by the charts) so they never look like a node.
SPECIAL_COLOURS: Final = {"reallocation": "#7f7f7f", "data_transfer": "#3b3b3b", "tool": "#c7c7c7"}


def node_colours(names: Iterable[str]) -> dict[str, str]:
    """Name -> hex colour: ``SPECIAL_COLOURS`` for reallocation, data transfer and tool phases, else the
    slot of the name's CRC-32 in ``PALETTE`` (the next free slot on a clash; past 18 names slots repeat)."""
    colours: dict[str, str] = {}
    taken: set[int] = set()
    for name in sorted(set(names)):
        if name in SPECIAL_COLOURS:
            colours[name] = SPECIAL_COLOURS[name]
            continue
        slot = zlib.crc32(name.encode()) % len(PALETTE)
        for step in range(len(PALETTE)):
            if (slot + step) % len(PALETTE) not in taken:
                slot = (slot + step) % len(PALETTE)
                break
        taken.add(slot)
        colours[name] = PALETTE[slot]
    return colours
