"""On-policy distillation (issue 37): the reverse-KL advantage's golden values and gradients derived by hand,
``distill_actor`` through the runtime (the student moves towards the teacher, the teacher does not move),
its pre-launch check (``rlflow validate`` refuses, naming file, node and key), and the example chain
``examples/distill/teacher.yaml`` → ``examples/arith/sft.yaml`` → ``examples/distill/distill.yaml``
CI-sized."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import rlflow.nodes.rl as rl
from rlflow.dataflow.loader import loads_graph
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
DISTILL = "examples/distill/distill.yaml"
CHAIN = ["examples/distill/teacher.yaml", "examples/arith/sft.yaml", DISTILL]  # docs/recipes.md's command
NAN, INF = float("nan"), float("inf")


def test_reverse_kl_advantages_golden() -> None:
    # d_t = log π(y_t) − log π_T(y_t): −0.5 − (−0.2) = −0.3 and −1.0 − (−2.0) = 1.0; A_t = −coef·d_t with
    # coef 0.5: 0.15 and −0.5; the mask-0 position holds NaN/inf and stays 0 (Thinking Machines 2025)
    lp = torch.tensor([[-0.5, -1.0, NAN]])
    teacher = torch.tensor([[-0.2, -2.0, -INF]])
    mask = torch.tensor([[1, 1, 0]])
    adv, kl = rl.reverse_kl_advantages(lp, teacher, mask, coef=0.5)
    torch.testing.assert_close(kl, torch.tensor([[-0.3, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.15, -0.5, 0.0]]))
    # a task advantage 0.4 weighted 2 adds 0.8 per token (slime's A_t − λ·d_t): 0.95 and 0.3
    task = torch.full((1, 3), 0.4)
    adv, _ = rl.reverse_kl_advantages(lp, teacher, mask, coef=0.5, task_advantages=task, task_coef=2.0)
    torch.testing.assert_close(adv, torch.tensor([[0.95, 0.3, 0.0]]))


def test_reverse_kl_advantages_refuse_bad_input() -> None:
    lp, mask = torch.tensor([[-0.5, -1.0]]), torch.tensor([[1, 1]])
    with pytest.raises(rl.RLInputError, match="teacher_logprobs: a trainable token has a non-finite"):
        rl.reverse_kl_advantages(lp, torch.tensor([[-0.2, -INF]]), mask, coef=1.0)  # outside a top-k
    with pytest.raises(rl.RLInputError, match="coef: the distillation coefficient must be > 0"):
        rl.reverse_kl_advantages(lp, lp, mask, coef=0.0)
    with pytest.raises(rl.RLInputError, match="teacher_logprobs: shape"):
        rl.reverse_kl_advantages(lp, lp[:, :1], mask, coef=1.0)


def test_policy_gradient_of_the_advantage_golden() -> None:
    # PPO's loss at ratio 1 (π_θ = π_old, the first step on fresh samples), token-mean over 2 tokens:
    # ℓ = −(A_1·ρ_1 + A_2·ρ_2)/2, ∂ℓ/∂log π_t = −A_t·ρ_t/2 = −A_t/2 with A = (0.15, −0.5): (−0.075, 0.25).
    # The gradient lowers log π where the student is above the teacher (d_2 = 1) and raises it below.
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    adv, _ = rl.reverse_kl_advantages(lp, torch.tensor([[-0.2, -2.0]]), torch.ones(1, 2), coef=0.5)
    loss, metrics = rl.policy_loss(lp, lp.detach(), adv, torch.ones(1, 2))
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.075, 0.25]]))
    torch.testing.assert_close(loss, torch.tensor(-(0.15 - 0.5) / 2))
    assert float(metrics["pg_clipfrac"]) == 0.0


def test_expected_gradient_is_the_reverse_kl_gradient() -> None:
    # One token from a categorical π = softmax(z) = (1/2, 1/4, 1/4); teacher π_T = (1/4, 1/2, 1/4).
    # d = log π − log π_T = (ln 2, −ln 2, 0); KL(π‖π_T) = Σ π·d = ln2/2 − ln2/4 = ln2/4.
    # ∂KL/∂z_j = π_j·(d_j − KL) (∂ log π_i/∂z_j = δ_ij − π_j, and Σ_i π_i(δ_ij − π_j) = 0 drops the +1):
    # (1/2·(3/4), 1/4·(−5/4), 1/4·(−1/4))·ln 2 = (3/8, −5/16, −1/16)·ln 2.
    # The policy-gradient loss of the sampled token y, ℓ(y) = −A(y)·π(y)/sg[π(y)] with A = −d(y), has
    # E_{y~π}[∇ℓ(y)] = Σ_y π(y)·d(y)·∇log π(y): the same vector.
    z = torch.log(torch.tensor([0.5, 0.25, 0.25])).requires_grad_(True)
    teacher = torch.log(torch.tensor([0.25, 0.5, 0.25]))
    expected = torch.tensor([3 / 8, -5 / 16, -1 / 16]) * math.log(2)
    total = torch.zeros(3)
    for y in range(3):
        lp = torch.log_softmax(z, -1)[y].reshape(1, 1)
        adv, _ = rl.reverse_kl_advantages(lp, teacher[y].reshape(1, 1), torch.ones(1, 1), coef=1.0)
        loss, _ = rl.policy_loss(lp, lp.detach(), adv, torch.ones(1, 1))
        (grad,) = torch.autograd.grad(loss, z)
        total += torch.softmax(z, -1)[y].detach() * grad
    torch.testing.assert_close(total, expected)
    exact = torch.autograd.grad(torch.sum(torch.softmax(z, -1) * (torch.log_softmax(z, -1) - teacher)), z)[0]
    torch.testing.assert_close(exact, expected)


_TINY = {"model_type": "llama", "vocab_size": 19, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
_SEQ = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]


def _tiny_graph(out: Path) -> str:
    """A student (hidden 32) distilling a frozen teacher (hidden 48, another random init) on arithmetic
    prompts of one length (zero-padded: no padding in the batch), one response token each."""
    raw = {
        "models": {
            "student": {"config": {**_TINY, "hidden_size": 32}, "tokenizer": "examples/arith/tokenizer",
                        "optimizer": {"lr": 0.002}},
            "teacher": {"config": {**_TINY, "hidden_size": 48, "initializer_range": 0.5},
                        "tokenizer": "examples/arith/tokenizer", "trainable": False},
        },
        "data": {"generator": {"name": "arith",
                               "args": {"train_size": 256, "eval_size": 64, "zero_pad": True}},
                 "fields": {"prompt": "prompt"}, "tokenize": ["prompt"], "tokenizer": "student"},
        "nodes": {
            "gen": {"model": "student", "kind": "generate", "function": "generate",
                    "inputs": ["prompt_ids", "prompt_mask"],
                    "outputs": ["response_ids", "response_mask", "logprobs"],
                    "batch_size": 32, "args": {"n": 4, "max_new_tokens": 1}},
            "teacher": {"model": "teacher", "kind": "inference", "function": "logprobs", "inputs": _SEQ,
                        "outputs": {"logprobs": "teacher_logprobs"}, "batch_size": 32},
            "train": {"model": "student", "kind": "train", "function": "distill_actor",
                      "inputs": [*_SEQ, "logprobs", "teacher_logprobs"], "batch_size": 32},
        },
        "run": {"iterations": 2, "seed": 0, "output_dir": str(out)},
    }  # fmt: skip
    return yaml.safe_dump(raw)


def _first_token_kl(student: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor) -> float:
    """Exact KL(π‖π_T) of the first response token, averaged over the prompts ``ids`` ``[P, S]``."""
    with torch.no_grad():
        log_p = torch.log_softmax(student(input_ids=ids).logits[:, -1].float(), -1)
        log_q = torch.log_softmax(teacher(input_ids=ids).logits[:, -1].float(), -1)
    return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())


def test_distill_actor_moves_the_student_towards_a_frozen_teacher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    c = Controller(resolve_plan(loads_graph(_tiny_graph(tmp_path / "run"), "tiny-distill.yaml"), None))
    try:
        models = {m: c.executor.models[m].module for m in ("student", "teacher")}
        tok = load_tokenizer("examples/arith/tokenizer")
        ids = torch.tensor(tok(["07+68=", "52-38=", "11+11=", "90-09=", "45+45=", "99-98="])["input_ids"])
        before = {m: {k: v.clone() for k, v in mod.state_dict().items()} for m, mod in models.items()}
        kl_before = _first_token_kl(models["student"], models["teacher"], ids)
        result = c.run()
        kl_after = _first_token_kl(models["student"], models["teacher"], ids)
        teacher_after = models["teacher"].state_dict()
        student_after = models["student"].state_dict()
    finally:
        c.close()
    assert all(torch.equal(v, teacher_after[k]) for k, v in before["teacher"].items())  # frozen
    assert any(not torch.equal(v, student_after[k]) for k, v in before["student"].items())
    assert kl_after < kl_before  # the reverse KL's gradient, followed for 2 steps, lowers it
    m = result.metrics
    assert math.isfinite(m["actor/reverse_kl"]) and math.isfinite(m["actor/pg_loss"])
    assert {"critic/advantages/mean", "actor/grad_norm", "perf/first_pass_share"} <= set(m)


def _validate(tmp: Path, capsys: pytest.CaptureFixture[str], *overrides: str, raw: dict | None = None) -> str:
    """``rlflow validate`` (from the repository root) of the example's stage 2, or of ``raw``, with its
    models from configs, so that it needs no stage 1, and ``overrides``; returns stderr (exit 2 asserted)."""
    raw = yaml.safe_load((ROOT / DISTILL).read_text()) if raw is None else raw
    for name, hidden in (("student", 32), ("teacher", 48)):
        raw["models"][name].pop("path", None)
        raw["models"][name].update(
            config={**_TINY, "hidden_size": hidden}, tokenizer="examples/arith/tokenizer"
        )
    path = tmp / "distill-check.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(path), *overrides]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["models.teacher.config.vocab_size=23"],
         r"nodes\.student_train\.inputs\.teacher_logprobs: the teacher model 'teacher' \(node 'teacher'\) "
         r"has vocab_size 23 but the student model 'student' has 19: .* not supported"),
        (["models.teacher.tokenizer=examples/search/tokenizer", "models.teacher.config.vocab_size=19"],
         r"nodes\.student_train\.inputs\.teacher_logprobs: .* has tokenizer 'examples/search/tokenizer', "
         r"whose vocabulary differs from the student's 'examples/arith/tokenizer'"),
        (["nodes.teacher.model=student"],
         r"nodes\.student_train\.inputs\.teacher_logprobs: node 'teacher' runs the student model 'student' "
         r"itself"),
        (["nodes.teacher.args.top_k=5"], r"nodes\.teacher\.args\.top_k: the teacher's log-probs must cover"),
        (["nodes.student_train.args.reward_coef=0.5"],
         r"nodes\.student_train\.inputs\.scores: args\.reward_coef is 0\.5, .* does not bind input 'scores'"),
        (["nodes.student_train.args.std=none"],
         r"nodes\.student_train\.args\.std: is read only when reward_coef"),
        (["nodes.student_train.args.distill_coef=0"],
         r"nodes\.student_train\.args\.distill_coef: .*must be > 0"),
    ],
    ids=["vocab_size", "tokenizer", "student_as_teacher", "top_k", "reward_unbound", "std_unread",
         "distill_coef"],
)  # fmt: skip
def test_validate_refuses_a_bad_teacher_or_argument(
    overrides: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(ROOT)
    err = _validate(tmp_path, capsys, *overrides)
    assert re.search(r"distill-check\.yaml: " + message, err), err
    assert "never consumed" not in err  # 'answer' is read by the held-out evaluation's reward only


def test_validate_refuses_a_teacher_that_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / DISTILL).read_text())
    raw["models"]["teacher"]["trainable"] = True
    raw["data"].update(fields={"prompt": "prompt", "answer": "answer"}, tokenize=["prompt", "answer"])
    raw["nodes"]["teacher_sft"] = {
        "model": "teacher", "kind": "train", "function": "sft", "batch_size": 256,
        "inputs": ["prompt_ids", "prompt_mask", "answer_ids", "answer_mask"],
    }  # fmt: skip
    err = _validate(tmp_path, capsys, raw=raw)
    assert re.search(
        r"distill-check\.yaml: nodes\.student_train\.inputs\.teacher_logprobs: the teacher model 'teacher' "
        r"\(node 'teacher'\) is trained by node 'teacher_sft'; a distillation teacher is frozen",
        err,
    ), err


def test_example_chain_ci_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlflow run examples/distill/teacher.yaml examples/arith/sft.yaml examples/distill/distill.yaml` for
    2 iterations a stage: the distillation stage starts from the teacher's and the student's checkpoints of
    the stages before (its learning: the figure in docs/recipes.md, not asserted here)."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    small = ["run.iterations=2", "run.eval_interval=2", "run.checkpoint_interval=2", "run.eval.size=16",
             "data.generator.args.train_size=512", "--no-progress"]  # fmt: skip
    assert main(["validate", DISTILL]) == 2  # it reads the checkpoints of the stages before, not there yet
    assert "runs/distill-teacher/checkpoints/latest/models/teacher" in capsys.readouterr().err
    assert main(["run", *CHAIN, *small]) == 0
    out = capsys.readouterr().out
    table = out[out.index("stage ") :].splitlines()
    for line, (graph, samples) in zip(table[1:4], zip(CHAIN, (256, 256, 512), strict=True), strict=True):
        assert re.match(rf"{graph} +2 +{samples} +[\d.]+ -> [\d.]+ \(it 0 -> 2\)", line), table
    assert main(["validate", DISTILL]) == 0  # the checkpoints there: the teacher's vocabulary is checked
