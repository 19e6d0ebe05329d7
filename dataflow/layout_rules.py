"""The one rule for whether a layout can run a node: degrees and sizes, no devices.

Every place that judges a layout asks :func:`layout_problem`: the graph's plan checks
(:class:`~rlflow.dataflow.graph.Graph`), the cost model and the search (``rlflow.schedulers.planner``),
``plan: auto`` and the distributed runtime's plan view. A layout ``d{dp}t{tp}p{pp}m{m}`` can run a node when:

- a generate node with ``engine: vllm`` has ``pp = 1`` (rlflow starts vLLM without pipeline stages); with
  ``tp`` > 1 the distributed runtime starts one vLLM engine per tp group with ``tensor_parallel_size = tp``.
  The built-in generation loop runs on pipeline stages (``pp`` > 1: each decode step passes the stages in
  turn and the last stage's logits are broadcast along the chain,
  :mod:`rlflow.schedulers.runtime.distributed.pipeline`), which is how a model too large for one host's
  devices generates; an ``agent_generate`` node stays at ``pp = 1`` (every stage would step its own
  environments, and a tool's timeout can differ between them), and so does a model whose layers mix
  attention types (``layer_types``, e.g. Qwen2's or Gemma's sliding and full layers: the KV cache types
  its layers by index, which a stage's local indices would mismatch). The single-process runtime runs ``d1t1``
  layouts only, for every engine;
- a train node with ``engine: deepspeed`` has ``tp = pp = 1`` (rlflow runs DeepSpeed ZeRO data parallel
  only);
- ``tp`` divides the model's ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` and
  ``vocab_size`` (tensor parallel shards heads, the MLP and the vocabulary evenly; kv heads are split,
  not replicated). vLLM's own tensor parallel needs less (``num_attention_heads`` and ``intermediate_size``
  divisible by tp; kv heads may be replicated, the vocabulary is padded), and a vLLM generate node's model
  instance is sharded by rlflow too, so these checks cover it; their reason then says that vLLM shards the
  field as well;
- ``pp`` is at most ``num_hidden_layers`` (a pipeline stage holds at least one decoder layer);
- ``ep`` > 1 (expert parallel) needs a mixture-of-experts model whose expert count (``num_experts``,
  Qwen2/3-MoE; ``num_local_experts``, Mixtral; ``n_routed_experts``, DeepSeek) ``ep`` divides, on a train
  or inference node whose engine shards experts: rlflow's own (FSDP2) path, not DeepSpeed ZeRO (rlflow
  passes whole modules to it); a ``generate`` node on the built-in loop, whose ep group decodes in lockstep
  (every MoE layer is an all-to-all over the group, so a rank whose rows have finished forwards a dummy row
  until the group's last row has), not one with ``engine: vllm`` (vLLM holds its experts its own way) nor
  an ``agent_generate`` node (its turns end at environment steps that differ per rank);
  with tp > 1 each tp rank's dp ranks form their own ep groups and the experts are replicated over tp
  (expert tensor parallel size 1), and with pp > 1 each pipeline stage's dp ranks do (a stage dispatches
  its own MoE layers' tokens over its own ep group, every micro-batch of the schedule; Megatron-Core builds
  its expert groups per pipeline stage the same way). How ep composes with dp: the ``ep`` ranks
  are carved out of the data-parallel ranks (``ep`` divides ``dp``, checked by :class:`Layout`), as
  Megatron-LM's ``expert_model_parallel_size`` (which must divide the data-parallel size; Megatron-Core
  MoE docs, "Expert Parallelism") and verl's Megatron backend do: an ep group is ``ep`` consecutive dp
  ranks, which split every MoE block's experts ``ep`` ways (all-to-all token dispatch); the ranks holding
  the same experts (``dp / ep`` of them) are the experts' data-parallel group, and every non-expert
  parameter stays data parallel over all ``dp`` ranks
  (:mod:`rlflow.schedulers.runtime.distributed.experts`);
- the node's rows (prompts for a generate node, samples otherwise: ``Graph.rows``) divide into
  ``mini_batches × dp × m`` equal shares;
- a dp rank keeps whole groups of samples per prompt (``group_size`` > 1, not a generate node).

Checks that need a built module (actual parameter shapes) stay with the runtime.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.plan_spec import Layout

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "EXPERT_FIELDS",
    "TP_FIELDS",
    "LayoutProblem",
    "attention_kinds",
    "expert_counts",
    "layout_problem",
    "model_config",
    "node_layout_problem",
]

# Model config fields that count a mixture-of-experts model's routed experts (Qwen2/3-MoE, Mixtral, DeepSeek).
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Model config fields tensor parallel splits ``tp`` ways.
TP_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
# Of those, the ones vLLM's tensor parallel itself splits evenly (``ModelConfig.verify_with_parallel_config``:
# attention heads; ``MergedColumnParallelLinear``: the MLP); kv heads it replicates when tp exceeds them,
# the vocabulary it pads.
_VLLM_TP_FIELDS = ("num_attention_heads", "intermediate_size")


class LayoutProblem(str):
    """Why a layout cannot run a node: the reason (a ``str``) plus what it is about.

    Attributes:
        key: the field at fault: a model config field (``TP_FIELDS``, ``num_hidden_layers``,
            ``layer_types``, ``EXPERT_FIELDS``) or a layout / node field (``pp``, ``ep``, ``mini_batches``,
            ``dp``, ``micro_batches``, ``group_size``).
        value: that field's size in the model config (tp, pp and expert-count problems; the number of
            attention types for ``layer_types``), ``ep`` for an ep problem of the node or engine, else the
            rows being divided.
    """

    key: str
    value: int

    def __new__(cls, reason: str, key: str, value: int) -> LayoutProblem:
        problem = super().__new__(cls, reason)
        problem.key, problem.value = key, value
        return problem


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layout_problem(
    kind: str,
    rows: int,
    mini_batches: int,
    group_size: int,
    config: Mapping[str, Any] | None,
    layout: Layout,
    model: str = "",
    engine: str = "builtin",
    function: str = "",
) -> LayoutProblem | None:
    """Why ``layout`` cannot run a node (None when it can).

    Args:
        kind: ``generate``, ``inference`` or ``train``.
        rows: rows the node splits per iteration: prompts for a generate node (each rank samples
            ``group_size`` per prompt), samples otherwise (``Graph.rows``).
        mini_batches: optimizer steps per epoch (1 for nodes that do not train).
        group_size: samples per prompt in the node's rows (``Graph.group_size``).
        config: the model's HF config fields (``None``: unknown, no model-size checks; a non-integer
            field is not checked).
        layout: the degrees and micro-batch count.
        model: the model's name, for the reason.
        engine: a generate node's engine (``builtin`` or ``vllm``; ``auto`` is checked as ``builtin``:
            the planner asks again for the engine it chooses), a train node's (``builtin`` or ``deepspeed``).
        function: the node's function (``agent_generate`` stays off pipeline stages and expert parallel).

    Returns:
        the first problem in the order of the module docstring's list, or None.
    """
    dp, tp, pp, m = layout.dp, layout.tp, layout.pp, layout.micro_batches
    if kind == "generate" and engine == "vllm" and pp > 1:
        reason = (
            f"the vLLM engine runs without pipeline stages here (layout {layout} has pp={pp}; use pp=1, or "
            "engine: builtin, whose generation loop runs on pipeline stages)"
        )
        return LayoutProblem(reason, "pp", pp)
    if kind == "generate" and function == "agent_generate" and pp > 1:
        reason = (
            f"an agent_generate node cannot run on pipeline stages (layout {layout} has pp={pp}): every "
            "stage would step its own environments, whose observations can differ (a tool's timeout); "
            "use pp=1"
        )
        return LayoutProblem(reason, "pp", pp)
    kinds = attention_kinds(config) if kind == "generate" and pp > 1 else frozenset()
    if len(kinds) > 1:
        reason = (
            f"generation on pipeline stages needs one attention type in every layer (layout {layout} has "
            f"pp={pp}); model '{model}' mixes {', '.join(sorted(kinds))} (layer_types): use pp=1"
        )
        return LayoutProblem(reason, "layer_types", len(kinds))
    if kind == "train" and engine == "deepspeed" and (tp > 1 or pp > 1):
        key, degree = ("tp", tp) if tp > 1 else ("pp", pp)
        reason = (
            f"DeepSpeed ZeRO trains data parallel only (layout {layout} has {key}={degree}; use {key}=1 and "
            "dp for more devices, or engine: builtin for tensor and pipeline parallel)"
        )
        return LayoutProblem(reason, key, degree)
    config = config or {}
    for field in TP_FIELDS:
        size = _int(config.get(field))
        if size is not None and size % tp:
            reason = f"{field}={size} is not divisible by tp={tp}"
            if kind == "generate" and engine == "vllm" and field in _VLLM_TP_FIELDS:
                reason += f" (the vLLM engine splits {field} tp ways too)"
            return LayoutProblem(reason, field, size)
    layers = _int(config.get("num_hidden_layers"))
    if layers is not None and layers < pp:
        reason = f"pp={pp} pipeline stages but model '{model}' has {layers} layers"
        return LayoutProblem(reason, "num_hidden_layers", layers)
    if layout.ep > 1:
        why = _expert_problem(kind, config, layout, model, engine, function)
        if why is not None:
            return why
    mini = max(1, mini_batches)
    if rows % mini or (rows // mini) % dp or (rows // mini // dp) % m:
        key = "mini_batches" if rows % mini else "dp" if (rows // mini) % dp else "micro_batches"
        parts = [f"dp={dp}"]
        parts += [f"{mini} mini-batches"] if mini > 1 else []
        parts += [f"{m} micro-batches"] if m > 1 else []
        return LayoutProblem(f"{rows} rows do not divide into {' × '.join(parts)}", key, rows)
    per_rank = rows // mini // dp
    if kind != "generate" and group_size > 1 and dp > 1 and per_rank % group_size:
        reason = (
            f"dp={dp} leaves {per_rank} rows per data-parallel rank, which split groups of {group_size} "
            "samples per prompt; choose dp so that whole groups stay together"
        )
        return LayoutProblem(reason, "group_size", rows)
    return None


def _expert_problem(
    kind: str, config: Mapping[str, Any], layout: Layout, model: str, engine: str, function: str
) -> LayoutProblem | None:
    """Why ``layout`` (``ep`` > 1) cannot split ``model``'s experts (the module docstring's ep rule)."""
    ep = layout.ep
    if kind == "generate" and engine == "vllm":
        reason = (
            f"a vLLM generate node runs without expert parallel (layout {layout} has ep={ep}; the vLLM "
            "engine holds its experts its own way): use ep=1, or engine: builtin, whose loop decodes an ep "
            "group in lockstep"
        )
        return LayoutProblem(reason, "ep", ep)
    if kind == "generate" and function == "agent_generate":
        reason = (
            f"an agent_generate node runs without expert parallel (layout {layout} has ep={ep}): its turns "
            "end at environment steps that differ per rank, while every MoE layer is an all-to-all over "
            "the ep group; use ep=1"
        )
        return LayoutProblem(reason, "ep", ep)
    if kind == "train" and engine == "deepspeed":
        reason = (
            f"DeepSpeed ZeRO cannot shard experts here (layout {layout} has ep={ep}; use ep=1, or "
            "engine: builtin for expert parallel)"
        )
        return LayoutProblem(reason, "ep", ep)
    counts = expert_counts(config)
    if config and not counts:
        reason = (
            f"ep={ep} splits a mixture-of-experts model's experts, but model '{model}' is dense "
            f"(its config has none of {', '.join(EXPERT_FIELDS)})"
        )
        return LayoutProblem(reason, "ep", ep)
    for field, experts in counts.items():
        if experts % ep:
            reason = f"ep={ep} does not divide model '{model}' {field}={experts}"
            return LayoutProblem(reason, field, experts)
    return None


def expert_counts(config: Mapping[str, Any] | None) -> dict[str, int]:
    """A model's routed-expert counts by config field (:data:`EXPERT_FIELDS`; empty for a dense or unknown
    model): the config's own fields, else those Hugging Face fills in for its ``model_type``
    (``transformers.AutoConfig.for_model``: a ``qwen3_moe`` config without ``num_experts`` has 128)."""
    if not config:
        return {}
    given = {f: v for f in EXPERT_FIELDS if (v := _int(config.get(f)))}
    if given or any(f in config for f in EXPERT_FIELDS):
        return given
    try:
        key = json.dumps(dict(config), sort_keys=True, default=str)
    except (TypeError, ValueError):
        return {}
    return dict(_derived_experts(key))


@functools.lru_cache(maxsize=64)
def _derived_experts(config_json: str) -> tuple[tuple[str, int], ...]:
    config = json.loads(config_json)
    if "model_type" not in config:
        return ()
    try:
        from transformers import AutoConfig

        hf = AutoConfig.for_model(**config)
    except Exception:  # an unknown or malformed model type: reported by validate, not here
        return ()
    return tuple((f, v) for f in EXPERT_FIELDS if (v := _int(getattr(hf, f, None))))


def attention_kinds(config: Mapping[str, Any] | None) -> frozenset[str]:
    """The attention types of a model's layers: its config's ``layer_types``, else those Hugging Face
    derives for its ``model_type`` (``transformers.AutoConfig.for_model``: e.g. Qwen2 with
    ``use_sliding_window``); empty when unknown (no config, an unknown model type, no ``layer_types``)."""
    if not config:
        return frozenset()
    given = config.get("layer_types")
    if isinstance(given, (list, tuple)):
        return frozenset(str(k) for k in given)
    try:
        key = json.dumps(dict(config), sort_keys=True, default=str)
    except (TypeError, ValueError):
        return frozenset()
    return _derived_kinds(key)


@functools.lru_cache(maxsize=64)
def _derived_kinds(config_json: str) -> frozenset[str]:
    config = json.loads(config_json)
    if "model_type" not in config:
        return frozenset()
    try:
        from transformers import AutoConfig

        types = getattr(AutoConfig.for_model(**config), "layer_types", None)
    except Exception:  # an unknown or malformed model type: reported by validate, not here
        return frozenset()
    return frozenset(str(k) for k in types) if isinstance(types, (list, tuple)) else frozenset()


def model_config(graph: Graph, model: str | None) -> Mapping[str, Any] | None:
    """The HF config fields of ``model`` in ``graph``: its own ``config``, else (a copy made with
    ``init_from``) its source's; None for a model-free node or a model known only by its path."""
    models = graph.spec.models
    spec = models[model] if model is not None else None
    while spec is not None and spec.config is None and spec.init_from:
        spec = models[spec.init_from]
    return spec.config if spec is not None and spec.config else None


def node_layout_problem(graph: Graph, node: str, layout: Layout) -> LayoutProblem | None:
    """:func:`layout_problem` for node ``node`` of ``graph``: its kind, rows, mini-batches, group size
    and model config (through ``init_from``) read from the graph."""
    spec = graph.node(node)
    return layout_problem(
        spec.kind,
        graph.rows(node),
        spec.mini_batches,
        graph.group_size(node),
        model_config(graph, spec.model),
        layout,
        spec.model or "",
        graph.engine(node),
        spec.function,
    )
