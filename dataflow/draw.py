"""Text and drawings of a :class:`~rlflow.dataflow.graph.Graph`: execution order, Graphviz DOT, PNG and SVG.

Edge styles everywhere: data edges solid and labelled with their keys, version edges dashed, order edges
dotted. The PNG/SVG is a layered drawing (Sugiyama): vertices in rows by depth, and an edge that passes a
row takes a slot of its own there, so it never crosses a box (no Graphviz needed: networkx places the
slots, matplotlib draws, Agg with no display). The DOT text is written directly; ``dot -Tpng`` renders
it where Graphviz exists.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import networkx as nx

from rlflow.dataflow.dag import DATA
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph

if TYPE_CHECKING:  # matplotlib loads only when drawing
    from matplotlib.figure import Figure

__all__ = ["Drawing", "DrawnEdge", "describe", "draw", "layers", "to_dot", "write_drawings"]

KIND_COLORS = {"data": "#bebada", "generate": "#8dd3c7", "inference": "#ffffb3", "train": "#fb8072"}
EDGE_STYLES = {"data": "solid", "version": "dashed", "order": "dotted"}
X_SLOT: Final = 2.4  # data units between neighbouring slots of a layer
Y_SLOT: Final = 2.0  # and between layers


def _node_label(graph: Graph, name: str) -> str:
    if name == DATA:
        return "data"
    node = graph.node(name)
    where = f" @ {node.model}" if node.model else ""
    return f"{name}\n{node.kind}: {node.function}{where}"


def _placement_text(graph: Graph, name: str) -> str:
    if graph.spec.plan == "auto":
        return "plan auto"
    p = graph.placement(name)
    devs = p.devices
    mesh = (
        f"{devs[0]}-{devs[-1]}"
        if len(devs) > 1 and list(devs) == list(range(devs[0], devs[-1] + 1))
        else (",".join(map(str, devs)))
    )
    return f"device ids [{mesh}] {p.layout}"  # a list: "devices 4" read as a count


def describe(graph: Graph) -> str:
    """Nodes in execution order with function, model, batch, placement, input keys (with producers),
    output keys; then version and order edges."""
    lines = [f"{graph.spec.source or '<graph>'}: {len(graph.nodes)} nodes, {len(graph.keys())} keys"]
    for i, name in enumerate(graph.execution_order(), 1):
        node = graph.node(name)
        g = graph.group_size(name)
        batch = f"{node.batch_size} {node.batch_unit}"
        if g > 1:
            batch += f" (n={g})"
        if node.kind == "train":
            batch += f", {node.mini_batches} mini-batches × {node.epochs} epochs"
        model = f" @ {node.model}" if node.model else ""
        lines.append(
            f"{i:>2}. {name}: {node.kind} {node.function}{model}; {batch}; {_placement_text(graph, name)}"
        )
        assert isinstance(node.inputs, dict) and isinstance(node.outputs, dict)
        ins = [
            f"{key} <- {graph.producer(key)}" + (f" (as {param})" if param != key else "")
            for param, key in node.inputs.items()
        ]
        outs = [
            (f"{key}" + (f" (from {param})" if param != key else ""))
            if key is not None
            else f"({param} discarded)"
            for param, key in node.outputs.items()
        ]
        lines.append(f"      in:  {', '.join(ins) or '-'}")
        lines.append(f"      out: {', '.join(outs) or '-'}")
    for kind, what in (("version", "next iteration reads new weights"), ("order", "reads weights before")):
        edges = graph.edges(kind)
        if edges:
            lines.append(f"{kind} edges ({what}):")
            lines += [f"  {u} -> {v} ({d.get('what') or 'model ' + str(d['model'])})" for u, v, d in edges]
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _merged_edges(graph: Graph) -> dict[tuple[str, str, str], list[str]]:
    """(u, v, kind) -> labels; parallel data edges between two nodes share one arrow."""
    merged: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for u, v, d in graph.edges():
        kind = d["kind"]
        label = d["key"] if kind == "data" else f"{kind} ({d.get('what') or d['model']})"
        merged[(u, v, kind)].append(label)
    return merged


def to_dot(graph: Graph, name: str = "rlflow") -> str:
    """Graphviz DOT text: data edges solid with key labels, version edges dashed, order edges dotted."""
    out = [f"digraph {_quote(name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica", style=filled];']
    out.append(f'  {_quote(DATA)} [shape=cylinder, fillcolor="{KIND_COLORS["data"]}", label="data"];')
    shapes = {"generate": "box", "inference": "ellipse", "train": "box3d"}
    for n in graph.execution_order():
        node = graph.node(n)
        out.append(
            f'  {_quote(n)} [shape={shapes[node.kind]}, fillcolor="{KIND_COLORS[node.kind]}", '
            f"label={_quote(_node_label(graph, n))}];"
        )
    for (u, v, kind), labels in _merged_edges(graph).items():
        attrs = [f"label={_quote(chr(10).join(labels))}", f"style={EDGE_STYLES[kind]}"]
        if kind == "version":
            attrs += ["constraint=false", 'color="#1f78b4"', 'fontcolor="#1f78b4"']
        elif kind == "order":
            attrs += ['color="#777777"', 'fontcolor="#777777"']
        out.append(f"  {_quote(u)} -> {_quote(v)} [{', '.join(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def layers(graph: Graph) -> list[list[str]]:
    """Vertices (``data`` first) grouped by longest-path depth over data and order edges."""
    flow = nx.DiGraph()
    flow.add_nodes_from([DATA, *graph.execution_order()])
    flow.add_edges_from((u, v) for u, v, d in graph.edges() if d["kind"] != "version")
    index = {n: i for i, n in enumerate([DATA, *graph.execution_order()])}
    return [sorted(layer, key=index.__getitem__) for layer in nx.topological_generations(flow)]


Point = tuple[float, float]
Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in data coordinates


@dataclass(frozen=True)
class DrawnEdge:
    """One arrow of the drawing: ``points`` from the edge of ``u``'s box to the edge of ``v``'s, through a
    slot in every layer between; ``label`` (data edges: the keys) sits in ``label_box``."""

    u: str
    v: str
    kind: str
    points: tuple[Point, ...]
    label: str
    label_box: Box | None


@dataclass(frozen=True)
class Drawing:
    """A drawn graph: the figure, each vertex's box and each edge's route, in data coordinates."""

    figure: Figure
    boxes: dict[str, Box]
    edges: list[DrawnEdge]


def _slots(graph: Graph) -> tuple[list[list[Hashable]], dict[tuple[str, str, str], list[Hashable]]]:
    """Layered slots (Sugiyama): vertices by depth plus one dummy slot per layer an edge passes, ordered
    within each layer by barycentre sweeps to cut crossings. Returns the layers and each edge's dummies."""
    rows: list[list[Hashable]] = [list(layer) for layer in layers(graph)]
    depth = {n: d for d, layer in enumerate(rows) for n in layer}
    route: dict[tuple[str, str, str], list[Hashable]] = {}
    links = nx.Graph()
    links.add_nodes_from(depth)
    for u, v, kind in _merged_edges(graph):
        step = 1 if depth[v] > depth[u] else -1
        chain: list[Hashable] = [u]
        for d in range(depth[u] + step, depth[v], step):
            dummy = ("route", u, v, kind, d)
            rows[d].append(dummy)
            chain.append(dummy)
        chain.append(v)
        route[(u, v, kind)] = chain[1:-1]
        links.add_edges_from(pairwise(chain))
    for sweep in range(4):  # down, up, down, up: each layer sorted by its neighbours' mean slot
        order = range(1, len(rows)) if sweep % 2 == 0 else range(len(rows) - 2, -1, -1)
        for d in order:
            ref = rows[d - 1] if sweep % 2 == 0 else rows[d + 1]
            slot = {n: i for i, n in enumerate(ref)}
            here = {n: i for i, n in enumerate(rows[d])}

            def centre(
                n: Hashable, slot: dict[Hashable, int] = slot, here: dict[Hashable, int] = here
            ) -> float:
                near = [slot[m] for m in links[n] if m in slot]
                return sum(near) / len(near) if near else float(here[n])

            rows[d].sort(key=centre)
    return rows, route


def _clip(inside: Point, outside: Point, box: Box) -> Point:
    """Where the segment from ``inside`` (a box's centre) to ``outside`` leaves ``box``."""
    (x0, y0), (x1, y1) = inside, outside
    t = 1.0
    for lo, hi, a, b in ((box[0], box[2], x0, x1), (box[1], box[3], y0, y1)):
        if b != a:
            t = min(t, ((hi if b > a else lo) - a) / (b - a))
    return x0 + t * (x1 - x0), y0 + t * (y1 - y0)


def draw(graph: Graph) -> Drawing:
    """Draw the graph with matplotlib (no display): a box per vertex in layers (networkx's
    ``multipartite_layout`` over :func:`_slots`), every edge routed through its own slot in each layer it
    passes so it crosses no box, data edges labelled with their keys."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows, route = _slots(graph)
    pos = nx.multipartite_layout(
        nx.empty_graph([n for layer in rows for n in layer]),
        subset_key=dict(enumerate(rows)),
        align="horizontal",
    )
    # multipartite_layout scales the whole layout into [-1, 1]: one slot (layer or neighbour) is the unit.
    gaps = [abs(pos[a][0] - pos[b][0]) for layer in rows for a, b in pairwise(layer)]
    gaps += [abs(pos[rows[1][0]][1] - pos[rows[0][0]][1])] if len(rows) > 1 else []
    unit = min(gaps, default=1.0) or 1.0
    xy = {n: (float(p[0]) / unit * X_SLOT, -float(p[1]) / unit * Y_SLOT) for n, p in pos.items()}
    y_top = max(y for _, y in xy.values())
    xy = {n: (x, y - y_top) for n, (x, y) in xy.items()}  # the first layer at y = 0, the rest below

    width = max(len(layer) for layer in rows)
    fig = Figure(figsize=(max(6.0, 1.9 * width), max(4.0, 1.7 * len(rows))))
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.92))
    texts = {}
    for n in (v for layer in rows for v in layer if isinstance(v, str)):
        kind = "data" if n == DATA else graph.node(n).kind
        texts[n] = ax.text(
            *xy[n], _node_label(graph, n), ha="center", va="center", fontsize=7, zorder=3, gid=f"node:{n}",
            bbox={"boxstyle": "round,pad=0.45", "fc": KIND_COLORS[kind], "ec": "#333333"},
        )  # fmt: skip
    xs = [x for x, _ in xy.values()]
    ax.set_xlim(min(xs) - X_SLOT * 0.6, max(xs) + X_SLOT * 0.6)
    ax.set_ylim(-(len(rows) - 1) * Y_SLOT - Y_SLOT * 0.45, Y_SLOT * 0.45)
    ax.axis("off")
    canvas.draw()  # boxes have sizes only once drawn
    to_data = ax.transData.inverted()

    def extent(artist: Any) -> Box:
        (x0, y0), (x1, y1) = to_data.transform(artist.get_window_extent(canvas.get_renderer()).get_points())
        return float(x0), float(y0), float(x1), float(y1)

    boxes = {n: extent(t.get_bbox_patch()) for n, t in texts.items()}
    styles = {"data": ("solid", "#333333"), "version": ("dashed", "#1f78b4"), "order": ("dotted", "#777777")}
    routed: list[tuple[str, str, str, list[Point], str, Any]] = []
    for (u, v, kind), labels in _merged_edges(graph).items():
        points = [xy[u], *(xy[d] for d in route[(u, v, kind)]), xy[v]]
        if len(points) == 2 and (v, u, "data") in route:  # against a data edge: step aside, not on top
            (xa, ya), (xb, yb) = points
            points.insert(1, ((xa + xb) / 2 + X_SLOT * 0.3, (ya + yb) / 2))
        points[0] = _clip(points[0], points[1], boxes[u])
        points[-1] = _clip(points[-1], points[-2], boxes[v])
        style, colour = styles[kind]
        ax.plot(*zip(*points[:-1], strict=True), linestyle=style, color=colour, lw=1.0, zorder=1)
        ax.annotate(
            "", xy=points[-1], xytext=points[-2], zorder=1,
            arrowprops={"arrowstyle": "-|>", "linestyle": style, "color": colour, "lw": 1.0,
                        "shrinkA": 0, "shrinkB": 0, "mutation_scale": 9},
        )  # fmt: skip
        label, text = "", None
        if kind == "data":  # keys at the middle of the first leg, below the producer's box
            label = "\n".join(labels)
            (xa, ya), (xb, yb) = points[0], points[1]
            text = ax.text(
                (xa + xb) / 2, (ya + yb) / 2, label, ha="center", va="center", fontsize=5.5, zorder=4,
                gid=f"edge-label:{u}->{v}", color="#333333",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
            )  # fmt: skip
        routed.append((u, v, kind, points, label, text))
    canvas.draw()  # once more: the labels' boxes
    drawn = [
        DrawnEdge(u, v, kind, tuple(points), label, extent(text.get_bbox_patch()) if text else None)
        for u, v, kind, points, label, text in routed
    ]
    ax.legend(
        handles=[
            Line2D([], [], color="#333333", linestyle="solid", label="data (labelled with its keys)"),
            Line2D([], [], color="#1f78b4", linestyle="dashed", label="version (iteration i -> i+1)"),
            Line2D([], [], color="#777777", linestyle="dotted", label="order (read before train)"),
        ],
        loc="lower right",
        fontsize=7,
        frameon=False,
    )
    ax.set_title(graph.spec.source or "rlflow graph", fontsize=9)
    return Drawing(fig, boxes, drawn)


def write_drawings(graph: Graph, prefix: str | Path) -> list[Path]:
    """Write ``PREFIX.png``, ``PREFIX.svg`` (:func:`draw`) and ``PREFIX.dot`` (:func:`to_dot`); returns
    the paths.

    Raises:
        GraphError: if the files cannot be written.
    """
    prefix = Path(prefix)
    fig = draw(graph).figure
    paths = [prefix.with_name(prefix.name + ext) for ext in (".png", ".svg", ".dot")]
    try:
        if prefix.parent != Path():
            prefix.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(paths[0], dpi=130, bbox_inches="tight")
        fig.savefig(paths[1], bbox_inches="tight")
        paths[2].write_text(to_dot(graph, prefix.name))
    except OSError as e:
        raise GraphError(f"cannot write drawings to {prefix}.*: {e}") from None
    return paths
