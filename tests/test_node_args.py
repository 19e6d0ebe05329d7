"""Node functions declare their arguments; bad values stop before launch; the maths reaches the node path.

Issue 13: argument schemas (``rlflow.dataflow.args``), ``rlflow functions``, truncation bootstrapping in PPO,
GSPO's clip range and aggregation, zero-spread groups.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.args import Arg, ArgError, bind_args
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions import policy as F
from rlflow.nodes.functions.schemas import PG_NAMES
from rlflow.nodes.generation import truncated_rows
from rlflow.nodes.rl.policy_losses import POLICY_LOSSES
from rlflow.schedulers.cli import main
from rlflow.schedulers.commands.functions import describe_function

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# -- validate rejects every bad value of the issue, naming file, node and key ---------------------------
BAD = [
    ("examples/grpo.yaml", "nodes.actor_train.args.loss=gspoo",
     "examples/grpo.yaml: nodes.actor_train.args.loss: unknown value 'gspoo' (did you mean 'gspo'?)"),
    ("examples/grpo.yaml", "nodes.actor_train.args.loss=GSPO",
     "examples/grpo.yaml: nodes.actor_train.args.loss: unknown value 'GSPO' (did you mean 'gspo'?)"),
    ("examples/grpo.yaml", "nodes.actor_train.args.std=nonee",
     "examples/grpo.yaml: nodes.actor_train.args.std: unknown value 'nonee' (did you mean 'none'?)"),
    ("examples/grpo.yaml", "nodes.actor_train.args.agg=token-sum",
     "examples/grpo.yaml: nodes.actor_train.args.agg: unknown value 'token-sum' (did you mean"),
    ("examples/grpo.yaml", "nodes.actor_train.args.kl_loss_type=k4",
     "examples/grpo.yaml: nodes.actor_train.args.kl_loss_type: unknown value 'k4'; choices: k1, k2, k3"),
    ("examples/ppo.yaml", "algorithm.gamma=5",
     "examples/ppo.yaml: nodes.actor_train.args.gamma: must be in [0, 1], got 5"),
    ("examples/ppo.yaml", "algorithm.clip_eps=-0.2",
     "examples/ppo.yaml: nodes.actor_train.args.clip_eps: must be in (0, 1), got -0.2"),
    ("examples/grpo.yaml", "nodes.actor_train.args.kl_loss_coef=abc",
     "examples/grpo.yaml: nodes.actor_train.args.kl_loss_coef: must be a finite number, got 'abc'"),
    ("examples/ppo.yaml", "algorithm.kl_coef=-1",
     "examples/ppo.yaml: nodes.actor_train.args.kl_coef: must be >= 0, got -1"),
    ("examples/ppo.yaml", "algorithm.kl_cof=0.5",
     "examples/ppo.yaml: override 'algorithm.kl_cof': no node reads it (nothing in the file refers to "
     "${algorithm.kl_cof}) (did you mean 'kl_coef'?)"),
    ("examples/dpo.yaml", "nodes.actor_train.args.label_smoothing=0.1",
     "examples/dpo.yaml: nodes.actor_train.args.label_smoothing: is read only when loss is cdpo"),
    ("examples/ppo.yaml", "nodes.actor_train.args.clip_epsilon=0.1",
     "examples/ppo.yaml: nodes.actor_train.args.clip_epsilon: function 'ppo_actor' takes no argument "
     "'clip_epsilon' (did you mean 'clip_eps'?)"),
]  # fmt: skip


@pytest.mark.parametrize(("graph_file", "override", "message"), BAD, ids=[b[1] for b in BAD])
def test_validate_rejects_bad_argument(
    graph_file: str, override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", graph_file, override]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_dpo_example_has_an_actor_train_node() -> None:
    """The label_smoothing case above names the DPO train node; check it exists under that name."""
    assert "actor_train:" in (ROOT / "examples/dpo.yaml").read_text()


def test_eps_zero_is_accepted_and_an_unread_algorithm_key_in_the_file_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "examples/grpo.yaml", "nodes.actor_train.args.eps=0"]) == 0
    text = (ROOT / "examples/grpo.yaml").read_text().replace("algorithm: {", "algorithm: {kl_cof: 0.5, ", 1)
    path = tmp_path / "grpo.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 0
    err = capsys.readouterr().err
    assert "algorithm.kl_cof: no node reads it" in err and "(did you mean 'kl_coef'?)" in err


# -- the schema ------------------------------------------------------------------------------------------
def test_arg_checks_types_ranges_and_choices() -> None:
    a = Arg("x", float, 0.5, "a number", low=0, high=1, high_open=True)
    assert a.check(0) == 0.0 and isinstance(a.check(0), float)
    for bad, fragment in (
        (1.0, "must be in [0, 1), got 1.0"),
        (True, "finite number"),
        (float("inf"), "finite"),
    ):
        with pytest.raises(ArgError, match=re.escape(fragment)):
            a.check(bad)
    with pytest.raises(ArgError, match="null is not allowed"):
        a.check(None)
    with pytest.raises(TypeError, match="fails its own schema"):
        Arg("y", int, 0, "count", low=1)
    with pytest.raises(ArgError, match=r"takes no argument 'xx' \(did you mean 'x'\?\); it takes: x"):
        bind_args((a,), {"xx": 1})
    assert bind_args((a,), {}) == {"x": 0.5}
    assert bind_args((a,), {"other": 1}, extra=True) == {"x": 0.5, "other": 1}


def test_every_builtin_declares_its_arguments_and_the_signature_has_no_second_default() -> None:
    """The schema's default is the only default: each function's keyword parameters are exactly its declared
    arguments (``**pg`` collects the policy-gradient ones), with no default of their own."""
    import inspect

    load_builtin_functions()
    for name in NODE_FUNCTIONS.names():
        fn = NODE_FUNCTIONS.get(name)
        assert fn.args is not None, name
        params = inspect.signature(fn.fn).parameters
        declared = {a.name for a in fn.args}
        keyword = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
        assert all(params[p].default is inspect.Parameter.empty for p in keyword), name
        if any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()) and not fn.extra_args:
            # **pg collects the policy-gradient loop's arguments (distill_actor: without the KL-loss pair)
            assert keyword <= declared and declared - keyword <= set(PG_NAMES), name
        else:
            assert keyword == declared, name


def test_registered_function_receives_bound_values(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        F, "_outcome_node", lambda ctx, batch, adv, pg, loss="ppo": seen.update(pg, loss=loss)
    )
    fn = NODE_FUNCTIONS.get("grpo_actor").fn
    ctx, batch = _outcome_ctx([1.0, 0.0]), _outcome_batch([1.0, 0.0])
    fn(ctx, batch, loss="gspo", kl_loss_coef=1)
    assert seen["loss"] == "gspo" and seen["kl_loss_coef"] == 1.0 and isinstance(seen["kl_loss_coef"], float)
    assert seen["clip_eps"] is None and seen["entropy_coef"] == 0.0  # schema defaults, filled
    with pytest.raises(
        ArgError, match=re.escape("node function 'grpo_actor': args.loss: unknown value 'gspoo'")
    ):
        fn(ctx, batch, loss="gspoo")


# -- rlflow functions and the README table ----------------------------------------------------------------
def test_functions_command_lists_every_function_with_its_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["functions"]) == 0
    out = capsys.readouterr().out
    for name in NODE_FUNCTIONS.names():
        assert f"\n{name} (" in f"\n{out}", name
    assert main(["functions", "grpo_actor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("grpo_actor (train, model head lm)")
    assert re.search(r"\n +loss +str, default ppo, one of ppo, gspo", out)
    assert re.search(r"\n +eps +float, default 1e-06, >= 0", out)
    assert main(["functions", "grpo_actr"]) == 2
    assert "did you mean 'grpo_actor'" in capsys.readouterr().err


def _readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "nodes/README.md").read_text()
    section = text.split("## Node functions", 1)[1].split("### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = [m.group(2).strip(), m.group(3).strip()]
    return rows


def test_readme_table_agrees_with_the_registry() -> None:
    rows = _readme_rows()
    names = NODE_FUNCTIONS.names()
    assert set(rows) == set(names)
    for name in names:
        fn = NODE_FUNCTIONS.get(name)
        kind, keys = rows[name]
        assert kind.split()[0] == fn.kind, name
        arg_inputs = tuple(a.name for a in fn.arg_inputs)
        for key in (*fn.optional_inputs, *arg_inputs, *(fn.outputs if fn.kind != "train" else ())):
            assert key in keys, (name, key)
        assert describe_function(fn).startswith(f"{name} ({fn.kind}")


def test_readme_lists_every_policy_loss_default() -> None:
    text = (ROOT / "nodes/README.md").read_text()
    for loss in POLICY_LOSSES:
        d = POLICY_LOSSES.get(loss)
        high = "= clip_eps" if d.clip_eps_high is None else f"{d.clip_eps_high:g}"
        low = "—" if d.clip_eps is None else f"{d.clip_eps:g}"  # a loss with no clip (SAPO): no range
        row = f"| `{loss}` | {low} | {'—' if d.clip_eps is None else high} | {d.agg} |"
        assert row in text.replace("0.0003", "0.0003").replace("0.0004", "0.0004"), row


# -- truncation ------------------------------------------------------------------------------------------
def test_truncated_rows() -> None:
    # EOS = 2, stop 7, limit 3: [5,6,2] ends in EOS (terminal), [5,6,8] is cut (truncated), [5,2,0] is short,
    # [5,6,7] ends in a stop token, an empty row is not truncated.
    ids = torch.tensor([[5, 6, 2], [5, 6, 8], [5, 2, 0], [5, 6, 7], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert truncated_rows(ids, mask, [2, 7], 3).tolist() == [0, 1, 0, 0, 0]


def _ppo_batch(truncation: bool) -> Batch:
    # row 0 ends with EOS after 2 tokens (score 1); row 1 is cut after 3 tokens (score 0), V(s_T) = 0.8
    b = Batch(
        {
            "prompt_ids": torch.tensor([[1, 3], [1, 4]]),
            "prompt_mask": torch.ones(2, 2, dtype=torch.long),
            "response_ids": torch.tensor([[5, 2, 0], [5, 6, 8]]),
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "logprobs": torch.full((2, 3), -1.0),
            "ref_logprobs": torch.full((2, 3), -1.0),  # k1 KL 0: rewards are the scores only
            "values": torch.tensor([[0.5, 0.4, 0.0], [0.2, 0.3, 0.6]]),
            "scores": torch.tensor([1.0, 0.0]),
        }
    )
    if truncation:
        b["truncated"] = torch.tensor([0, 1])
        b["bootstrap_values"] = torch.tensor([9.0, 0.8])  # row 0's is ignored: it is terminal
    return b


def _ctx(function: str, group: int = 1) -> NodeContext:
    return NodeContext(node=NodeSpec("n", "train", function), model=None, group_size=group)


# γ = 0.9, λ = 0.5, δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, R_t = A_t + V_t.
# Row 0 (EOS, terminal: V after the last token is 0): r = [0, 1], V = [0.5, 0.4]
#   δ_1 = 1 + 0 − 0.4 = 0.6 → A_1 = 0.6;  δ_0 = 0 + 0.9·0.4 − 0.5 = −0.14 → A_0 = −0.14 + 0.45·0.6 = 0.13
#   R = [0.63, 1.0]
# Row 1 (truncated: bootstrap V(s_T) = 0.8): r = [0, 0, 0], V = [0.2, 0.3, 0.6]
#   δ_2 = 0.9·0.8 − 0.6 = 0.12 → A_2 = 0.12;  δ_1 = 0.9·0.6 − 0.3 = 0.24 → A_1 = 0.24 + 0.45·0.12 = 0.294
#   δ_0 = 0.9·0.3 − 0.2 = 0.07 → A_0 = 0.07 + 0.45·0.294 = 0.2023;  R = [0.4023, 0.594, 0.72]
# Row 1 treated as terminal instead: δ_2 = −0.6 → A_2 = −0.6, A_1 = 0.24 − 0.27 = −0.03,
#   A_0 = 0.07 − 0.0135 = 0.0565
ADV = [[0.13, 0.6, 0.0], [0.2023, 0.294, 0.12]]
RET = [[0.63, 1.0, 0.0], [0.4023, 0.594, 0.72]]
ADV_TERMINAL_ROW1 = [0.0565, -0.03, -0.6]
GAE = {"gamma": 0.9, "lam": 0.5}


def test_ppo_actor_bootstraps_truncated_rows_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(F, "pg_train", lambda ctx, batch, adv, **pg: seen.append(adv) or {})
    fn = NODE_FUNCTIONS.get("ppo_actor").fn
    fn(_ctx("ppo_actor"), _ppo_batch(True), whiten_advantages=False, **GAE)
    torch.testing.assert_close(seen[-1], torch.tensor(ADV), atol=1e-6, rtol=0)
    fn(_ctx("ppo_actor"), _ppo_batch(False), whiten_advantages=False, **GAE)  # unbound: all terminal
    torch.testing.assert_close(seen[-1][0], torch.tensor(ADV[0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(seen[-1][1], torch.tensor(ADV_TERMINAL_ROW1), atol=1e-6, rtol=0)


def test_ppo_critic_targets_bootstrap_truncated_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Batch] = []
    monkeypatch.setattr(F, "optimize", lambda ctx, work, loss_fn, **kw: seen.append(work) or {})
    NODE_FUNCTIONS.get("ppo_critic").fn(_ctx("ppo_critic"), _ppo_batch(True), **GAE)
    torch.testing.assert_close(seen[-1].tensor("returns"), torch.tensor(RET), atol=1e-6, rtol=0)


# -- zero-spread groups ----------------------------------------------------------------------------------
def _outcome_batch(scores: list[float]) -> Batch:
    rows = len(scores)
    return Batch(
        {
            "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "response_ids": torch.full((rows, 2), 5),
            "response_mask": torch.ones(rows, 2, dtype=torch.long),
            "logprobs": torch.full((rows, 2), -1.0),
            "ref_logprobs": torch.full((rows, 2), -1.0),
            "greedy_scores": torch.tensor(scores),
            "scores": torch.tensor(scores),
        }
    )


def _outcome_ctx(scores: list[float]) -> NodeContext:
    return _ctx("grpo_actor", group=len(scores))


@pytest.mark.parametrize(
    ("function", "std"),
    [("grpo_actor", "group"), ("grpo_actor", "batch"), ("grpo_actor", "none"), ("rloo_actor", None)],
)
@pytest.mark.parametrize("scores", [[0.7], [1.0, 1.0, 1.0, 1.0]], ids=["one", "equal"])
def test_zero_spread_group_gives_zero_advantage_for_eps_zero(
    function: str, std: str | None, scores: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group of one or of equal rewards: r − mean = 0 for every sample, and its spread is 0; GRPO's
    # 0 / (0 + eps) is 0/0 at eps = 0, defined as 0. RLOO (no std argument): r_i − mean_{j≠i} r_j = 0
    # (equal), and a lone sample has no other to compare with: 0.
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(F, "pg_train", lambda ctx, batch, adv, **pg: seen.append(adv) or {})
    args = {"eps": 0.0, "std": std} if function == "grpo_actor" else {}
    result = NODE_FUNCTIONS.get(function).fn(_outcome_ctx(scores), _outcome_batch(scores), **args)
    assert isinstance(result, NodeResult)
    assert torch.equal(seen[-1], torch.zeros(len(scores), 2)), seen[-1]


# -- GSPO takes the node's clip range and the sequence-level aggregation -----------------------------------
LP = torch.tensor([[-0.8, -1.0], [-1.2, -1.0]])  # the current policy's log-probs of the 2 rows


def _gspo_loss(monkeypatch: pytest.MonkeyPatch, **args: Any) -> tuple[float, str]:
    """grpo_actor(loss=gspo) run through its registered function with the policy's log-probs fixed to LP
    (old log-probs −1: the sampler's, recompute_logprobs false); returns the loss and the aggregation."""
    out: list[tuple[float, str]] = []

    def fake_optimize(
        ctx: Any, work: Batch, loss_fn: Any, prefix: str, agg: str, mask_key: str = "response_mask", **_: Any
    ) -> dict[str, float]:
        loss, _, _ = loss_fn(None, work, F.rl.loss_normalizer(work.tensor(mask_key), agg))
        out.append((float(loss), agg))
        return {}

    monkeypatch.setattr(F, "optimize", fake_optimize)
    monkeypatch.setattr(F, "batch_logprobs", lambda m, b, **kw: (LP.clone(), torch.zeros_like(LP)))
    batch = _outcome_batch([1.0, 0.0])
    fn = NODE_FUNCTIONS.get("grpo_actor").fn
    fn(
        _outcome_ctx([1.0, 0.0]),
        batch,
        loss="gspo",
        eps=0.0,
        kl_loss_coef=0.0,
        recompute_logprobs=False,
        **args,
    )
    return out[-1]


def test_gspo_uses_the_nodes_clip_range_and_sequence_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    # Group of 2 with scores [1, 0]: mean 0.5, unbiased std 0.70711 → A = [+0.70711, −0.70711] (eps 0).
    # Sequence ratios s = exp(mean_t(lp − old)): row 0 e^{0.1} = 1.10517, row 1 e^{−0.1} = 0.90484.
    # Node clip 0.05: row 0 −min(s·A, 1.05·A) = −0.74246 per token; row 1 −min(−0.63981, −0.95·0.70711)
    #   = 0.67175 per token; seq-mean-token-mean over 2 sequences: (−0.74246 + 0.67175) / 2 = −0.035355.
    loss, agg = _gspo_loss(monkeypatch, clip_eps=0.05)
    assert agg == "seq-mean-token-mean"
    assert loss == pytest.approx(-0.035355, abs=1e-5)
    # Paper defaults 3e-4/4e-4 when the node gives none: row 0 −1.0004·0.70711 = −0.70739 per token;
    #   row 1 −min(−0.63981, −0.9997·0.70711) = 0.70690; mean (−0.70739 + 0.70690) / 2 = −0.000247.
    loss, _ = _gspo_loss(monkeypatch)
    assert loss == pytest.approx(-0.000247, abs=1e-5)
    # clip_eps_high given: row 0 clipped at 1 + 0.08 → −1.08·0.70711 = −0.76368; (−0.76368 + 0.67175)/2
    loss, _ = _gspo_loss(monkeypatch, clip_eps=0.05, clip_eps_high=0.08)
    assert loss == pytest.approx(-0.045962, abs=1e-5)
    # token-mean asked for explicitly: the same per-token losses over 4 tokens (equal lengths: same value)
    loss, agg = _gspo_loss(monkeypatch, clip_eps=0.05, agg="token-mean")
    assert agg == "token-mean"
