"""Text and drawings of a :class:`~rlflow.dataflow.graph.Graph`: execution order, Graphviz DOT, PNG and SVG.

Edge styles everywhere: data edges solid, version edges dashed, order edges dotted. In DOT every data edge
is labelled by its keys; in the PNG/SVG each box lists the keys its node produces instead (edge labels
of a six-node graph overlap), and edges that skip a layer bend around the boxes between. Drawings use
matplotlib (Agg, no display) with networkx; the DOT text is written directly (no Graphviz
install needed to produce it; ``dot -Tpng`` renders it where Graphviz exists).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import networkx as nx

from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import DATA, Graph

__all__ = ["describe", "layers", "to_dot", "write_drawings"]

KIND_COLORS = {"data": "#bebada", "generate": "#8dd3c7", "inference": "#ffffb3", "train": "#fb8072"}
EDGE_STYLES = {"data": "solid", "version": "dashed", "order": "dotted"}


def _node_label(graph: Graph, name: str) -> str:
    if name == DATA:
        return "data"
    node = graph.node(name)
    where = f" @ {node.model}" if node.model else ""
    return f"{name}\n{node.kind}: {node.function}{where}"


def _box_label(graph: Graph, name: str) -> str:
    """A PNG box: the node label, then the keys the node (or the data set) produces, wrapped."""
    keys = sorted(k for k, producer in graph.keys().items() if producer == name)
    lines: list[str] = []
    for key in keys:
        if lines and len(lines[-1]) + len(key) < 30:
            lines[-1] += f", {key}"
        else:
            lines.append(key)
    produced = "\n".join(f"→ {line}" if i == 0 else f"   {line}" for i, line in enumerate(lines))
    return _node_label(graph, name) + (f"\n{produced}" if produced else "")


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
    return f"devices {mesh} {p.layout}"


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
            lines += [f"  {u} -> {v} (model {d['model']})" for u, v, d in edges]
    return "\n".join(lines)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _merged_edges(graph: Graph) -> dict[tuple[str, str, str], list[str]]:
    """(u, v, kind) -> labels; parallel data edges between two nodes share one arrow."""
    merged: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for u, v, d in graph.edges():
        kind = d["kind"]
        label = d["key"] if kind == "data" else f"{kind} ({d['model']})"
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


def write_drawings(graph: Graph, prefix: str | Path) -> list[Path]:
    """Write ``PREFIX.png``, ``PREFIX.svg`` and ``PREFIX.dot``; returns the paths.

    Raises:
        GraphError: if the files cannot be written.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    prefix = Path(prefix)
    pos: dict[str, tuple[float, float]] = {}
    depth_of: dict[str, int] = {}
    rows = layers(graph)
    width = max(len(r) for r in rows)
    for depth, layer in enumerate(rows):
        for j, n in enumerate(layer):
            pos[n] = ((j - (len(layer) - 1) / 2) * 3.6, -depth * 2.2)
            depth_of[n] = depth
    fig = Figure(figsize=(max(6.0, 3.2 * width), max(4.0, 2.0 * len(rows))))
    ax = fig.add_subplot()
    simple = nx.DiGraph()
    simple.add_nodes_from(pos)
    merged = _merged_edges(graph)
    for u, v, _ in merged:
        simple.add_edge(u, v)
    for kind, style, rad, color in (
        ("data", "solid", 0.0, "#333333"),
        ("version", "dashed", 0.35, "#1f78b4"),
        ("order", "dotted", -0.25, "#777777"),
    ):
        for bend in (False, True):  # edges skipping a layer bend so they do not cross the boxes between
            edgelist = [
                (u, v)
                for (u, v, k) in merged
                if k == kind and (kind == "data" and abs(depth_of[v] - depth_of[u]) > 1) == bend
            ]
            if edgelist:
                nx.draw_networkx_edges(
                    simple, pos, edgelist=edgelist, ax=ax, style=style, edge_color=color, arrows=True,
                    arrowsize=12, node_size=3600, connectionstyle=f"arc3,rad={0.22 if bend else rad}",
                )  # fmt: skip
    for n, (x, y) in pos.items():
        kind = "data" if n == DATA else graph.node(n).kind
        ax.text(
            x, y, _box_label(graph, n), ha="center", va="center", fontsize=6.5, zorder=3,
            bbox={"boxstyle": "round,pad=0.45", "fc": KIND_COLORS[kind], "ec": "#333333"},
        )  # fmt: skip
    ax.legend(
        handles=[
            Line2D([], [], color="#333333", linestyle="solid", label="data (→ keys produced)"),
            Line2D([], [], color="#1f78b4", linestyle="dashed", label="version (iteration i -> i+1)"),
            Line2D([], [], color="#777777", linestyle="dotted", label="order (read before train)"),
        ],
        loc="lower right",
        fontsize=7,
        frameon=False,
    )
    ax.set_title(graph.spec.source or "rlflow graph", fontsize=9)
    ax.margins(0.15)
    ax.axis("off")
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
