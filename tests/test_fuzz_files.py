"""Property: mutated cluster, plan, profile (Parquet) and data (JSONL/Parquet) files give a value or one of
rlflow's own errors (``RlflowError``, with a message) — never a raw Python exception such as the
``OverflowError`` a rate of 10^400 once raised in the cluster reader (issue 14, item 8). Graph files have
their own property tests (``test_graph_property.py``).

Reproduce: ``python -m pytest -q tests/test_fuzz_files.py``.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rlflow.dataflow.data import PromptStream, load_rows
from rlflow.dataflow.errors import RlflowError
from rlflow.schedulers.planner.calibration import apply_profile, hardware_key
from rlflow.schedulers.planner.cluster_files import PRESETS, load_cluster
from rlflow.schedulers.planner.plans import load_plan
from tests.test_graph_property import apply, paths

SETTINGS = settings(
    max_examples=60,
    deadline=3000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
CLUSTERS = {
    p.name: yaml.safe_load(p.read_text()) for p in sorted(PRESETS.iterdir()) if p.name.endswith(".yaml")
}
PLAN = {
    "actor_gen": {"devices": "0-3", "layout": "d2t2p1m1"},
    "actor_train": {"devices": [0, 1, 2, 3], "layout": "d4t1p1m2"},
    "ref_inf": {"devices": 0, "layout": "d1t1p1m1"},
}
TOKENIZER = Path(__file__).resolve().parent.parent / "examples" / "arith" / "tokenizer"

huge = st.sampled_from([10**400, -(10**400), 2**64, -(2**63) - 1, 10**18, 10**4000])
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    huge,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "1e400", "nan", "-inf", "80e9", "0-3", "0-99999999", "d2t2p1m4", "d" + "9" * 5000,
                     "9" * 5000 + "-" + "9" * 5001, "1.5", "eight"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8) | scalars, inner, max_size=4)
    ),
    max_leaves=12,
)
deep = st.integers(1, 200).map(lambda n: json.loads("[" * n + "]" * n))


def mutate(tree: Any, data: st.DataObject) -> Any:
    """Up to 3 deletions, replacements (any value: huge ints, NaN/inf, strings, deep nesting) or renames."""
    tree = copy.deepcopy(tree)
    for _ in range(data.draw(st.integers(1, 3))):
        candidates = paths(tree)
        if not candidates:
            break
        path = data.draw(st.sampled_from(candidates))
        op = data.draw(st.sampled_from(["delete", "replace", "rename"]))
        apply(tree, path, op, data.draw(values | deep))
    return tree


def dump(tree: Any) -> str:
    return yaml.safe_dump(tree, width=10**6)


def expect_rlflow_error(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except RlflowError as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        return None


# ---- cluster files -----------------------------------------------------------------------------------


@SETTINGS
@given(st.sampled_from(sorted(CLUSTERS)), st.data())
def test_mutated_cluster_files(tmp_path: Path, name: str, data: st.DataObject) -> None:
    path = tmp_path / name
    path.write_text(dump(mutate(CLUSTERS[name], data)))
    cluster = expect_rlflow_error(load_cluster, path)
    if cluster is not None:  # what was read is usable: finite, positive capacity
        assert math.isfinite(cluster.memory_capacity) and cluster.memory_capacity > 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("device.peak_flops", 10**400),
        ("device.memory_bytes", 10**400),
        ("intra_host.bandwidth", -(10**400)),
        ("devices_per_host", 10**400),
        ("hosts", 10**4000),
        ("efficiency.matmul", 10**400),
        ("overheads.node_s", 10**400),
    ],
    ids=lambda v: v if isinstance(v, str) else "huge",
)
def test_cluster_huge_number_names_the_key(tmp_path: Path, key: str, value: int) -> None:
    """The issue's case: an integer too large for a float is a PlanError naming file and key."""
    tree = copy.deepcopy(CLUSTERS["h100-8x.yaml"])
    section, _, leaf = key.rpartition(".")
    (tree.setdefault(section, {}) if section else tree)[leaf] = value
    path = tmp_path / "c.yaml"
    path.write_text(dump(tree))
    with pytest.raises(RlflowError, match=re.escape(f"c.yaml: {key}:")):
        load_cluster(path)


def test_yaml_integer_beyond_python_str_limit(tmp_path: Path) -> None:
    """A 5000-digit integer in YAML text: the YAML parser itself raises ValueError (Python's int string
    limit); the readers turn it into their own error naming the file."""
    text = dump(CLUSTERS["h100-8x.yaml"]) + "cores_per_host: " + "9" * 5000 + "\n"
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(RlflowError, match=r"c\.yaml: cannot read cluster file"):
        load_cluster(tmp_path / "c.yaml")
    (tmp_path / "p.yaml").write_text("actor_gen: {devices: " + "9" * 5000 + ", layout: d1t1p1m1}\n")
    with pytest.raises(RlflowError, match=r"p\.yaml: cannot read plan"):
        load_plan(tmp_path / "p.yaml")


def test_yaml_syntax_errors_point_into_the_file(tmp_path: Path) -> None:
    """A plan or cluster file that is not YAML: the parser's mark names the file and the line, not
    ``<unicode string>`` (fresh-user finding)."""
    (tmp_path / "p.yaml").write_text("actor_gen: {devices: 0-1, layout: d2\nref: [\n")
    with pytest.raises(RlflowError) as info:
        load_plan(tmp_path / "p.yaml")
    assert f'in "{tmp_path / "p.yaml"}", line 2, column 4' in str(info.value), info.value
    assert "unicode string" not in str(info.value)
    (tmp_path / "c.yaml").write_text("device: {peak_flops: 1\nhosts: [\n")
    with pytest.raises(RlflowError) as info:
        load_cluster(tmp_path / "c.yaml")
    assert f'in "{tmp_path / "c.yaml"}", line 2' in str(info.value) and "unicode string" not in str(
        info.value
    )


# ---- plan files --------------------------------------------------------------------------------------


@SETTINGS
@given(st.data())
def test_mutated_plan_files(tmp_path: Path, data: st.DataObject) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(dump(mutate(PLAN, data)))
    expect_rlflow_error(load_plan, path)


@pytest.mark.parametrize(
    "entry",
    [
        {"devices": "9" * 5000, "layout": "d1t1p1m1"},
        {"devices": "0-" + "9" * 5000, "layout": "d1t1p1m1"},
        {"devices": 0, "layout": "d" + "9" * 5000},
        {"devices": 10**400, "layout": "d1t1p1m1"},
    ],
    ids=["device", "range", "layout", "int"],
)
def test_plan_huge_numbers_name_the_node(tmp_path: Path, entry: dict[str, Any]) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(dump({"actor_gen": entry}))
    with pytest.raises(RlflowError, match=r"plan\.yaml: plan\.actor_gen\.(devices|layout)"):
        load_plan(path)


# ---- profiles (Parquet) ------------------------------------------------------------------------------

CLUSTER = load_cluster("cpu-local")
MODEL = "h32-i64-l1-a4-kv2-v64"
PROFILE_ROWS: list[dict[str, Any]] = [
    *({"op": "forward", "batch": 1, "seq": t, "flops": 1e9, "seconds": 0.01 * t} for t in (16, 64)),
    {"op": "decode", "batch": 1, "seq": 8, "bytes": 10**8, "seconds": 0.05},
    *({"op": "all_reduce", "group_size": 2, "bytes": b, "seconds": 1e-4 + b / 1e9} for b in (10**3, 10**6)),
    *({"op": "optimizer", "count": c, "bytes": b, "seconds": 1e-4 * c + b / 4e9}
      for c, b in ((4, 10**6), (32, 64 * 10**6))),
    {"op": "dispatch", "bytes": 0, "seconds": 1e-4},
    {"op": "dispatch", "bytes": 10**6, "seconds": 2e-3},
    {"op": "digest", "bytes": 10**9, "seconds": 2.0},
    *({"op": "parallel", "group_size": n, "seconds": t} for n, t in ((1, 1e-3), (2, 1.5e-3))),
    {"op": "model_forward", "batch": 4, "seq": 8, "seconds": 0.05},
    {"op": "runtime_train", "batch": 4, "seq": 8, "count": 4, "steps": 2, "first_pass": True, "seconds": 1.0},
    {"op": "runtime_gap", "seconds": 1e-3},
]  # fmt: skip
PROFILE_BASE = {"batch": 0, "seq": 0, "group_size": 1, "count": 1, "flops": 0.0, "bytes": 0, "threads": 1,
                "cores": 2, "hardware": hardware_key(CLUSTER), "model": MODEL}  # fmt: skip
PROFILE_COLUMNS = sorted({k for r in PROFILE_ROWS for k in r} | set(PROFILE_BASE))
column_values = st.one_of(
    st.sampled_from([0, -1, 2**63 - 1, -(2**63)]).map(lambda v: ("int", v)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda v: ("float", v)),
    st.sampled_from(["", "1e400", "nan", "x", "forward", "all_reduce", "9" * 400]).map(lambda v: ("str", v)),
    st.none().map(lambda v: ("null", v)),
    st.booleans().map(lambda v: ("bool", v)),
)


@SETTINGS
@given(st.data())
def test_mutated_profiles(tmp_path: Path, data: st.DataObject) -> None:
    """Columns replaced (in one row or all: one Arrow type per column), dropped or added."""
    rows = [{**PROFILE_BASE, **r} for r in PROFILE_ROWS]
    for _ in range(data.draw(st.integers(1, 3))):
        column = data.draw(st.sampled_from(PROFILE_COLUMNS))
        op = data.draw(st.sampled_from(["row", "column", "drop"]))
        if op == "drop":
            for r in rows:
                r.pop(column, None)
            continue
        kind, value = data.draw(column_values)
        targets = [data.draw(st.sampled_from(rows))] if op == "row" else rows
        for r in targets:
            r[column] = value
        if op == "row":  # keep one Arrow type per column: the others take a value of the same kind
            same = {"int": 1, "float": 1.0, "str": "1", "null": None, "bool": True}[kind]
            for r in rows:
                if r is not targets[0] and column in r:
                    r[column] = same if not isinstance(r[column], type(value)) else r[column]
    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, OverflowError, TypeError):
        assume(False)  # not a table Parquet can hold
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    fitted = expect_rlflow_error(apply_profile, CLUSTER, path)
    if fitted is not None:
        assert math.isfinite(fitted.efficiency.matmul) and fitted.efficiency.matmul > 0


# ---- data files (JSONL / Parquet) ------------------------------------------------------------------


def _tokenizer() -> Any:
    from rlflow.nodes.tokenizers import load_tokenizer

    return load_tokenizer(TOKENIZER)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30), huge,
              st.floats(allow_nan=False), st.text(max_size=10), st.sampled_from(["12+34=", "", "99"])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
line = st.one_of(
    st.dictionaries(st.sampled_from(["prompt", "answer", "x"]), json_values, max_size=3).map(json.dumps),
    st.text(max_size=30),
    deep.map(json.dumps),
    st.sampled_from(['{"prompt": 1e400, "answer": "1"}', '{"prompt": NaN}', '{"prompt": "1+1="', "{}", ""]),
)


def _read_and_batch(path: Path, tokenizer: Any) -> None:
    rows = load_rows(path, fields={"prompt": "prompt", "answer": "answer"})
    stream = PromptStream(rows, seed=0, tokenizer=tokenizer, tokenize=("prompt",))
    stream.next_batch(min(2, len(rows)))


@SETTINGS
@given(st.lists(line, min_size=1, max_size=5))
def test_mutated_jsonl_data(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    expect_rlflow_error(_read_and_batch, path, TOK)


@SETTINGS
@given(st.lists(st.dictionaries(st.sampled_from(["prompt", "answer"]), json_values, max_size=2), min_size=1,
                max_size=4))  # fmt: skip
def test_mutated_parquet_data(tmp_path: Path, records: list[dict[str, Any]]) -> None:
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowException, OverflowError, TypeError, ValueError):
        assume(False)  # not a table Parquet can hold
    path = tmp_path / "d.parquet"
    try:
        pq.write_table(table, path)
    except (pa.ArrowException, ValueError):
        assume(False)
    expect_rlflow_error(_read_and_batch, path, TOK)


TOK = _tokenizer()


def test_an_unknown_cluster_preset_suggests_the_close_one() -> None:
    """``--cluster h100``: the presets are listed and the close one is suggested (fresh-user finding)."""
    with pytest.raises(
        RlflowError, match=r"cluster 'h100': no such file or preset \(did you mean 'h100-8x'\?\)"
    ):
        load_cluster("h100")
