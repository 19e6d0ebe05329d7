"""Text and drawings of a :class:`~dataflow.graph.Graph`: execution order, Graphviz DOT, PNG and SVG.

Edge styles everywhere: data edges solid and labelled by key, version edges dashed, order edges dotted.
Drawings use matplotlib (Agg, no display) with networkx; the DOT text is written directly (no Graphviz
install needed to produce it; ``dot -Tpng`` renders it where Graphviz exists).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import networkx as nx

from dataflow.errors import GraphError
from dataflow.graph import DATA, Graph

__all__ = ["describe", "layers", "to_dot", "write_drawings"]

KIND_COLORS = {"data": "#bebada", "generate": "#8dd3c7", "inference": "#ffffb3", "train": "#fb8072"}
EDGE_STYLES = {"data": "solid", "version": "dashed", "order": "dotted"}


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
    rows = layers(graph)
    width = max(len(r) for r in rows)
    for depth, layer in enumerate(rows):
        for j, n in enumerate(layer):
            pos[n] = ((j - (len(layer) - 1) / 2) * 3.0, -depth * 2.0)
    fig = Figure(figsize=(max(6.0, 2.8 * width), max(4.0, 1.9 * len(rows))))
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
        edgelist = [(u, v) for (u, v, k) in merged if k == kind]
        if edgelist:
            nx.draw_networkx_edges(
                simple, pos, edgelist=edgelist, ax=ax, style=style, edge_color=color, arrows=True,
                arrowsize=14, node_size=2600, connectionstyle=f"arc3,rad={rad}",
            )  # fmt: skip
    data_labels = {(u, v): "\n".join(ls) for (u, v, k), ls in merged.items() if k == "data"}
    nx.draw_networkx_edge_labels(simple, pos, edge_labels=data_labels, ax=ax, font_size=6, rotate=False)
    colors = [KIND_COLORS["data" if n == DATA else graph.node(n).kind] for n in simple.nodes]
    nx.draw_networkx_nodes(simple, pos, ax=ax, node_color=colors, node_size=2600, edgecolors="#333333")
    nx.draw_networkx_labels(simple, pos, labels={n: _node_label(graph, n) for n in pos}, ax=ax, font_size=6)
    ax.legend(
        handles=[
            Line2D([], [], color="#333333", linestyle="solid", label="data (key)"),
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
