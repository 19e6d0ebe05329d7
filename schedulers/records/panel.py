"""What every dashboard panel shares: the :class:`Panel` record, the look of each run's lines, and legends
placed outside the plots.

A legend never covers data: :func:`outside_legend` puts it on the (sub)figure beside or below its plots,
and matplotlib's constrained layout shrinks the plots to make room (``loc="outside ..."``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import matplotlib as mpl
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import FigureBase

__all__ = [
    "LEGEND_WRAP",
    "RUN_MARKERS",
    "RUN_STYLES",
    "Panel",
    "legend_rows",
    "no_data",
    "outside_legend",
    "run_colour",
]

RUN_MARKERS: Final = ("o", "s", "^", "D", "v", "P")
RUN_STYLES: Final = ("-", "--", "-.", ":")
LEGEND_WRAP: Final = 48  # characters of a legend label per line; a longer one wraps (one column then)


@dataclass
class Panel:
    """One plot of the dashboard: ``draw`` fills a figure (or subfigure) of ``height_in`` inches."""

    key: str
    title: str
    height_in: float
    draw: Callable[[FigureBase], None] = field(repr=False)


def run_colour(index: int) -> Any:
    """The colour of run ``index`` where a plot's lines are one per run (tab10, cycling)."""
    return mpl.colormaps["tab10"](index % 10)


def no_data(ax: Axes, text: str = "no data") -> None:
    """Grey ``text`` in the middle of an empty plot."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")


def _columns(labels: Sequence[str]) -> int:
    return 2 if len(labels) > 1 and max(len(t) for t in labels) <= LEGEND_WRAP // 2 else 1


def legend_rows(labels: Sequence[str]) -> int:
    """Text lines of the legend :func:`outside_legend` draws below a plot for ``labels``."""
    if not labels:
        return 0
    cols = _columns(labels)
    lines = [len(textwrap.wrap(t, LEGEND_WRAP)) or 1 for t in labels]
    per_col = -(-len(labels) // cols)
    return max(sum(lines[c * per_col : (c + 1) * per_col]) for c in range(cols))


def outside_legend(fig: FigureBase, handles: Sequence[Artist], labels: Sequence[str], where: str) -> None:
    """A legend of ``handles`` on ``fig`` outside its plots: ``where`` ``"below"`` (centred, two columns
    when the labels are short, long labels wrapped at :data:`LEGEND_WRAP` characters) or ``"right"``
    (one column, top-aligned). Nothing for no handles.

    Raises:
        ValueError: ``where`` is neither.
    """
    if not handles:
        return
    if where == "below":
        wrapped = ["\n".join(textwrap.wrap(t, LEGEND_WRAP)) or t for t in labels]
        fig.legend(
            handles, wrapped, loc="outside lower center", ncols=_columns(labels), fontsize="x-small",
            frameon=False, handlelength=2.5, columnspacing=1.2,
        )  # fmt: skip
    elif where == "right":
        fig.legend(handles, list(labels), loc="outside right upper", fontsize="small")
    else:
        raise ValueError(f"legend place {where!r}: use 'below' or 'right'")
