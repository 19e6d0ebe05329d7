"""On-policy distillation: the train node function ``distill_actor`` and its pre-launch check.

The student samples (a ``generate`` node), a frozen teacher scores every sampled token (a ``logprobs``
inference node on the teacher model, output bound to ``teacher_logprobs``), and ``distill_actor`` trains
the student with the per-token reverse KL to the teacher as its advantage
(:func:`rlflow.nodes.rl.distill.reverse_kl_advantages`), optionally plus a task reward's GRPO advantage,
through the clipped policy-gradient loop every actor shares (:func:`rlflow.nodes.functions.policy.pg_train`).

Shapes (DESIGN.md): B rows, R response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.context import config_int
from rlflow.dataflow.errors import NodeError, RlflowError
from rlflow.dataflow.model_spec import model_tokenizer
from rlflow.dataflow.registry import node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions.common import SEQ, sequence_tokens
from rlflow.nodes.functions.policy import first_pass_share, pg_train
from rlflow.nodes.functions.schemas import PG_ARG_INPUTS, pg_args
from rlflow.nodes.tokenizers import load_tokenizer

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["DISTILL_ARGS", "REVERSE_KL", "distill_actor", "distill_mistakes"]

REVERSE_KL = "actor/reverse_kl"
"""Metric: the mean over the trainable tokens of ``log π(y_t) − log π_T(y_t)`` (nats per token), the sampled
estimate of the student's reverse KL to the teacher on its own samples (Thinking Machines' ``teacher_kl``);
it falls as the student learns."""

_TM = "Lu, Thinking Machines Lab 2025, On-Policy Distillation (tinker-cookbook kl_penalty_coef)"
_NO_REF = ("kl_loss_coef", "kl_loss_type")  # no reference model here: the teacher is the anchor
DISTILL_ARGS = (
    Arg(
        "distill_coef",
        float,
        1.0,
        "weight of the distillation advantage −(log π − log π_teacher) per token",
        f"{_TM}; slime --opd-kl-coef (default 1)",
        low=0,
        low_open=True,
    ),
    Arg(
        "reward_coef",
        float,
        0.0,
        "weight of the task reward's GRPO advantage (input scores) added to the distillation advantage "
        "(0: pure distillation, scores unbound)",
        "slime OPD: A_t − λ·(log π − log π_teacher) on top of any advantage estimator",
        low=0,
    ),
    Arg(
        "std",
        str,
        "group",
        "the task reward's normaliser (read when reward_coef > 0): the group's std (GRPO), the batch's std "
        "or none (Dr. GRPO; the tinker-cookbook's group-centred reward)",
        "Shao et al. 2024; Liu et al. 2025",
        choices=("group", "batch", "none"),
    ),
    Arg(
        "eps",
        float,
        1e-6,
        "added to the task reward's std (read when reward_coef > 0)",
        "Shao et al. 2024",
        low=0,
    ),
    *(a for a in pg_args() if a.name not in _NO_REF),
)
"""``distill_actor``'s arguments: the distillation and task-reward weights, then the clipped
policy-gradient loop's (:func:`rlflow.nodes.functions.schemas.pg_args`) without the KL-to-reference loss."""


def _inputs(graph: Graph, node: str) -> Mapping[str, str]:
    """``node``'s bound inputs, parameter -> key (a validated graph holds them resolved to a mapping)."""
    bound = graph.node(node).inputs
    assert isinstance(bound, Mapping)
    return bound


def _teacher(graph: Graph, node: str) -> tuple[str, str | None]:
    """(the node producing ``node``'s ``teacher_logprobs``, that node's model)."""
    producer = graph.producer(_inputs(graph, node)["teacher_logprobs"])
    return producer, (None if producer == "data" else graph.node(producer).model)


def _vocabulary(directory: str) -> dict[str, int] | None:
    try:
        return dict(load_tokenizer(directory).get_vocab())
    except RlflowError:  # a missing or unreadable directory is reported by `validate`'s file check
        return None


def _tokenizer_mistake(graph: Graph, teacher: str, student: str) -> str | None:
    """Why the teacher cannot score the student's token ids (another vocabulary size or tokenizer); None
    when it can (or when a size or tokenizer is not known yet: a path an earlier stage writes)."""
    sizes = {m: config_int(graph, m, "vocab_size") for m in (teacher, student)}
    if None not in sizes.values() and sizes[teacher] != sizes[student]:
        return f"has vocab_size {sizes[teacher]} but the student model '{student}' has {sizes[student]}"
    dirs = {m: model_tokenizer(graph.spec.models, m) for m in (teacher, student)}
    if None in dirs.values() or dirs[teacher] == dirs[student]:
        return None
    theirs, ours = _vocabulary(str(dirs[teacher])), _vocabulary(str(dirs[student]))
    if theirs is None or ours is None or theirs == ours:
        return None
    differ = sorted(t for t, i in ours.items() if theirs.get(t) != i)
    return (
        f"has tokenizer '{dirs[teacher]}', whose vocabulary differs from the student's '{dirs[student]}' "
        f"({len(differ)} of the student's tokens have another id or none, e.g. {differ[:3]})"
        if differ
        else f"has tokenizer '{dirs[teacher]}' with tokens the student's '{dirs[student]}' lacks"
    )


def distill_mistakes(graph: Graph, node: str) -> list[str]:
    """``distill_actor``'s pre-launch check (``rlflow validate`` and before a run starts), one message per
    mistake naming the file, node and key:

    * ``teacher_logprobs`` must come from an inference node running ``logprobs`` on another model than the
      student's, without ``top_k``/``top_p`` (a sampled token outside the teacher's kept set would have
      log-prob −inf, an infinite advantage);
    * the teacher must be frozen: no train node of the graph trains it and it follows no EMA (a teacher
      that moves is another algorithm, e.g. co-distillation; refused rather than run silently);
    * the teacher scores the student's token ids, so both need one vocabulary: another ``vocab_size`` or a
      tokenizer whose vocabulary differs is refused (distillation across tokenizers is not supported);
    * ``scores`` is bound exactly when ``reward_coef`` > 0, ``std``/``eps`` are set only then, and then the
      rows come in groups of at least 2 samples per prompt that no mini-batch splits (GRPO's group
      statistics).
    """
    src = graph.spec.source or "<graph>"
    spec, args = graph.node(node), graph.args(node)
    student = spec.model
    key = f"{src}: nodes.{node}.inputs.teacher_logprobs"
    out: list[str] = []
    producer, teacher = _teacher(graph, node)
    fn = graph.node(producer).function if producer != "data" else None
    if fn != "logprobs" or teacher is None:
        out.append(
            f"{key}: comes from {'the data set' if fn is None else f'node {producer!r} (function {fn!r})'}; "
            "the teacher's log-probs come from an inference node running function 'logprobs' on the "
            "teacher model"
        )
    elif teacher == student:
        out.append(
            f"{key}: node '{producer}' runs the student model '{student}' itself; its log-probs are the "
            "student's, the reverse KL would be 0: run it on the teacher model"
        )
    else:
        for arg in ("top_k", "top_p"):
            if graph.args(producer).get(arg) is not None:
                out.append(
                    f"{src}: nodes.{producer}.args.{arg}: the teacher's log-probs must cover every token "
                    f"the student samples; under {arg} a token outside the kept set has log-prob -inf "
                    "(an infinite advantage): leave it null"
                )
        trainers = [n for n, s in graph.spec.nodes.items() if s.kind == "train" and s.model == teacher]
        where = f"{key}: the teacher model '{teacher}' (node '{producer}')"
        if trainers:
            out.append(
                f"{where} is trained by node '{trainers[0]}'; a distillation teacher is frozen (train it in "
                "an earlier stage, e.g. `rlflow run teacher.yaml distill.yaml`)"
            )
        if graph.spec.models[teacher].ema is not None:
            out.append(f"{where} follows an EMA of another model; a distillation teacher is frozen")
        if student is not None and (why := _tokenizer_mistake(graph, teacher, student)):
            out.append(
                f"{where} {why}: the teacher scores the student's token ids, so both need one tokenizer "
                "and vocabulary (distillation across tokenizers is not supported)"
            )
    out += _reward_mistakes(graph, node, args)
    return out


def _reward_mistakes(graph: Graph, node: str, args: dict[str, Any]) -> list[str]:
    src = f"{graph.spec.source or '<graph>'}: nodes.{node}"
    bound = _inputs(graph, node).get("scores") is not None
    mixed = args["reward_coef"] > 0
    if mixed and not bound:
        return [
            f"{src}.inputs.scores: args.reward_coef is {args['reward_coef']:g}, which mixes in a task "
            "reward, but the node does not bind input 'scores' (bind a reward node's scores, or set "
            "reward_coef: 0)"
        ]
    if bound and not mixed:
        return [
            f"{src}.inputs.scores: bound, but args.reward_coef is 0: the reward would be ignored (set "
            "reward_coef > 0, or unbind scores)"
        ]
    defaults = {a.name: a.default for a in DISTILL_ARGS}
    if not mixed:
        unread = [k for k in ("std", "eps") if args[k] != defaults[k]]
        return [f"{src}.args.{k}: is read only when reward_coef > 0" for k in unread]
    g, spec = graph.group_size(node), graph.node(node)
    why = "GRPO normalises each reward by its prompt's group (Shao et al., 2024)"
    if g < 2:
        return [f"{src}: reward_coef > 0 needs groups of at least 2 samples per prompt (upstream generate "
                f"args.n is {g}): {why}"]  # fmt: skip
    per_mb = graph.rows(node) // spec.mini_batches
    if per_mb % g:
        return [f"{src}.mini_batches: {spec.mini_batches} mini-batches of {per_mb} rows would split "
                f"groups of n={g} samples: {why}"]  # fmt: skip
    return []


@node_function(
    "distill_actor",
    "train",
    inputs=(*SEQ, "logprobs", "teacher_logprobs", "scores"),
    optional_inputs=("scores",),
    heads=("lm",),
    arg_inputs=PG_ARG_INPUTS,
    first_pass=first_pass_share,
    check=distill_mistakes,
    args=DISTILL_ARGS,
)
def distill_actor(
    ctx: NodeContext,
    batch: Batch,
    *,
    distill_coef: float,
    reward_coef: float,
    std: str,
    eps: float,
    **pg: Any,
) -> NodeResult:
    """On-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines 2025): the student's per-token
    reverse KL to a frozen teacher, on the student's own samples, as a policy-gradient advantage.

    Inputs: the student's samples ``prompt_ids``/``prompt_mask`` ``[B,S]``, ``response_ids``/``response_mask``
    ``[B,R]``, the sampler's ``logprobs`` ``[B,R]`` (log π of each sampled token), the teacher's
    ``teacher_logprobs`` ``[B,R]`` (a ``logprobs`` node on the teacher model), and, with ``reward_coef`` > 0,
    a task reward's ``scores`` ``[B]``.

    Advantage per token (:func:`rlflow.nodes.rl.distill.reverse_kl_advantages`):
    ``A_t = reward_coef·A^GRPO_t − distill_coef·(log π(y_t) − log π_T(y_t))``, constant (stop-gradient), no
    sum over later tokens (discount 0), ``log π`` the sampler's. Through
    :func:`~rlflow.nodes.functions.policy.pg_train` and its ``loss`` (PPO's clipped surrogate by default; on
    fresh samples the ratio is 1 and the gradient is the plain policy gradient, Thinking Machines'
    importance-sampling loss) its expected gradient per visited prefix is ``distill_coef·∇KL(π‖π_T)``.

    Which form, and why: the sampled-token estimate with a policy-gradient update is what Thinking Machines'
    tinker-cookbook (``incorporate_kl_penalty``: advantage ``−kl_penalty_coef·(sampled − teacher``
    ``log-probs)``), slime's OPD (``--opd-kl-coef``, added to any estimator's advantage) and verl's on-policy
    distillation in its policy-gradient mode do. It needs only the teacher's log-prob of each sampled token,
    ``[B,R]`` along a graph edge, so the teacher is an ordinary inference node the planner places anywhere.
    TRL's ``GKDTrainer`` instead minimises a full-vocabulary generalised JSD (``beta`` = 1: reverse KL),
    which needs the teacher's ``[B,R,V]`` distribution in the trainer; rlflow does not offer that form.

    Metrics: :data:`REVERSE_KL` (``actor/reverse_kl``), ``critic/advantages/mean``, and the loop's
    (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/entropy``, ``actor/grad_norm``, ...).

    Raises:
        NodeError: ``scores`` absent with ``reward_coef`` > 0 (graph validation binds it; a direct call may
            not), or a non-finite log-prob on a trainable token (names the node).
    """
    mask = batch.tensor("response_mask")
    task = None
    if reward_coef > 0:
        if "scores" not in batch:
            raise NodeError(f"node '{ctx.node.name}': reward_coef > 0 reads input 'scores', not in the batch")
        task = rl.grpo_advantages(
            batch.tensor("scores"), mask, ctx.group_size, std=std, eps=eps, all_sum=ctx.train_hooks.all_sum
        )
    try:
        adv, reverse_kl = rl.reverse_kl_advantages(
            batch.tensor("logprobs"), batch.tensor("teacher_logprobs"), mask,
            coef=distill_coef, task_advantages=task, task_coef=reward_coef,
        )  # fmt: skip
    except rl.RLInputError as e:
        raise NodeError(f"node '{ctx.node.name}': {e}") from e
    metrics = pg_train(ctx, batch, adv, **pg, kl_loss_coef=0.0, kl_loss_type="k3")
    tokens = max(1, int(mask.sum()))
    metrics[REVERSE_KL] = float(rl.masked_sum(reverse_kl, mask)) / tokens
    metrics["critic/advantages/mean"] = float(rl.masked_sum(adv, mask)) / tokens
    return NodeResult({}, metrics, sequence_tokens(batch) * ctx.node.epochs)
