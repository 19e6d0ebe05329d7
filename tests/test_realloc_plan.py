"""Reallocation plan and sharding convention: golden shards and an exactly-once property test."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.realloc.planning import plan_reallocation
from rlflow.schedulers.realloc.shards import ModelMeta, param_shards, stage_layers

# hidden 8, 4 heads of dim 2, 2 kv heads (kv_dim 4), intermediate 16, vocab 16: split dims divide by 4.
TINY = dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16)


def tiny(layers: int, tied: bool) -> ModelShape:
    return ModelShape.from_config({**TINY, "num_hidden_layers": layers, "tie_word_embeddings": tied})


def test_param_shards_golden() -> None:
    shape = tiny(3, tied=False)
    shards = param_shards(shape.param_shapes(), ModelMeta(3), (4, 5, 6, 7), Layout(1, 2, 2))
    # position r: tp = r % 2, pp = r // 2 -> device 4: (tp0, pp0), 5: (tp1, pp0), 6: (tp0, pp1), 7: (tp1, pp1)
    # 3 layers on 2 stages -> stage 0 has layers 0-1, stage 1 has layer 2.
    assert [list(r) for r in stage_layers(3, 2)] == [[0, 1], [2]]
    q = "model.layers.0.self_attn.q_proj.weight"  # [8, 8], column parallel: rows split
    assert shards[5][q] == (slice(4, 8), slice(0, 8))
    o = "model.layers.2.self_attn.o_proj.weight"  # row parallel: columns split, on stage 1 only
    assert shards[6][o] == (slice(0, 8), slice(0, 4)) and o not in shards[4]
    assert shards[7]["lm_head.weight"] == (slice(8, 16), slice(0, 8))  # vocab parallel, last stage
    assert shards[5]["model.embed_tokens.weight"] == (slice(8, 16), slice(0, 8))
    assert "model.embed_tokens.weight" not in shards[6]  # untied: embedding only on the first stage
    assert shards[6]["model.norm.weight"] == (slice(0, 8),)  # replicated
    tied = param_shards(tiny(3, True).param_shapes(), ModelMeta(3, True), (0, 1, 2, 3), Layout(1, 2, 2))
    assert tied[2]["model.embed_tokens.weight"] == tied[0]["model.embed_tokens.weight"]  # head stage holds it


def _layouts(n: int) -> list[Layout]:
    return [
        Layout(d, t, n // (d * t))
        for d in (1, 2, 4)
        for t in (1, 2, 4)
        if n % (d * t) == 0 and n // (d * t) <= 3
    ]


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[tuple[int, ...], Layout, tuple[int, ...], Layout, bool, int]:
    layers = draw(st.integers(3, 4))
    tied = draw(st.booleans())
    sizes = [1, 2, 4]
    n_src, n_dst = draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes))
    src_l = draw(st.sampled_from([lay for lay in _layouts(n_src) if lay.pp <= layers]))
    dst_l = draw(st.sampled_from([lay for lay in _layouts(n_dst) if lay.pp <= layers]))
    src_off, dst_off = draw(st.integers(0, 4)), draw(st.integers(0, 4))  # overlapping or disjoint meshes
    src_devs = tuple(range(src_off, src_off + n_src))
    dst_devs = tuple(draw(st.permutations(range(dst_off, dst_off + n_dst))))
    return src_devs, src_l, dst_devs, dst_l, tied, layers


@settings(max_examples=60, deadline=None)
@given(layout_pairs())
def test_every_target_element_written_exactly_once_by_a_holder(
    case: tuple[tuple[int, ...], Layout, tuple[int, ...], Layout, bool, int],
) -> None:
    src_devs, src_l, dst_devs, dst_l, tied, layers = case
    shape = tiny(layers, tied)
    shapes = shape.param_shapes()
    meta = ModelMeta(layers, tied)
    src = param_shards(shapes, meta, src_devs, src_l)
    dst = param_shards(shapes, meta, dst_devs, dst_l)
    plan = plan_reallocation(shapes, meta, src_devs, src_l, dst_devs, dst_l, dtype_bytes=2)
    writes = {(d, name): np.zeros(shapes[name], dtype=np.int64) for d in dst_devs for name in dst[d]}
    for tr in plan.transfers:
        held = src[tr.src][tr.param]  # the sender holds the parameter ...
        for s_held, s_sent in zip(held, tr.slices, strict=True):  # ... and the whole slice it sends
            assert s_held.start <= s_sent.start and s_sent.stop <= s_held.stop
        assert tr.bytes == 2 * int(np.prod([s.stop - s.start for s in tr.slices]))
        for d in tr.dsts:
            writes[(d, tr.param)][tr.slices] += 1
    for (d, name), count in writes.items():
        region = count[dst[d][name]]
        assert (region == 1).all(), f"{name} on device {d} written {region.min()}..{region.max()} times"
        mask = np.ones_like(count, dtype=bool)
        mask[dst[d][name]] = False
        assert (count[mask] == 0).all(), "a write landed outside the target shard"
    # No device receives more than its own target shard (no full-model gather).
    for d, received in plan.received_bytes().items():
        own = sum(2 * int(np.prod([s.stop - s.start for s in sl])) for sl in dst[d].values())
        assert received <= own


def test_identical_layout_is_all_local_and_sources_are_balanced() -> None:
    shape = tiny(4, tied=False)
    shapes, meta = shape.param_shapes(), ModelMeta(4)
    same = plan_reallocation(shapes, meta, (0, 1), Layout(1, 2, 1), (0, 1), Layout(1, 2, 1))
    assert same.remote_bytes == 0 and all(t.is_local for t in same.transfers)
    # 4 dp replicas send a d1t1p1 copy to device 4: the greedy spreads the sends over all 4.
    moved = plan_reallocation(shapes, meta, (0, 1, 2, 3), Layout(4, 1, 1), (4,), Layout(1, 1, 1))
    sent = moved.sent_bytes()
    assert set(sent) == {0, 1, 2, 3}
    assert moved.remote_bytes == 2 * shape.num_params
    assert max(sent.values()) - min(sent.values()) <= 2 * 16 * 16  # at most the biggest matrix apart


# -- expert parallelism: fused expert tensors cut along dim 0 by ep --------------------------------------

# a tiny mixture of experts (transformers 5 names): hidden 8, 2 layers, 4 experts of width 4
# (gate_up_proj [4, 8, 8], down_proj [4, 8, 4]), 4 heads (2 kv), vocabulary 16
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def moe(layers: int) -> ModelShape:
    return ModelShape(8, 16, layers, 4, 2, 16, num_experts=4, experts_per_token=2, moe_intermediate_size=4)


def test_expert_shards_golden() -> None:
    shapes = moe(2).param_shapes()
    assert shapes[GATE_UP] == (4, 8, 8) and shapes[DOWN] == (4, 8, 4)
    # d4e2: dp ranks 0-3; ep groups (0, 1), (2, 3): dp rank d holds expert block d % 2 = experts [2j, 2j+2)
    shards = param_shards(shapes, ModelMeta(2), (0, 1, 2, 3), Layout(4, 1, 1, 1, ep=2))
    assert [shards[d][DOWN][0] for d in range(4)] == [slice(0, 2), slice(2, 4), slice(0, 2), slice(2, 4)]
    assert shards[1][GATE_UP] == (slice(2, 4), slice(0, 8), slice(0, 8))  # other dims whole
    assert shards[3]["model.layers.0.self_attn.q_proj.weight"] == (slice(0, 8), slice(0, 8))  # dense: whole
    # d2t2p1e2 (positions: tp fastest): devices 0, 1 are dp rank 0 (tp 0, 1), devices 2, 3 dp rank 1;
    # the experts are whole over tp, split over the ep group (dp ranks 0, 1); o_proj is split over tp
    tp = param_shards(shapes, ModelMeta(2), (0, 1, 2, 3), Layout(2, 2, 1, 1, ep=2))
    assert [tp[d][GATE_UP][0] for d in range(4)] == [slice(0, 2), slice(0, 2), slice(2, 4), slice(2, 4)]
    assert tp[1]["model.layers.0.self_attn.o_proj.weight"] == (slice(0, 8), slice(4, 8))
    # d2t1p2e2: stage 0 (devices 0, 1) holds layer 0's experts, stage 1 (devices 2, 3) layer 1's
    pp = param_shards(shapes, ModelMeta(2), (0, 1, 2, 3), Layout(2, 1, 2, 1, ep=2))
    layer1 = DOWN.replace("layers.0", "layers.1")
    assert pp[1][DOWN][0] == slice(2, 4) and DOWN not in pp[2] and pp[2][layer1][0] == slice(0, 2)


def test_expert_reallocation_moves_each_block_once_per_receiver() -> None:
    shapes = moe(2).param_shapes()
    meta = ModelMeta(2)
    per_expert = 2 * (8 * 8 + 8 * 4)  # bytes of one expert's gate_up_proj and down_proj rows (bf16)
    # d4e4 -> d4e2 on the same 4 devices: every dense tensor is a local copy; expert e (held by device e)
    # is needed by the dp ranks d with d % 2 == e // 2: expert 0 -> devices 0 (local), 2; expert 1 -> 0, 2;
    # expert 2 -> 1, 3; expert 3 -> 1, 3 (local): 6 remote receives per layer
    plan = plan_reallocation(shapes, meta, (0, 1, 2, 3), Layout(4, 1, 1, 1, ep=4), (0, 1, 2, 3),
                             Layout(4, 1, 1, 1, ep=2))  # fmt: skip
    assert plan.remote_bytes == 2 * 6 * per_expert
    assert all("experts" in t.param for t in plan.transfers if not t.is_local)
    # d2e2 -> d1t2 on the same 2 devices: each device receives the 2 experts it lacks, once: 2 per layer
    plan = plan_reallocation(shapes, meta, (0, 1), Layout(2, 1, 1, 1, ep=2), (0, 1), Layout(1, 2, 1))
    experts_moved = sum(
        t.bytes * len(t.dsts) for t in plan.transfers if not t.is_local and "experts" in t.param
    )
    assert experts_moved == 2 * 2 * 2 * per_expert
    # ... and ep=1 (whole experts on every dp rank) -> ep 2: no remote bytes at all
    plan = plan_reallocation(shapes, meta, (0, 1), Layout(2, 1, 1), (0, 1), Layout(2, 1, 1, 1, ep=2))
    assert plan.remote_bytes == 0


def _moe_layouts(n: int, layers: int) -> list[Layout]:
    out = []
    for lay in _layouts(n):
        if lay.pp <= layers:
            out += [Layout(lay.dp, lay.tp, lay.pp, 1, ep=e) for e in (1, 2, 4) if lay.dp % e == 0]
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_expert_layouts_write_every_element_once(data: st.DataObject) -> None:
    layers = data.draw(st.integers(2, 3))
    n_src, n_dst = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 2, 4]))
    src_l = data.draw(st.sampled_from(_moe_layouts(n_src, layers)))
    dst_l = data.draw(st.sampled_from(_moe_layouts(n_dst, layers)))
    src_devs = tuple(range(n_src))
    dst_devs = tuple(data.draw(st.permutations(range(data.draw(st.integers(0, 2)), 0 + n_dst + 2)))[:n_dst])
    shapes = moe(layers).param_shapes()
    meta = ModelMeta(layers)
    src = param_shards(shapes, meta, src_devs, src_l)
    dst = param_shards(shapes, meta, dst_devs, dst_l)
    plan = plan_reallocation(shapes, meta, src_devs, src_l, dst_devs, dst_l, dtype_bytes=2)
    writes = {(d, name): np.zeros(shapes[name], dtype=np.int64) for d in dst_devs for name in dst[d]}
    for tr in plan.transfers:
        held = src[tr.src][tr.param]
        assert all(h.start <= s.start and s.stop <= h.stop for h, s in zip(held, tr.slices, strict=True))
        for d in tr.dsts:
            writes[(d, tr.param)][tr.slices] += 1
    for (d, name), count in writes.items():
        assert (count[dst[d][name]] == 1).all(), f"{src_l} -> {dst_l}: {name} on {d}"
        assert int(count.sum()) == int(np.prod([s.stop - s.start for s in dst[d][name]]))
    for d, received in plan.received_bytes().items():  # no device receives more than its own shard
        assert received <= sum(2 * int(np.prod([s.stop - s.start for s in sl])) for sl in dst[d].values())
