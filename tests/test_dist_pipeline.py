"""Pipeline parallelism (``pp > 1``) in the distributed runtime.

* tier 1: the pipeline mesh arithmetic (stages, chains, leaders) and the stage's layer list;
* tier 2: plan checks before any process starts (generation on pipeline stages, too few layers, the
  runtime's layout filter for ``plan: auto``);
* tier 3, one group of 4 CPU gloo processes (started once, for the three tests): layout parity of d1t1p2,
  d1t2p2, d2t1p2 and d1t1p4 against one process, on a 5-layer tiny Llama (uneven stages: 3+2, and
  2+1+1+1), untied and tied heads: ``logprobs`` and ``values`` within 1e-5, the weights after one ``sft``
  and one ``ppo_actor`` step (2 mini-batches, 2 micro-batches: GPipe order, grad clip active) within 1e-6
  with the global gradient norm within 1e-5 relative, and a ``dpo`` step (two forwards per loss: autograd
  returns their gradients in reverse forward order); a stage's gradients arriving before it asks for them
  are kept (direct check); the built-in generation loop on pipeline stages; 1F1B and GPipe schedules;
* tier 4: the real Controller runs PPO with the actor trained at d1t2p2 (tied head) and the reference and
  critic pipelined; the weight sync to the d4t1p1 generation replicas takes the planned reallocation and
  is bit-exact (checksums, ``torch.equal``).

Tolerances as in ``tests/test_dist_layouts.py`` (whose helpers and tiny model this file reuses).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.schedulers.runtime.controller as controller_mod
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.runtime.choose_executor import make_executor
from rlflow.schedulers.runtime.controller import Controller
from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.layouts import MeshSpec
from tests.test_dist_executor import FAST, PLAN_2, _graph, _in_repo, _seq_batch  # noqa: F401 (fixture)
from tests.test_dist_layouts import CONFIG, _batch, _ctx, _full_state

PP_LAYOUTS = [(1, 1, 2), (1, 2, 2), (2, 1, 2), (1, 1, 4)]  # (dp, tp, pp)
PP_CONFIG = {**CONFIG, "num_hidden_layers": 5}

# -- tier 1 ----------------------------------------------------------------------------------------


def test_pipeline_mesh_stages_chains_and_leaders() -> None:
    # d2t1p2 on 0-3: stage 0 = {0, 1}, stage 1 = {2, 3}; chains pair the same dp rank of both stages
    spec = MeshSpec.of((0, 1, 2, 3), Layout(2, 1, 2, 1))
    assert spec.stage(0) == MeshSpec((0, 1), 2, 1) and spec.stage(1) == MeshSpec((2, 3), 2, 1)
    assert spec.pp_groups() == [(0, 2), (1, 3)]
    assert spec.leaders() == [2, 3]  # the last stage returns outputs, one rank per dp rank
    assert [spec.coords(r) for r in range(4)] == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert [spec.shard_key(r) for r in range(4)] == [(0, 0), (0, 0), (1, 0), (1, 0)]
    assert spec.dp_groups() == [(0, 1), (2, 3)] and spec.tp_groups() == [(0,), (1,), (2,), (3,)]
    # d1t2p2 on 4-7: tp fastest inside a stage
    spec = MeshSpec.of((4, 5, 6, 7), Layout(1, 2, 2, 1))
    assert spec.pp_groups() == [(4, 6), (5, 7)] and spec.leaders() == [6]
    assert spec.layout == Layout(1, 2, 2, 1)
    with pytest.raises(PlanError, match="needs 4 devices"):
        MeshSpec.of((0, 1), Layout(1, 2, 2, 1))


def test_stage_layers_keep_global_indices() -> None:
    from rlflow.schedulers.runtime.distributed.pipeline import StageLayers

    layers = StageLayers({3: torch.nn.Linear(1, 1), 4: torch.nn.Linear(1, 2)})
    assert [m.out_features for m in layers[:5]] == [1, 2]  # the decoder's `layers[:num_hidden_layers]`
    assert layers[4].out_features == 2 and len(layers) == 2
    assert sorted(n for n, _ in layers.named_parameters()) == ["3.bias", "3.weight", "4.bias", "4.weight"]


def test_1f1b_order_for_3_stages_and_4_micro_batches() -> None:
    """The golden 1F1B order of p=3, m=4 (Narayanan et al. 2021, Fig. 4, bottom): stage s runs
    p-1-s warm-up forwards, then F(w+i) B(i) in turn, then the remaining backwards."""
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import schedule_order

    def ops(text: str) -> list[tuple[str, int]]:
        return [(op[0], int(op[1:])) for op in text.split()]

    assert schedule_order("1f1b", 3, 0, 4) == ops("F0 F1 F2 B0 F3 B1 B2 B3")  # 2 warm-up forwards
    assert schedule_order("1f1b", 3, 1, 4) == ops("F0 F1 B0 F2 B1 F3 B2 B3")  # 1
    assert schedule_order("1f1b", 3, 2, 4) == ops("F0 B0 F1 B1 F2 B2 F3 B3")  # 0: the last stage
    # fewer micro-batches than stages: the warm-up is capped by m (stage 0 is then GPipe's order)
    assert schedule_order("1f1b", 3, 0, 2) == ops("F0 F1 B0 B1")
    assert schedule_order("1f1b", 3, 1, 2) == ops("F0 F1 B0 B1")
    assert schedule_order("gpipe", 3, 2, 3) == ops("F0 F1 F2 B0 B1 B2")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        schedule_order("zb", 3, 0, 4)
    # activations alive at once (forwarded, not yet backpropagated): min(m, p - s) under 1F1B, m under GPipe
    for p in (2, 3, 4):
        for m in (1, 2, 3, 4, 6):
            for s in range(p):
                for schedule, want in (("1f1b", min(m, p - s)), ("gpipe", m)):
                    order = schedule_order(schedule, p, s, m)
                    alive = [sum(1 if op == "F" else -1 for op, _ in order[: i + 1]) for i in range(2 * m)]
                    assert max(alive) == want, (schedule, p, s, m)
                    assert [k for op, k in order if op == "B"] == list(range(m))  # same accumulation


def test_pipeline_orders_accumulate_the_same_gradients() -> None:
    """A train step under 1F1B's order (stage 0 of 3: two warm-up forwards) and under GPipe's leaves the
    weights of a 2-mini-batch, 4-micro-batch SFT step bit for bit where the default order does."""
    from rlflow.nodes.context import TrainHooks
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import schedule_order

    class Ordered(TrainHooks):
        def __init__(self, schedule: str) -> None:
            self.schedule = schedule
            self.ops: list[tuple[str, int]] = []

        def micro_batch_order(self, m: int) -> list[tuple[str, int]]:
            return schedule_order(self.schedule, 3, 0, m)

        def begin(self, op: str, k: int) -> None:
            self.ops.append((op, k))

    lm = build_model(config=CONFIG, seed=1)
    node = NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2)
    weights, orders = [], []
    for hooks in (TrainHooks(), Ordered("1f1b"), Ordered("gpipe")):
        model = copy.deepcopy(lm)
        ctx = _ctx(node, model, "lm", True)
        ctx.micro_batches, ctx.train_hooks = 4, hooks
        sft_node(ctx, _batch(12))
        weights.append(_full_state(model))
        orders.append(getattr(hooks, "ops", None))
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])
    assert any(not torch.equal(weights[0][k], v) for k, v in _full_state(lm).items())

    def ops(text: str) -> list[tuple[str, int]]:
        return [(op[0], int(op[1:])) for op in text.split()]

    assert orders[1] == ops("F0 F1 F2 B0 F3 B1 B2 B3") * 2  # the hooks saw every op, in its order
    assert orders[2] == ops("F0 F1 F2 F3 B0 B1 B2 B3") * 2


# -- tier 2 ----------------------------------------------------------------------------------------


def test_plan_checks_before_any_process_starts() -> None:
    from rlflow.dataflow.layout_rules import node_layout_problem
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.pipeline import check_pipeline

    gen_pp = PLAN_2.replace(
        "actor_gen: {devices: 0-1, layout: d2t1p1m1}", "actor_gen: {devices: 0-1, layout: d1t1p2m1}"
    )
    # the built-in loop runs on pipeline stages; vLLM's engine does not
    assert node_layout_problem(_graph(gen_pp, 2), "actor_gen", Layout(1, 1, 2, 1)) is None
    with pytest.raises(
        PlanError, match=r"examples/ppo.yaml: plan.actor_gen.layout: the vLLM engine runs without"
    ):
        _graph(gen_pp, 2, "nodes.actor_gen.engine=vllm")
    with pytest.raises(PlanError, match=r"actor: pipeline degree pp=3: 2 layers cannot fill 3"):
        check_pipeline(build_model(config=CONFIG, seed=0), 3, "actor")
    g = _graph(PLAN_2, 2)
    assert node_layout_problem(g, "actor_train", Layout(1, 1, 2, 1)) is None
    assert node_layout_problem(g, "ref", Layout(1, 1, 2, 1)) is None  # ref: init_from actor (2 layers)
    assert "3 pipeline stages" in str(node_layout_problem(g, "actor_gen", Layout(1, 1, 3, 1)))
    assert "2 layers" in str(node_layout_problem(g, "critic_train", Layout(1, 1, 4, 1)))


# -- tier 3: parity on 4 processes -----------------------------------------------------------------


def _pairs(batch: Batch) -> Batch:
    """A preference batch from ``_batch``'s rows: chosen = the response, rejected = the next row's."""
    shift = [(i + 1) % len(batch) for i in range(len(batch))]
    g = torch.Generator().manual_seed(5)
    return Batch(
        {
            "prompt_ids": batch.tensor("prompt_ids"),
            "prompt_mask": batch.tensor("prompt_mask"),
            "chosen_ids": batch.tensor("response_ids"),
            "chosen_mask": batch.tensor("response_mask"),
            "rejected_ids": batch.tensor("response_ids")[shift],
            "rejected_mask": batch.tensor("response_mask")[shift],
            "ref_chosen_logps": -torch.rand(len(batch), generator=g) * 5,
            "ref_rejected_logps": -torch.rand(len(batch), generator=g) * 5,
        }
    )


def _out_of_order_gradients(rank: int, spec: MeshSpec, cache: Any) -> float:
    """Stage 1 sends the gradients of forwards 1 and 2 in that order, stage 0 asks for 2 first (the
    early one is kept until asked for). Returns the largest error of what each stage received."""
    from rlflow.schedulers.runtime.distributed.pipeline_stage import PipelineStage

    chain = spec.pp_groups()[0]
    st = PipelineStage(spec.stage_of(rank), 2, chain, cache.group(chain), None, torch.device("cpu"))
    acts = {seq: torch.full((2, 3, 4), float(seq)) for seq in (1, 2)}
    if st.first:
        for seq, act in acts.items():
            st.send_activation(act, seq, grad=True)
        got = {seq: st.recv_grad(seq) for seq in (2, 1)}
        want = {seq: 10 * act for seq, act in acts.items()}
    else:
        got = {seq: st.recv_activation(seq, (2, 3, 4), torch.float32) for seq in (1, 2)}
        for seq in (1, 2):
            st.send_grad(10 * got[seq], seq)
        want = acts
    st.finish()
    return max(float((got[seq] - want[seq]).abs().max()) for seq in acts)


def _layouts_of(rank: int, cache: Any) -> Iterator[tuple[tuple[int, int, int], MeshSpec, Any, int]]:
    """``((dp, tp, pp), mesh spec, device mesh, dp rank)`` of each of ``PP_LAYOUTS`` that ``rank`` is in."""
    for dp, tp, pp in PP_LAYOUTS:
        spec = MeshSpec.of(range(dp * tp * pp), Layout(dp, tp, pp, 1))
        mesh = cache.mesh(spec)
        if mesh is not None:
            yield (dp, tp, pp), spec, mesh, spec.coords(rank)[0]


def _pp_parity_worker(rank: int, world: int) -> dict[str, float]:
    from rlflow.nodes.functions.inference import logprobs_node, values_node
    from rlflow.nodes.functions.policy import ppo_actor
    from rlflow.nodes.functions.supervised import dpo_node, sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage, stage_scope
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks
    from rlflow.schedulers.runtime.distributed.rows import shard_rows

    torch.manual_seed(0)
    lms = {
        tied: build_model(config={**PP_CONFIG, "tie_word_embeddings": tied}, seed=1) for tied in (False, True)
    }
    critic = build_model(config=PP_CONFIG, head="value", seed=2)
    batch, pairs = _batch(8), _pairs(_batch(8))
    lp_node = NodeSpec(name="ref", kind="inference", function="logprobs", model="m")
    v_node = NodeSpec(name="cv", kind="inference", function="values", model="m")
    fns = {"sft": ("sft", sft_node), "ppo": ("ppo_actor", ppo_actor), "dpo": ("dpo", dpo_node)}
    train = {
        step: (NodeSpec(name=step, kind="train", function=name, model="m", mini_batches=2), fn)
        for step, (name, fn) in fns.items()
    }
    args = {"ppo": {"whiten_advantages": False}}
    # (tied, step) pairs trained per layout; dpo on the two plain pipelines only (its reordered gradients)
    steps = {(False, "sft"), (False, "ppo"), (True, "sft")}

    def data(step: str) -> Batch:
        return pairs if step == "dpo" else batch

    # single-process references (every rank computes them locally)
    ref_lp = {
        t: logprobs_node(_ctx(lp_node, m, "lm", False), batch).outputs["logprobs"] for t, m in lms.items()
    }
    ref_v = values_node(_ctx(v_node, critic, "value", False), batch).outputs["values"]
    ref_w: dict[tuple[bool, str], dict[str, torch.Tensor]] = {}
    ref_norm: dict[tuple[bool, str], float] = {}
    for tied, step in sorted(steps | {(False, "dpo")}):
        model = copy.deepcopy(lms[tied])
        node, fn = train[step]
        result = fn(_ctx(node, model, "lm", True), data(step), **args.get(step, {}))
        ref_norm[(tied, step)] = result.metrics["actor/grad_norm"]
        ref_w[(tied, step)] = _full_state(model)

    cache = GroupCache(timeout_s=60)
    diffs: dict[str, float] = {}
    for (dp, tp, pp), spec, mesh, dp_rank in _layouts_of(rank, cache):
        leader = rank in spec.leaders()
        shares = shard_rows(len(batch), dp)

        def stage(full: torch.nn.Module, fsdp: bool) -> torch.nn.Module:
            return apply_layout(make_stage(copy.deepcopy(full), spec, rank, cache), mesh, train=fsdp)  # noqa: B023

        if (dp, tp, pp) == (1, 1, 2):
            diffs["d1t1p2/out_of_order_gradients"] = _out_of_order_gradients(rank, spec, cache)
            # only the last stage's loss counts: the first stage's comes from placeholder logits
            hooks = train_hooks(stage(lms[False], False), mesh["dp"].get_group(), dp)
            finite = hooks.loss_is_finite(torch.tensor(float("nan")))
            diffs["d1t1p2/nan_loss_check"] = float(finite != (rank == 0))
        # inference: dp replicas; outputs from the last stage (the leaders) only
        local = batch.index(shares[dp_rank])
        for tied, lm in lms.items():
            module = stage(lm, False)
            with stage_scope(module):
                lp = logprobs_node(_ctx(lp_node, module, "lm", False), local).outputs["logprobs"]
            if leader:
                diffs[f"d{dp}t{tp}p{pp}/tied={tied}/logprobs"] = float(
                    (lp - ref_lp[tied][shares[dp_rank]]).abs().max()
                )
        module = stage(critic, False)
        with stage_scope(module):
            v = values_node(_ctx(v_node, module, "value", False), local).outputs["values"]
        if leader:
            diffs[f"d{dp}t{tp}p{pp}/values"] = float((v - ref_v[shares[dp_rank]]).abs().max())
        # training: FSDP2 over dp inside each stage, GPipe over 2 micro-batches
        todo = steps | ({(False, "dpo")} if dp == tp == 1 else set())
        for tied, step in sorted(todo):
            node, fn = train[step]
            model = stage(lms[tied], dp > 1)
            rows = data(step).index(shard_rows(len(batch), dp, node.mini_batches)[dp_rank])
            ctx = _ctx(node, model, "lm", True)
            ctx.micro_batches = 2
            ctx.train_hooks = hooks = train_hooks(model, mesh["dp"].get_group(), dp)
            with hooks, stage_scope(model):
                norm = fn(ctx, rows, **args.get(step, {})).metrics["actor/grad_norm"]
            tag = f"d{dp}t{tp}p{pp}/tied={tied}/{step}"
            diffs[f"{tag}_gradnorm"] = abs(norm / ref_norm[(tied, step)] - 1.0)
            got = _full_state(model)
            want = ref_w[(tied, step)]
            assert set(got) < set(want), (tag, sorted(set(got) - set(want)))
            diffs[f"{tag}_weights"] = max(float((got[k] - want[k]).abs().max()) for k in got)
            diffs[f"{tag}_moved"] = max(float((got[k] - _full_state(lms[tied])[k]).abs().max()) for k in got)
            for name in got:  # which parameters this rank's stage holds (the union must be the model)
                diffs[f"{tag}/has/{name}"] = 0.0
    for tied, lm in lms.items():
        for name in _full_state(lm):
            diffs[f"model/tied={tied}/has/{name}"] = 0.0
    return diffs


def _group_worker(rank: int, world: int) -> dict[str, Any]:
    """The module's three tier-3 parts, one after another on the same 4 processes (each builds its own
    groups): each part's result, or the traceback of what it raised (so that each test reports its own)."""
    import traceback

    out: dict[str, Any] = {}
    for name, part in GROUP_PARTS.items():
        try:
            out[name] = part(rank, world)
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def group_results() -> dict[str, list[Any]]:
    """``{part: [its result on rank r]}`` of ``GROUP_PARTS``: one group of 4 gloo processes for the three
    tests."""
    results = run_group(_group_worker, 4, timeout_s=800)
    return {name: [r[name] for r in results] for name in GROUP_PARTS}


def _part(results: dict[str, list[Any]], name: str) -> list[Any]:
    """The part's per-rank results; fails with a rank's traceback where that rank's part raised."""
    for rank, value in enumerate(results[name]):
        assert not isinstance(value, str), f"rank {rank} raised in the {name} part:\n{value}"
    return results[name]


@pytest.mark.xdist_group("pipeline_group")
@pytest.mark.slow
@pytest.mark.timeout(840)  # the first of the group's three tests starts it
def test_pipeline_layout_parity_on_4_processes(group_results: dict[str, list[Any]]) -> None:
    results = _part(group_results, "parity")
    checked = 0
    for rank, diffs in enumerate(results):
        for key, value in diffs.items():
            if "/has/" in key:
                continue
            if key.endswith("_moved"):
                assert value > 1e-4, f"rank {rank} {key}: the step did not change the weights"
            elif key.endswith("_weights"):
                assert value < 1e-6, f"rank {rank} {key}: {value}"
            else:  # log-probs, values (absolute) and gradient norms (relative)
                assert value < 1e-5, f"rank {rank} {key}: {value}"
            checked += 1
    keys = set().union(*results)

    def held(prefix: str) -> set[str]:
        return {k.split("/has/")[1] for k in keys if k.startswith(f"{prefix}/has/")}

    for dp, tp, pp in PP_LAYOUTS:
        tag = f"d{dp}t{tp}p{pp}"
        assert f"{tag}/values" in keys and f"{tag}/tied=True/logprobs" in keys
        for tied, step in ((False, "sft"), (False, "ppo"), (True, "sft")):
            assert held(f"{tag}/tied={tied}/{step}") == held(f"model/tied={tied}"), (tag, tied, step)
    assert "lm_head.weight" not in held("model/tied=True") and "lm_head.weight" in held("model/tied=False")
    assert "d1t1p4/tied=False/dpo_weights" in keys and checked > 0


def _pp_generate_worker(rank: int, world: int) -> dict[str, Any]:
    """The built-in generation loop on pipeline stages against one process: same prompts, same seed."""
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import build_model
    from rlflow.nodes.tokenizers import TokenizerInfo
    from rlflow.schedulers.runtime.distributed.layouts import apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.pipeline import generation_scope, make_stage, stage_scope
    from rlflow.schedulers.runtime.distributed.rows import shard_rows

    info = TokenizerInfo(pad_id=0, eos_id=2)
    batch = _batch(4)
    # sampled with top-p (EOS ends some rows early: every stage must stop at the same step) and greedy
    settings = {"sample": {"temperature": 0.9, "top_p": 0.95}, "greedy": {"greedy": True}}

    def run(module: torch.nn.Module, rows: list[int], seed: int, how: str) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = batch.tensor("prompt_ids")[rows], batch.tensor("prompt_mask")[rows]
        out = generate(module, info, ids, mask, n=2, max_new_tokens=12, generator=gen, **settings[how])
        return out[0], out[1], out[2], gen.get_state()

    lms = {
        tied: build_model(config={**PP_CONFIG, "tie_word_embeddings": tied}, seed=1) for tied in (False, True)
    }
    cache = GroupCache(timeout_s=60)
    out: dict[str, Any] = {}
    for (dp, tp, pp), spec, mesh, dp_rank in _layouts_of(rank, cache):
        rows = shard_rows(len(batch), dp)[dp_rank]
        for tied, lm in lms.items():
            module = apply_layout(make_stage(copy.deepcopy(lm), spec, rank, cache), mesh, train=False)
            for how in settings:
                seed = 7 + dp_rank
                want = run(lm, rows, seed, how)
                with generation_scope(module), stage_scope(module):
                    got = run(module, rows, seed, how)
                tag = f"d{dp}t{tp}p{pp}/tied={tied}/{how}/r{rank}"
                out[f"{tag}/tokens"] = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                out[f"{tag}/logprobs"] = float((got[2] - want[2]).abs().max())
                out[f"{tag}/generator"] = torch.equal(got[3], want[3])  # the stages drew the same numbers
                out[f"{tag}/ended_early"] = int(want[1].sum(-1).lt(12).sum())
                attn = [m for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)]
                out[f"{tag}/indices_restored"] = sorted(m.layer_idx for m in attn) == sorted(
                    int(k) for k in module.model.layers._modules
                )
    return out


@pytest.mark.xdist_group("pipeline_group")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_builtin_generation_on_pipeline_stages_matches_one_process(
    group_results: dict[str, list[Any]],
) -> None:
    """tier 3, 4 processes: d1t1p2, d1t2p2, d2t1p2 and d1t1p4 (5 layers: uneven stages), untied and tied,
    sampled (top-p, rows ending at EOS) and greedy: every rank of every stage returns the one-process
    tokens and mask exactly, log-probs within 1e-5, and its generator ends in the same state; the stage's
    attention modules get their global cache indices back."""
    results = _part(group_results, "generate")
    merged = {k: v for r in results for k, v in r.items()}
    for key, value in merged.items():
        if key.endswith("/logprobs"):
            assert value < 1e-5, (key, value)
        elif key.endswith("/ended_early"):
            continue
        else:
            assert value is True, key
    assert sum(v for k, v in merged.items() if k.endswith("sample/r0/ended_early")) > 0  # EOS was sampled
    for dp, tp, pp in PP_LAYOUTS:
        assert sum(f"d{dp}t{tp}p{pp}/" in k for k in merged) == 2 * 2 * 5 * dp * tp * pp


# (pp, micro-batches per mini-batch): m < p, m = p and m > p for 2 and 3 stages, on 3 processes
SCHEDULE_CASES = [(2, 1), (2, 2), (2, 4), (3, 2), (3, 3), (3, 4)]
DPO_CASES = {(2, 4), (3, 4)}  # two forwards per loss: two gradients per backward to wait for


def _log_p2p(stage: Any) -> list[tuple[int, str, int]]:
    """Wrap ``stage``'s point-to-point calls to log each message (header) in issue order, as
    ``(peer stage, "A" activation | "G" gradient, forward sequence number)``."""
    log: list[tuple[int, str, int]] = []
    send, recv = stage._send, stage._recv
    peer = {r: i for i, r in enumerate(stage.chain)}

    def logged_send(tensor: torch.Tensor, dst: int, seq: int) -> None:
        log.append((peer[dst], "A" if peer[dst] > stage.stage else "G", seq))
        send(tensor, dst, seq)

    def logged_recv(src: int, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        buf = recv(src, shape, dtype)
        if tuple(shape) == (1,) and dtype == torch.int64:  # a header, not a payload
            log.append((peer[src], "A" if peer[src] < stage.stage else "G", int(buf.item())))
        return buf

    stage._send, stage._recv = logged_send, logged_recv
    return log


def _link(log: list[tuple[int, str, int]], peer: int) -> list[tuple[str, int]]:
    """The messages of a :func:`_log_p2p` log exchanged with stage ``peer``, in issue order."""
    return [(kind, seq) for other, kind, seq in log if other == peer]


def _schedule_worker(rank: int, world: int) -> dict[str, Any]:
    """SFT (and DPO) steps under 1F1B and GPipe at d1t1p2 and d1t1p3 for each micro-batch count of
    ``SCHEDULE_CASES``, against one process; per stage: the peak in-flight count and the message log."""
    from rlflow.nodes.functions.supervised import dpo_node, sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage, stage_of, stage_scope
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks

    lm = build_model(config=PP_CONFIG, seed=1)
    data = {"sft": _batch(8), "dpo": _pairs(_batch(8))}
    fns = {"sft": sft_node, "dpo": dpo_node}
    nodes = {
        step: NodeSpec(name=step, kind="train", function=step, model="m", mini_batches=2) for step in fns
    }
    cache = GroupCache(timeout_s=60)
    out: dict[str, Any] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}  # tensors stay here (the queue takes plain data)
    for pp, m in SCHEDULE_CASES:
        spec = MeshSpec.of(range(pp), Layout(1, 1, pp, 1))
        mesh = cache.mesh(spec)
        if mesh is None:
            continue
        s = spec.stage_of(rank)
        runs = [(step, sched, True) for step in fns for sched in ("1f1b", "gpipe")]
        runs += [("sft", "1f1b", False)]  # 1F1B without holding sends back: the link orders differ
        for step, schedule, hold in runs:
            if step == "dpo" and (pp, m) not in DPO_CASES:
                continue
            ref_model = copy.deepcopy(lm)
            ref_ctx = _ctx(nodes[step], ref_model, "lm", True)
            ref_ctx.micro_batches = m
            ref = fns[step](ref_ctx, data[step]).metrics
            model = make_stage(copy.deepcopy(lm), spec, rank, cache)
            stage = stage_of(model)
            assert stage is not None
            log = _log_p2p(stage)
            if not hold:
                stage.hold_sends = lambda until: None  # type: ignore[method-assign]
            ctx = _ctx(nodes[step], model, "lm", True)
            ctx.micro_batches = m
            ctx.train_hooks = hooks = train_hooks(model, mesh["dp"].get_group(), 1, schedule)
            with hooks, stage_scope(model):
                metrics = fns[step](ctx, data[step]).metrics
            tag = f"p{pp}m{m}/{step}/{schedule}" + ("" if hold else "-nohold")
            got, want = _full_state(model), _full_state(ref_model)
            out[f"{tag}/s{s}/weights"] = max(float((got[k] - want[k]).abs().max()) for k in got)
            states[tag] = got
            if schedule == "gpipe":  # both schedules accumulate in the same order: the same bits
                one = states[f"p{pp}m{m}/{step}/1f1b"]
                out[f"p{pp}m{m}/{step}/s{s}/same_bits"] = all(torch.equal(one[k], got[k]) for k in got)
            out[f"{tag}/s{s}/peak"] = hooks.peak_in_flight
            out[f"{tag}/s{s}/log"] = log
            if stage.last:  # metrics (losses) come from the last stage; the norm is global on every stage
                for k, v in ref.items():
                    out[f"{tag}/metric/{k}"] = abs(metrics[k] - v) / max(1.0, abs(v))
            out[f"{tag}/s{s}/gradnorm"] = abs(metrics["actor/grad_norm"] / ref["actor/grad_norm"] - 1.0)
    return out


@pytest.mark.xdist_group("pipeline_group")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_1f1b_and_gpipe_match_one_process_on_3_processes(group_results: dict[str, list[Any]]) -> None:
    """1F1B and GPipe at pp=2 and pp=3, with fewer, as many and more micro-batches than stages: losses,
    gradient norms and weights match one process (and 1F1B's weights are GPipe's bit for bit); stage s
    keeps at most min(m, p - s) micro-batches' activations alive under 1F1B (m under GPipe); on every
    link both ends issue the same messages in the same order (rendezvous p2p, NCCL, cannot deadlock). The
    stages are ranks 0-2 of the module's group of 4 (rank 3 holds none)."""
    results = _part(group_results, "schedule")
    merged: dict[str, Any] = {}
    for r in results:
        merged.update(r)
    checked = 0
    for key, value in merged.items():
        if key.endswith(("/weights", "/gradnorm")) or "/metric/" in key:
            assert value < (1e-6 if key.endswith("/weights") else 1e-5), (key, value)
            checked += 1
    assert checked > 0
    for pp, m in SCHEDULE_CASES:
        for step in ("sft", "dpo") if (pp, m) in DPO_CASES else ("sft",):
            tag = f"p{pp}m{m}/{step}"
            assert f"{tag}/1f1b/metric/actor/grad_norm" in merged
            for s in range(pp):
                assert merged[f"{tag}/s{s}/same_bits"] is True, (tag, s)
                assert merged[f"{tag}/1f1b/s{s}/peak"] == min(m, pp - s), (tag, s)
                assert merged[f"{tag}/gpipe/s{s}/peak"] == m, (tag, s)
            for schedule in ("1f1b", "gpipe"):
                for s in range(pp - 1):  # the link between stage s and s + 1, seen from either end
                    left = _link(merged[f"{tag}/{schedule}/s{s}/log"], s + 1)
                    right = _link(merged[f"{tag}/{schedule}/s{s + 1}/log"], s)
                    assert len(left) == 2 * 2 * m * (2 if step == "dpo" else 1), (tag, schedule, s)
                    assert left == right, (tag, schedule, s, left, right)
    # pp=2, m=4: the first stage holds at most 2 micro-batches' activations under 1F1B, GPipe all 4
    assert merged["p2m4/sft/1f1b/s0/peak"] == 2 and merged["p2m4/sft/gpipe/s0/peak"] == 4
    # without holding steady-state sends back, 1F1B's link orders differ (a rendezvous transport deadlocks)
    for pp, m in ((2, 4), (3, 4)):
        log0, log1 = (merged[f"p{pp}m{m}/sft/1f1b-nohold/s{s}/log"] for s in (0, 1))
        assert _link(log0, 1) != _link(log1, 0)


# the tier-3 parts the module's group of 4 processes runs, in order (``group_results``)
GROUP_PARTS = {"parity": _pp_parity_worker, "generate": _pp_generate_worker, "schedule": _schedule_worker}


# -- tier 4: PPO through the Controller ------------------------------------------------------------

PLAN_PP = """
plan:
  actor_gen: {devices: 0-3, layout: d4t1p1m1}
  reward: {devices: 3, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d1t1p2m2}
  critic_values: {devices: 2-3, layout: d1t1p2m1}
  actor_train: {devices: 0-3, layout: d1t2p2m2}
  critic_train: {devices: 0-3, layout: d2t1p2m1}
"""


def _record_executors(monkeypatch: pytest.MonkeyPatch) -> list[DistExecutor]:
    """The executors the Controller makes from now on (with the fast test timeouts), in order."""
    made: list[DistExecutor] = []

    def factory(graph: Graph, checkpoint_dir: Path | None = None) -> object:
        ex = make_executor(graph, checkpoint_dir, **FAST)
        made.append(ex)
        return ex

    monkeypatch.setattr(controller_mod, "make_executor", factory)
    return made


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_with_pipelined_actor_through_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = _record_executors(monkeypatch)
    g = _graph(
        PLAN_PP, 4, "run.iterations=2", f"run.output_dir={tmp_path}",
        "models.actor.config.tie_word_embeddings=true",
    )  # fmt: skip
    c = Controller(g)
    ex = made[0]
    try:
        result = c.run()
        m = result.metrics
        assert result.iteration == 2
        assert all(v == v and abs(v) != float("inf") for v in m.values()), m
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "timing_s/actor_train"):
            assert name in m
        # actor_gen (d4t1p1) sampled with the weights actor_train (d1t2p2) left after iteration 1
        assert m["rollout/logprob_gap_mean"] < 1e-5
        # the syncs after the pipelined train nodes took the planned reallocation, checked region by region
        assert ex.realloc_counts == {"plan": 4, "gather": 0}
        assert m["realloc/checksum_ok"] == 1.0 and m["realloc/bytes"] > 0
        gen = ex.view.node_instance["actor_gen"]
        record = next(r for r in reversed(ex.realloc_log) if r["instance"] == gen)
        assert record["path"] == "plan" and set(record["checksums"]) == {0, 1, 2, 3}
        assert len(set(record["checksums"].values())) == 1  # four replicas, one checksum
        for model in ("actor", "critic"):  # every instance holds the same weights, bit for bit
            a, b = (ex.fetch(model, i) for i, inst in enumerate(ex.view.instances) if inst.model == model)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert "lm_head.weight" not in ex.fetch("actor", gen)  # still tied after the pipelined step
        # a pipelined inference node's outputs (from its last stage) match one process
        batch = _seq_batch(8)
        local = ex.mirror.run_node("ref", batch, 3).outputs["logprobs"]
        remote = ex.pull(ex.run_node("ref", batch, 3).outputs).tensor("logprobs")  # kept on the workers
        assert (remote - local).abs().max() < 1e-5
        # checkpoint state: each stage's optimizer shards, restored under the same plan
        state = ex.state_dict()
        train = ex.view.node_instance["actor_train"]
        steps = [state["workers"][r]["instances"][train]["version"] for r in range(4)]
        assert steps == [8, 8, 8, 8]  # 2 iterations x 2 epochs x 2 mini-batches on every stage
        ex.load_state_dict(state)
    finally:
        ex.close(force=True)


PLAN_GEN = """
plan:
  actor_gen: {GEN}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d1t2p1m1}
  critic_values: {devices: 0-1, layout: d2t1p1m1}
  actor_train: {devices: 0-1, layout: d1t2p1m1}
  critic_train: {devices: 0-1, layout: d2t1p1m1}
"""


def _learning(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics that depend on what was sampled and learned (not on times, bytes or placement)."""
    groups = ("actor", "critic", "rollout", "response_length")
    return {k: v for k, v in metrics.items() if k.split("/")[0] in groups}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_with_pipelined_generation_matches_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tier 4, 2 processes: PPO with actor_gen's built-in loop on two pipeline stages (d1t1p2) learns what
    the same plan with actor_gen on one device (d1t1p1: the same dp rank, hence the same seed) learns, for
    two iterations; the weight sync into the stages is the planned reallocation, and the sampler's
    log-probs equal the trained weights' (the stages sampled with the synced weights)."""
    made = _record_executors(monkeypatch)
    runs: dict[str, dict[str, float]] = {}
    for tag, gen in (("one", "{devices: 0, layout: d1t1p1m1}"), ("pp", "{devices: 0-1, layout: d1t1p2m1}")):
        g = _graph(PLAN_GEN.replace("{GEN}", gen), 2, "run.iterations=2", f"run.output_dir={tmp_path / tag}")
        ex = None
        try:
            result = Controller(g).run()
            ex = made[-1]
            assert result.iteration == 2
            runs[tag] = result.metrics
            if tag == "pp":
                assert ex.view.meshes["actor_gen"].pp == 2
                assert ex.realloc_counts["gather"] == 0 and ex.realloc_counts["plan"] > 0
        finally:
            if made:
                made[-1].close(force=True)
    one, pp = _learning(runs["one"]), _learning(runs["pp"])
    assert one.keys() == pp.keys() and "actor/pg_loss" in one and "response_length/mean" in one
    assert pp["rollout/logprob_gap_mean"] < 1e-5
    # each worker reports its own peak memory (not the controller's: fresh-user finding)
    memory = {k: v for k, v in runs["pp"].items() if k.startswith("memory_bytes/")}
    assert set(memory) == {"memory_bytes/0", "memory_bytes/1"} and min(memory.values()) > 0, memory
    for key, value in one.items():
        assert abs(pp[key] - value) <= 1e-4 * max(1.0, abs(value)), (key, value, pp[key])


def test_generation_scope_refuses_mixed_attention_layers() -> None:
    """A model whose layers mix attention types (``layer_types``: sliding and full) cannot generate on
    pipeline stages (its cache types layers by index); a plain model passes untouched off a stage."""
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.pipeline import STAGE_ATTR as _STAGE_ATTR
    from rlflow.schedulers.runtime.distributed.pipeline import generation_scope
    from rlflow.schedulers.runtime.distributed.pipeline_stage import PipelineStage

    lm = build_model(config=PP_CONFIG, seed=0)
    with generation_scope(lm):  # not a stage: nothing to do
        pass
    lm.__dict__[_STAGE_ATTR] = PipelineStage(0, 2, (0, 1), None, None, torch.device("cpu"))
    lm.config.layer_types = ["sliding_attention", "full_attention"] * 2 + ["full_attention"]
    with pytest.raises(PlanError, match=r"one attention type in every layer"), generation_scope(lm):
        pass
    assert lm.__dict__[_STAGE_ATTR].generating is False
