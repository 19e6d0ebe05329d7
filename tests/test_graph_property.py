"""Property: random and malformed graph files give a valid Graph or an RlflowError with a message —
never another exception type, never a hang (each example is deadline-bounded)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.dataflow import Graph, RlflowError, loads_graph
from tests.conftest import make_catalogue_registry

REGISTRY = make_catalogue_registry()
EXAMPLES = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(Path("examples").glob("*.yaml"))}
SETTINGS = settings(
    max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 1, 2, 3, 7, 8, 10**18, 2**64, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "auto", "eight", "0-3", "0-99999999", "d2t2p1m4", "d8t1p1m2", "${nope}",
                     "${algorithm.n_samples}", "${models}", "???", "generate", "train", "actor"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8) | scalars, inner, max_size=4),
    ),
    max_leaves=12,
)


def outcome(text: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            g = loads_graph(text, source="h.yaml", registry=REGISTRY)
        except RlflowError as e:
            assert str(e).strip(), f"{type(e).__name__} without a message"
            return
    assert isinstance(g, Graph) and g.execution_order()


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += paths(v, (*prefix, i))
    return out


def apply(tree: Any, path: tuple[Any, ...], op: str, value: Any) -> None:
    parent = tree
    for k in path[:-1]:
        parent = parent[k]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[f"{last}x" if isinstance(last, str) else value] = parent.pop(last)
    else:
        parent[last] = value


@SETTINGS
@given(values)
def test_random_structures(raw: Any) -> None:
    outcome(yaml.safe_dump(raw))


@SETTINGS
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    outcome(text)


@SETTINGS
@given(st.sampled_from(sorted(EXAMPLES)), st.data())
def test_mutated_examples(name: str, data: st.DataObject) -> None:
    tree = copy.deepcopy(EXAMPLES[name])
    for _ in range(data.draw(st.integers(1, 3))):
        candidates = paths(tree)
        if not candidates:
            break
        path = data.draw(st.sampled_from(candidates))
        op = data.draw(st.sampled_from(["delete", "replace", "rename"]))
        apply(tree, path, op, data.draw(values))
    outcome(yaml.safe_dump(tree))


@SETTINGS
@given(st.sampled_from(["ppo", "grpo", "rloo", "remax"]), st.data())
def test_rewired_examples(name: str, data: st.DataObject) -> None:
    """Rebind an input to any key, including a downstream node's output (cycles) or an unknown one."""
    tree = copy.deepcopy(EXAMPLES[name])
    keys = sorted({k for n in tree["nodes"].values() for k in _keys(n.get("outputs"))} | {"nokey", "answer"})
    node = data.draw(st.sampled_from(sorted(tree["nodes"])))
    inputs = tree["nodes"][node]["inputs"]
    if isinstance(inputs, list) and inputs:
        inputs[data.draw(st.integers(0, len(inputs) - 1))] = data.draw(st.sampled_from(keys))
    if data.draw(st.booleans()):
        tree["nodes"][node]["batch_size"] = data.draw(st.integers(1, 64))
        tree["nodes"][node]["mini_batches"] = data.draw(st.integers(1, 8))
    outcome(yaml.safe_dump(tree))


def _keys(outputs: Any) -> list[str]:
    if isinstance(outputs, dict):
        return [v for v in outputs.values() if isinstance(v, str)]
    return [v for v in outputs or [] if isinstance(v, str)]
