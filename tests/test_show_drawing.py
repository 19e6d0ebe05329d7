"""`rlflow show`'s PNG/SVG (dataflow/draw.py; issue 14, item 7): data edges carry their keys as labels, as
the README says, and no edge crosses a node's box.

Reproduce the old failure: ``rlflow show examples/ppo.yaml`` drew unlabelled data edges and straight
edges through the boxes of the layer between.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from matplotlib.path import Path as MplPath
from matplotlib.transforms import Bbox

from rlflow.dataflow.draw import Drawing, draw, write_drawings
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.loader import load_graph

EXAMPLES = [*sorted(Path("examples").glob("*.yaml")), Path("examples/arith/ppo.yaml")]


def _hits(points: tuple[tuple[float, float], ...], box: tuple[float, float, float, float]) -> bool:
    return len(points) >= 2 and MplPath(points).intersects_bbox(Bbox.from_extents(*box), filled=False)


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda p: str(p))
def drawing(request: pytest.FixtureRequest) -> tuple[Graph, Drawing]:
    graph = load_graph(request.param)
    return graph, draw(graph)


def test_edges_cross_no_box(drawing: tuple[Graph, Drawing]) -> None:
    _, drawn = drawing
    assert drawn.edges and drawn.boxes
    for edge in drawn.edges:
        for name, box in drawn.boxes.items():
            # An edge leaves its source's box and enters its target's at their rims; no other box is touched,
            # and between the rims it stays out of its own two boxes as well.
            body = edge.points[1:-1] if name in (edge.u, edge.v) else edge.points
            assert not _hits(body, box), f"{edge.u} -> {edge.v} ({edge.kind}) crosses the box of {name}"


def test_data_edges_are_labelled_with_their_keys(drawing: tuple[Graph, Drawing]) -> None:
    graph, drawn = drawing
    expected: dict[tuple[str, str], set[str]] = {}
    for u, v, d in graph.edges("data"):
        expected.setdefault((u, v), set()).add(d["key"])
    labelled = {(e.u, e.v): set(e.label.split("\n")) for e in drawn.edges if e.kind == "data"}
    assert labelled == expected
    for edge in drawn.edges:
        if edge.kind != "data":
            continue
        assert edge.label_box is not None
        for name, box in drawn.boxes.items():
            assert not _overlap(edge.label_box, box), f"label of {edge.u} -> {edge.v} covers box {name}"


def test_svg_has_a_label_per_data_edge(tmp_path: Path) -> None:
    graph = load_graph("examples/ppo.yaml")
    png, svg, _dot = write_drawings(graph, tmp_path / "ppo")
    ids = {html.unescape(i) for i in re.findall(r'id="edge-label:([^"]+)"', svg.read_text())}
    assert ids == {f"{u}->{v}" for u, v, _ in graph.edges("data")}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
