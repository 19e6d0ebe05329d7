"""The one layout rule (``rlflow.dataflow.layout_rules``) and its callers; the planner's import hygiene.

Tier 1: the rule's verdicts, derived by hand. Tier 3: over a grid of layouts, the graph's plan checks, the
cost model, the search, the runtime's plan view and its tensor-parallel check on a built model agree with
the rule (no process starts).
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.layout_rules import TP_FIELDS, layout_problem, model_config, node_layout_problem
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.plan_spec import Layout, NodePlacement

ROOT = Path(__file__).resolve().parent.parent
SCHEDULERS = ROOT / "schedulers"
CFG = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 12, "vocab_size": 20}
CFG = {**CFG, "num_hidden_layers": 2}


# -- tier 1 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "rows", "mini", "group", "layout", "key"),
    [
        ("generate", 8, 1, 4, Layout(1, 1, 2, 1), None),  # the built-in loop runs on pipeline stages
        ("train", 8, 1, 1, Layout(1, 3, 1, 1), "num_attention_heads"),  # 4 heads / tp 3
        ("train", 8, 1, 1, Layout(1, 4, 1, 1), "num_key_value_heads"),  # heads 4 ok, kv heads 2 / tp 4
        ("train", 8, 1, 1, Layout(1, 1, 3, 1), "num_hidden_layers"),  # 2 layers < pp 3
        ("train", 9, 2, 1, Layout(1, 1, 1, 1), "mini_batches"),  # 9 rows / 2 mini-batches
        ("train", 8, 2, 1, Layout(3, 1, 1, 1), "dp"),  # 8 / 2 = 4 rows per mini-batch / dp 3
        ("train", 8, 2, 1, Layout(2, 1, 1, 4), "micro_batches"),  # 4 / dp 2 = 2 rows per rank / m 4
        ("train", 16, 2, 4, Layout(4, 1, 1, 1), "group_size"),  # 8 / dp 4 = 2 rows: half a group of 4
        ("generate", 16, 2, 4, Layout(4, 1, 1, 1), None),  # prompts: each rank samples its own groups
        ("inference", 16, 1, 4, Layout(4, 2, 2, 1), None),  # 4 rows per rank = one group; tp 2, pp 2 fit
    ],
)
def test_rule_names_the_key(
    kind: str, rows: int, mini: int, group: int, layout: Layout, key: str | None
) -> None:
    why = layout_problem(kind, rows, mini, group, CFG, layout, "actor")
    assert (why.key if why is not None else None) == key, why


def test_rule_messages() -> None:
    why = layout_problem("train", 8, 2, 1, CFG, Layout(2, 1, 1, 4), "actor")
    assert why == "8 rows do not divide into dp=2 × 2 mini-batches × 4 micro-batches" and why.value == 8
    why = layout_problem("train", 8, 1, 1, CFG, Layout(1, 3, 1, 1), "actor")
    assert why == "num_attention_heads=4 is not divisible by tp=3" and why.value == 4
    assert layout_problem("train", 8, 1, 1, CFG, Layout(1, 1, 3, 1), "actor") == (
        "pp=3 pipeline stages but model 'actor' has 2 layers"
    )
    why = layout_problem("generate", 8, 1, 1, None, Layout(1, 1, 2, 1), engine="vllm")
    assert why is not None and why.key == "pp" and "vLLM engine runs without pipeline stages" in why
    assert "engine: builtin" in why  # the way out
    assert layout_problem("generate", 8, 1, 1, None, Layout(1, 1, 2, 1), engine="builtin") is None
    # an agent's stages would each step their own environments: it stays at pp = 1
    why = layout_problem("generate", 8, 1, 1, None, Layout(1, 1, 2, 1), function="agent_generate")
    assert why is not None and why.key == "pp" and "agent_generate node cannot run on pipeline stages" in why
    assert layout_problem("generate", 8, 1, 1, None, Layout(2, 1, 1, 1), function="agent_generate") is None
    # no config (a model known by its path): only the rows are checked
    assert layout_problem("train", 8, 1, 1, None, Layout(1, 3, 5, 1)) is None
    assert layout_problem("train", 8, 1, 1, {**CFG, "vocab_size": True}, Layout(1, 2, 1, 1)) is None


# -- tier 3: the callers agree -----------------------------------------------------------------------------
def _grid() -> list[Layout]:
    return [
        Layout(dp, tp, pp, m)
        for dp, tp, pp, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4), (1, 2, 3), (1, 2, 4))
        if dp * tp * pp <= 16
    ]


@pytest.mark.parametrize("example", ["grpo.yaml", "ppo.yaml"])
def test_graph_cost_search_and_runtime_agree_with_the_rule(example: str) -> None:
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.planner.cluster_files import load_cluster
    from rlflow.schedulers.planner.cost import layout_problem as cost_layout_problem
    from rlflow.schedulers.planner.graph_problem import problem_from_graph
    from rlflow.schedulers.planner.search import Searcher
    from rlflow.schedulers.runtime.distributed.layouts import check_tensor_parallel
    from rlflow.schedulers.runtime.distributed.placement import PlanView

    base = load_graph(str(ROOT / "examples" / example), ["run.devices=16", "plan={}"])
    problem = problem_from_graph(base, prompt_len=8)
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=16)
    searcher = Searcher(problem, cluster)
    keys: Counter[str] = Counter()
    for node in problem.nodes:
        config = model_config(base, node.model)
        module = build_model(config=dict(config or {}), seed=0)
        for layout in _grid():
            why = node_layout_problem(base, node.name, layout)
            keys[why.key if why is not None else "ok"] += 1
            # the graph's plan checks reject exactly what the rule rejects
            plan = {n: NodePlacement((0,), Layout()) for n in base.spec.nodes}
            plan[node.name] = NodePlacement(tuple(range(layout.size)), layout)
            try:
                planned = Graph.from_spec(dataclasses.replace(base.spec, plan=plan), base.registry)
            except PlanError as err:
                assert why is not None, f"{node.name} {layout}: graph rejects, rule accepts: {err}"
            else:
                assert why is None, f"{node.name} {layout}: graph accepts, rule rejects: {why}"
                PlanView.of(planned)  # the runtime's plan view accepts what the graph accepts
            # the cost model prices exactly what the rule allows
            assert (cost_layout_problem(problem.models[node.model], node, layout) is None) == (why is None)
            # the built model splits tp ways exactly when the rule's tensor-parallel checks pass
            tp_ok = layout_problem("train", 1, 1, 1, config, Layout(1, layout.tp, 1, 1)) is None
            try:
                check_tensor_parallel(module, layout.tp, node.model)
            except PlanError:
                assert not tp_ok
            else:
                assert tp_ok
        for size in (1, 2, 3, 4, 8, 16):  # the search never proposes a layout the rule rejects
            for layout in searcher.layouts(node, size):
                assert node_layout_problem(base, node.name, layout) is None, (node.name, layout)
    seen = set(keys)
    assert {"ok", "num_attention_heads", "num_hidden_layers", "dp", "micro_batches"} <= seen, keys
    if example == "grpo.yaml":
        assert "group_size" in seen, keys


# -- import hygiene ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fitting_a_profile_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import rlflow.schedulers.planner.calibration, rlflow.dataflow.layout_rules\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('rlflow.schedulers.runtime')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_two_scheduler_modules_share_a_file_name() -> None:
    paths = [p.relative_to(SCHEDULERS) for p in SCHEDULERS.rglob("*.py") if p.name != "__init__.py"]
    names = Counter(p.name for p in paths)
    clashes = [str(p) for p in paths if names[p.name] > 1]
    assert clashes == []


def test_tp_fields_are_the_runtimes() -> None:
    from rlflow.schedulers.planner.shapes import ModelShape

    assert {f.name for f in dataclasses.fields(ModelShape)} >= set(TP_FIELDS)


def test_generation_on_stages_needs_one_attention_type() -> None:
    """Qwen2 with ``use_sliding_window`` (sliding layers from ``max_window_layers`` on; Hugging Face derives
    its ``layer_types``) cannot generate on pipeline stages: the graph's rule and the planner's refuse it
    (fresh-user finding: it passed validate and failed inside a worker). Mistral's sliding window covers
    every layer (one type) and an explicit uniform ``layer_types`` too: both pass; training is unaffected."""
    from rlflow.schedulers.planner.cost import layout_problem as cost_layout_problem
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.shapes import ModelShape

    qwen = {"model_type": "qwen2", **CFG, "num_hidden_layers": 4, "use_sliding_window": True,
            "max_window_layers": 2, "sliding_window": 8}  # fmt: skip
    why = layout_problem("generate", 8, 1, 1, qwen, Layout(1, 1, 2, 1), "actor")
    assert why is not None and why.key == "layer_types" and why.value == 2, why
    assert "mixes full_attention, sliding_attention" in why
    assert layout_problem("train", 8, 1, 1, qwen, Layout(1, 1, 2, 1), "actor") is None
    assert layout_problem("generate", 8, 1, 1, qwen, Layout(2, 1, 1, 1), "actor") is None
    mistral = {"model_type": "mistral", **CFG, "sliding_window": 8}
    for one_kind in (
        {**qwen, "use_sliding_window": False},
        mistral,
        {**CFG, "layer_types": ["full_attention"] * 2},
    ):
        assert layout_problem("generate", 8, 1, 1, one_kind, Layout(1, 1, 2, 1), "actor") is None, one_kind
    shape = ModelShape.from_config({**qwen, "hidden_size": 16})
    assert shape.layer_types == ("full_attention", "sliding_attention")
    gen = PlanNode("gen", "m", "generate", 8, 4, 4)
    assert "one attention type" in (cost_layout_problem(shape, gen, Layout(1, 1, 2, 1)) or "")
