"""The planner prices LoRA models as the runtime runs them (issue 35, "Planner"): the adapter count is the
one ``peft`` builds, a LoRA train node holds no gradients or Adam state for its frozen base, its backward
computes no weight gradients for the base, a weight sync moves the adapters only, a base view (``base_of``)
placed with its LoRA model holds no weights, and the plan search chooses layouts accordingly.

Reproduce: ``python -m pytest -q tests/test_planner_lora.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest

from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import LoraSpec
from rlflow.schedulers.planner.adapters import LoraShape, adapter_count, adapter_params, lora_backward_flops
from rlflow.schedulers.planner.call_cost import micro_batch_work, token_flops, train_cost
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel, layout_problem
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.memory_cost import GRAD_BYTES, OPTIM_BYTES
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory, node_memory
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.shapes import MODEL_PRESETS, ModelShape
from rlflow.schedulers.planner.zero_cost import ZeroConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/lora/grpo.yaml"
BASE = {"vocab_size": 19, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
CASES: dict[str, tuple[dict[str, Any], str, LoraSpec]] = {
    "all-linear, lm head": ({**BASE, "model_type": "llama"}, "lm", LoraSpec(rank=4)),
    "all-linear, tied lm head": (
        {**BASE, "model_type": "llama", "tie_word_embeddings": True}, "lm", LoraSpec(rank=3)
    ),
    "lm_head named, untied": (
        {**BASE, "model_type": "llama"}, "lm", LoraSpec(rank=2, target_modules=("lm_head", "o_proj")),
    ),
    "lm_head named, tied": (
        {**BASE, "model_type": "llama", "tie_word_embeddings": True}, "lm",
        LoraSpec(rank=2, target_modules=("lm_head", "o_proj")),
    ),
    "all-linear, value head": ({**BASE, "model_type": "qwen2"}, "value", LoraSpec(rank=8)),
    "q/v, score head frozen": (
        {**BASE, "model_type": "qwen3", "head_dim": 24}, "score",
        LoraSpec(rank=4, target_modules=("q_proj", "v_proj"), train_head=False),
    ),
    "all-linear, mixture of experts": (
        {**BASE, "model_type": "qwen2_moe", "moe_intermediate_size": 32, "num_experts": 8,
         "shared_expert_intermediate_size": 48, "num_experts_per_tok": 2}, "lm", LoraSpec(rank=4),
    ),
}  # fmt: skip


def _lora(spec: LoraSpec) -> LoraShape:
    return LoraShape(spec.rank, spec.target_modules, spec.train_head)


def _measured(config: dict[str, Any], head: str, spec: LoraSpec) -> tuple[int, int]:
    """(elements, bytes) of the adapter state the runtime builds (``nodes/lora.py``)."""
    from rlflow.nodes.lora import adapter_bytes, adapter_state_dict, apply_lora
    from rlflow.nodes.models import build_model

    model = build_model(config=config, head=head, dtype="float32", seed=0)
    apply_lora(model, spec)
    return sum(t.numel() for t in adapter_state_dict(model).values()), adapter_bytes(model)


def _example_problem() -> tuple[Any, PlanProblem]:
    graph = load_graph(EXAMPLE)
    return graph, problem_from_graph(graph, prompt_len=16, mean_new_tokens=4.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_count_equals_the_runtime_adapters(case: str) -> None:
    """One formula for engine and planner: ``Σ rank·(in + out)`` over the targeted layers (+ a trained
    head's ``hidden + 1``, + a targeted embedding layer's ``V·H`` that peft saves) equals the elements of
    ``adapter_state_dict`` on the model peft builds."""
    config, head, spec = CASES[case]
    shape = ModelShape.from_config(config, head=head, dtype="float32")
    count = adapter_count(shape, _lora(spec))
    assert count.synced == _measured(config, head, spec)[0]
    assert count.params == adapter_params(shape, _lora(spec))


def test_example_adapter_count_and_sync_bytes() -> None:
    """examples/lora/grpo.yaml: 2 layers × (q_proj + v_proj) × 4·(128 + 128) = 4,096 adapter weights, as
    built; a sync moves those bytes only, 1.2 % of the 333,184-weight model (the issue's bound: 2 %)."""
    graph, problem = _example_problem()
    actor = problem.models["actor"]
    assert actor.adapter_params == actor.trainable_params == 2 * 2 * 4 * (128 + 128) == 4096
    spec = graph.spec.models["actor"]
    assert spec.lora is not None and spec.config is not None
    count, nbytes = _measured(dict(spec.config), "lm", spec.lora)
    cost = CostModel(problem, load_cluster("cpu-local"))
    assert count == actor.trainable_params
    assert cost.transfers.sync_bytes("actor") == nbytes * actor.dtype_bytes / 4  # built here in float32
    full = actor.num_params * actor.dtype_bytes
    assert actor.num_params == 333_184
    assert cost.transfers.sync_bytes("actor") <= 0.02 * full
    # what `rlflow plan` prints of the shapes it priced
    assert (
        "LoRA rank 4 on q_proj, v_proj: 0.004096 M adapter parameters trained (1.229 %)" in actor.describe()
    )
    assert problem.models["ref"].describe().endswith("the base of LoRA model 'actor' (adapters off)")


def test_lora_train_memory_has_no_base_gradients_or_optimizer_state() -> None:
    """d1t1p1m1 on one H100, bf16 (w = 2): full training holds ``N·w + 2·layer·w`` weights (the stage and
    FSDP2's two gathered layers), ``2·N`` gradients and ``12·N`` Adam state; LoRA (rank 16, all-linear)
    holds ``(N + A)·w + 2·layer·w`` weights but ``2·A`` gradients and ``12·A`` Adam state, and the same
    activations (the backward still flows through the base)."""
    cluster = load_cluster("h100-8x")
    full = MODEL_PRESETS["7b"]
    lora = dataclasses.replace(full, lora=LoraShape(16))
    # per layer: q,k,v,o 4·16·(4096 + 4096), gate/up 2·16·(4096 + 11008), down 16·(11008 + 4096)
    a = 32 * (4 * 16 * 8192 + 3 * 16 * (4096 + 11008))
    assert lora.adapter_params == a == 39_976_960
    n, w, layer = full.num_params, 2, full.max_layer_params
    node = PlanNode("train", "actor", "train", 64, 128, 128)
    place = NodePlacement((0,), Layout(1, 1, 1, 8))
    f = train_cost(cluster, node, full, place, 0.0).memory
    lo = train_cost(cluster, node, lora, place, 0.0).memory
    assert f.weights == pytest.approx(n * w + 2 * layer * w, rel=1e-12)
    assert (f.grads, f.optimizer) == pytest.approx((GRAD_BYTES * n, OPTIM_BYTES * n), rel=1e-12)
    assert lo.weights == pytest.approx((n + a) * w + 2 * layer * w, rel=1e-12)
    assert (lo.grads, lo.optimizer) == pytest.approx((GRAD_BYTES * a, OPTIM_BYTES * a), rel=1e-12)
    assert lo.activations == f.activations


def test_lora_backward_computes_no_base_weight_gradients() -> None:
    """Training compute: full = forward + 2 × forward (Kaplan et al. 2020, 6N); LoRA = its forward (with
    the adapters) + a backward of the base's matmuls at 1 ×, attention at 2 ×, adapters at 2 ×."""
    cluster = load_cluster("h100-8x")
    full = MODEL_PRESETS["7b"]
    lora = dataclasses.replace(full, lora=LoraShape(16))
    node = PlanNode("train", "actor", "train", 64, 128, 128)
    place = NodePlacement((0,), Layout(1, 1, 1, 8))
    work = micro_batch_work(node, full, 1, 8, cluster.device_type)
    f_fwd = token_flops(full, work.tokens, work.squares)
    l_fwd = token_flops(lora, work.tokens, work.squares)
    l_bwd = lora_backward_flops(lora, lora.lora, work.tokens, work.squares)  # type: ignore[arg-type]
    assert l_fwd - f_fwd == pytest.approx(2 * work.tokens * lora.adapter_params)
    ratio = (
        train_cost(cluster, node, lora, place, 0.0).compute_s
        / train_cost(cluster, node, full, place, 0.0).compute_s
    )
    assert ratio == pytest.approx((l_fwd + l_bwd) / (3 * f_fwd), rel=1e-12)
    assert 0.6 < ratio < 0.75  # about 2/3: the base's weight gradients, a third of the work, are gone


def test_base_view_costs_no_weights_beside_its_lora_model() -> None:
    """``ref: {base_of: actor}`` on the actor's devices and layout holds no weights (the runtime runs the
    actor's module with the adapters off); on another device, or beside a DeepSpeed trainer only, a full
    frozen copy (``N·w``)."""
    _, problem = _example_problem()
    ref = problem.models["ref"]
    assert ref.base_of == "actor" and ref.lora is None
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=2, cores_per_host=None)
    cost = CostModel(problem, cluster)
    one = NodePlacement((0,), Layout())
    together = {n.name: one for n in problem.nodes}
    assert node_memory(cost, together)["ref"].weights == 0.0
    apart = {**together, "ref": NodePlacement((1,), Layout())}
    expected = ref.num_params * ref.dtype_bytes
    assert node_memory(cost, apart)["ref"].weights == pytest.approx(expected, rel=1e-12)
    # a DeepSpeed trainer's module is DeepSpeed's: the view beside it alone holds its own copy
    zero = ZeroConfig(2, False, False)
    deepspeed = dataclasses.replace(
        problem,
        # ZeRO decides what is sharded: no reshard decision on a DeepSpeed node
        nodes=tuple(
            dataclasses.replace(n, zero=zero, reshard=True) if n.kind == "train" else n for n in problem.nodes
        ),
    )
    gen_apart = {**together, "actor_gen": NodePlacement((1,), Layout())}
    assert node_memory(CostModel(deepspeed, cluster), gen_apart)["ref"].weights == pytest.approx(expected)
    assert node_memory(cost, gen_apart)["ref"].weights == 0.0


def test_memory_check_sizes_a_base_view_without_warning() -> None:
    """The pre-launch memory check plans examples/lora/grpo.yaml (it warned "needs a config or a path for
    planning" and skipped the check before the planner knew base views)."""
    graph = load_graph(EXAMPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_plan_memory(graph, MachineMemory(host=2.0**40))


def _grpo(shape: ModelShape, lora: bool) -> PlanProblem:
    actor = dataclasses.replace(shape, lora=LoraShape(16)) if lora else shape
    ref = dataclasses.replace(shape, base_of="actor") if lora else shape
    rows, prompt, gen = 256, 128, 384
    nodes = (
        PlanNode("gen", "actor", "generate", rows, prompt, gen, group_size=8),
        PlanNode("ref", "ref", "inference", rows, prompt, gen),
        PlanNode("train", "actor", "train", rows, prompt, gen, mini_batches=4),
    )
    return PlanProblem({"actor": actor, "ref": ref}, nodes, (), (("train", "gen"),))


def test_search_chooses_lora_layouts_and_syncs_adapters_only() -> None:
    """GRPO of a Llama-2 7B on two H100s: full training cannot hold a whole copy's state per device, so the
    search pipelines it (pp = 2); LoRA's state is the base's weights plus small adapter state, so the
    search runs data parallel (dp = 2; LoRA runs at tp = pp = 1 only) with the reference on the actor's
    weights, and the iteration is
    faster. With generation apart from training, the LoRA sync moves 0.6 % of the full sync's bytes and
    costs a fraction of its seconds."""
    cluster = dataclasses.replace(load_cluster("h100-8x"), hosts=1, devices_per_host=2)
    shape = MODEL_PRESETS["7b"]
    full = Searcher(_grpo(shape, False), cluster).search(restarts=1, steps=100)
    lora = Searcher(_grpo(shape, True), cluster).search(restarts=1, steps=100)
    assert full.plan["train"].layout.pp == 2
    assert lora.plan["train"].layout.dp == 2
    # the runtime runs LoRA models and base views at tp = pp = 1 only: the search never offers more
    assert all(p.layout.tp == p.layout.pp == 1 for p in lora.plan.values())
    problem = _grpo(shape, True)
    why = layout_problem(problem.models["ref"], problem.node("ref"), Layout(1, 2, 1, 1))
    assert why is not None and "base of LoRA model 'actor'" in why and "tp = pp = 1" in why
    assert lora.iteration_s < full.iteration_s
    split = {
        "gen": NodePlacement((0,), Layout()),
        "ref": NodePlacement((0,), Layout(1, 1, 1, 16)),
        "train": NodePlacement((1,), Layout(1, 1, 1, 16)),
    }
    small = dataclasses.replace(shape, num_hidden_layers=4)  # a whole copy trains on one device
    costs = {lo: CostModel(_grpo(small, lo), cluster) for lo in (False, True)}
    seconds = {lo: c.transfers.sync_time("train", split) for lo, c in costs.items()}
    nbytes = {lo: c.transfers.sync_bytes("actor") for lo, c in costs.items()}
    assert nbytes[True] <= 0.02 * nbytes[False]
    assert 0 < seconds[True] < 0.1 * seconds[False]
