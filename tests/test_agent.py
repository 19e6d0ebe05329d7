"""Multi-turn agent rollouts (``agent_generate``): a scripted policy and environment with a known transcript
give exactly the expected ids, mask spans, log-probs and counts through the node function; model calls are
batched across rows that finish at different turns; failing, hanging and garbage tools are contained and
counted; golden GAE / returns / group advantages over the node's masked multi-turn rows (a row ending in
an observation, a truncated row); forwards attend to observation spans; validation names file, node, key;
the runtime (one process, the asynchronous loop, 2 workers) returns the rollout metrics and traces each
turn's tool phase as a ``tool`` row inside the node's own row.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError, NodeError, RegistryError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS
from rlflow.nodes import rl
from rlflow.nodes.agent.env import EnvStep, make_env_factory, run_steps
from rlflow.nodes.agent.functions import EnvironmentWarning
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.forward import response_logits
from rlflow.nodes.functions.policy import ppo_advantages
from rlflow.nodes.tasks.search import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK = build_tokenizer()
V = len(TOK)
EOS = TOK.eos_token_id
LP = 2.0 - math.log(math.exp(2.0) + V - 1)  # log-prob of the scripted token: logit 2, all others 0

TWO_HOP = "question : in which country does juju live ?"
ONE_HOP = "question : where does juju live ?"
OBS = {
    "juju": "<result> juju lives in sagaton . </result>",
    "sagaton": "<result> sagaton is a city in balia . </result>",
}
SCRIPT = {  # the policy's turns, by question
    TWO_HOP: ["<search> juju </search>", "<search> sagaton </search>", "<answer> balia </answer>"],
    ONE_HOP: ["<search> juju </search>", "<answer> sagaton </answer>"],
}


def ids(text: str) -> list[int]:
    return [int(i) for i in TOK(text, add_special_tokens=False)["input_ids"]]


class ScriptedLM(nn.Module):
    """A causal-LM stand-in: the next token is the script's (logit 2, others 0), read from the context; it
    records the rows of each prefill (one per model turn) to show how the agent batches its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.prefill_rows: list[int] = []

    @staticmethod
    def next_token(ctx: list[int]) -> int:
        question = next(q for q in SCRIPT if ids(q) == ctx[1 : 1 + len(ids(q))])
        close = ids("</result>")[0]
        turn = ctx.count(close)
        start = max(i for i, t in enumerate(ctx) if t in (close, ids("?")[0]))
        script = (
            [*ids(SCRIPT[question][turn]), EOS]
            if turn == len(SCRIPT[question]) - 1
            else ids(SCRIPT[question][turn])
        )
        k = len(ctx) - start - 1
        return script[k] if k < len(script) else EOS

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
        past = kw.get("past_key_values")
        if past is None:
            ctx = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask, strict=True)]
            self.prefill_rows.append(len(ctx))
        else:
            ctx = [[*c, int(t)] for c, t in zip(past, input_ids[:, -1], strict=True)]
        logits = torch.zeros(len(ctx), 1, V)
        for b, c in enumerate(ctx):
            logits[b, 0, self.next_token(c)] = 2.0
        return SimpleNamespace(logits=logits, past_key_values=ctx)


class ScriptedEnv:
    """Answers ``<search> q </search>`` with :data:`OBS` and a per-step reward of 0.5; ``done_on``: the
    episode ends with that query's observation."""

    def __init__(self, done_on: str | None = None) -> None:
        self.done_on = done_on
        self.prompt = ""

    def reset(self, prompt: str) -> None:
        self.prompt = prompt

    def step(self, turn_text: str) -> EnvStep:
        query = turn_text.split("<search>")[-1].split("</search>")[0].strip()
        return EnvStep(OBS[query], done=query == self.done_on, reward=0.5, tool_calls=1)


class Raising:
    @staticmethod
    def search(query: str) -> str:
        raise RuntimeError("index unavailable")


class Hanging:
    @staticmethod
    def search(query: str) -> str:
        time.sleep(60)
        return "late"


class Garbage:
    @staticmethod
    def search(query: str) -> Any:
        return 42


def _batch(*questions: str) -> Batch:
    enc = TOK(list(questions), padding=True, return_tensors="pt")
    return Batch({"prompt_ids": enc["input_ids"], "prompt_mask": enc["attention_mask"]})


def _run(args: dict[str, Any], *questions: str, model: nn.Module | None = None) -> Any:
    entry = NODE_FUNCTIONS.get("agent_generate")
    lm = model or ScriptedLM()
    full = {"greedy": True, "call_stop_tokens": ["</search>"], "max_new_tokens": 40, **args}
    ctx = NodeContext(
        node=NodeSpec("gen", "generate", "agent_generate", model="m", args=full),
        model=ModelState("m", lm, "lm", tokenizer=TOK),
        generator=torch.Generator().manual_seed(0),
    )
    return entry.fn(ctx, _batch(*questions), **full), lm


def _expected(*segments: tuple[str, int], width: int = 40) -> tuple[list[int], list[int]]:
    toks, mask = [], []
    for text, m in segments:
        t = [EOS] if text == "<eos>" else ids(text)
        toks += t
        mask += [m] * len(t)
    return toks + [TOK.pad_token_id] * (width - len(toks)), mask + [0] * (width - len(mask))


SCRIPTED_ENV = {"env": "tests.test_agent:ScriptedEnv"}


def test_scripted_transcript_exact_ids_masks_logprobs_and_counts() -> None:
    result, lm = _run(SCRIPTED_ENV, TWO_HOP, ONE_HOP)
    out = result.outputs
    two = _expected(
        ("<search> juju </search>", 1), (OBS["juju"], 0), ("<search> sagaton </search>", 1),
        (OBS["sagaton"], 0), ("<answer> balia </answer>", 1), ("<eos>", 1),
    )  # fmt: skip
    one = _expected(
        ("<search> juju </search>", 1), (OBS["juju"], 0), ("<answer> sagaton </answer>", 1), ("<eos>", 1)
    )
    assert out["response_ids"].tolist() == [two[0], one[0]]
    assert out["response_mask"].tolist() == [two[1], one[1]]
    expected_lp = torch.tensor([two[1], one[1]], dtype=torch.float32) * LP  # 0 on observations and padding
    torch.testing.assert_close(out["logprobs"], expected_lp)
    assert out["num_turns"].tolist() == [3, 2] and out["tool_calls"].tolist() == [2, 1]
    assert out["truncated"].tolist() == [0, 0]
    assert out["env_rewards"].tolist() == [1.0, 0.5]
    # one batched model call per turn: both rows, both rows, then the two-hop row alone
    assert lm.prefill_rows == [2, 2, 1]
    m = result.metrics
    assert m["num_turns/mean"] == 2.5 and m["num_turns/max"] == 3
    assert m["tool_call_counts/mean"] == 1.5 and m["tool_call_counts/max"] == 2
    assert m["env/error_ratio"] == 0.0 and m["timing_s/agent_tool/gen"] >= 0
    assert m["response_length/mean"] == (len(two[0]) - two[0].count(0) + len(one[0]) - one[0].count(0)) / 2


def test_row_ending_with_an_observation_and_truncated_row() -> None:
    # the environment ends the episode with the second observation: the last turn is an observation
    result, _ = _run({**SCRIPTED_ENV, "env_args": {"done_on": "sagaton"}}, TWO_HOP)
    ends = _expected(
        ("<search> juju </search>", 1), (OBS["juju"], 0), ("<search> sagaton </search>", 1),
        (OBS["sagaton"], 0),
    )  # fmt: skip
    assert result.outputs["response_ids"].tolist() == [ends[0]]
    assert result.outputs["response_mask"].tolist() == [ends[1]]
    assert result.outputs["truncated"].tolist() == [0]
    # a 24-token budget cuts the third turn after 2 of its tokens: truncated
    result, _ = _run({**SCRIPTED_ENV, "max_new_tokens": 24}, TWO_HOP)
    cut = _expected(
        ("<search> juju </search>", 1), (OBS["juju"], 0), ("<search> sagaton </search>", 1),
        (OBS["sagaton"], 0), ("<answer> balia", 1), width=24,
    )  # fmt: skip
    assert result.outputs["response_ids"].tolist() == [cut[0]]
    assert result.outputs["response_mask"].tolist() == [cut[1]]
    assert result.outputs["truncated"].tolist() == [1] and result.outputs["num_turns"].tolist() == [3]
    # the turn limit: the second turn's call is not run; truncated
    result, _ = _run({**SCRIPTED_ENV, "max_turns": 2}, TWO_HOP)
    assert result.outputs["tool_calls"].tolist() == [1] and result.outputs["truncated"].tolist() == [1]
    assert int(result.outputs["response_mask"].sum()) == 6


def _golden_rows() -> tuple[Batch, list[list[int]]]:
    """The node's rows: [ends with an observation, truncated in its third turn, complete one-hop]."""
    a, _ = _run({**SCRIPTED_ENV, "env_args": {"done_on": "sagaton"}}, TWO_HOP)
    b, _ = _run({**SCRIPTED_ENV, "max_new_tokens": 24}, TWO_HOP)
    c, _ = _run({**SCRIPTED_ENV, "max_new_tokens": 24}, ONE_HOP)
    mask = torch.cat([r.outputs["response_mask"][:, :24] for r in (a, b, c)])
    trunc = torch.cat([r.outputs["truncated"] for r in (a, b, c)])
    lp = torch.cat([r.outputs["logprobs"][:, :24] for r in (a, b, c)])
    batch = Batch(
        {
            "response_mask": mask,
            "logprobs": lp,
            "ref_logprobs": lp.clone(),  # KL 0: the advantages are the score's alone
            "values": torch.zeros(3, 24),
            "scores": torch.tensor([1.0, 1.0, 2.0]),
            "truncated": trunc,
            "bootstrap_values": torch.tensor([5.0, 0.8, 5.0]),  # read only for the truncated row
        }
    )
    return batch, [[i for i, m in enumerate(row) if m] for row in mask.tolist()]


def test_golden_gae_and_returns_over_multi_turn_rows() -> None:
    batch, trained = _golden_rows()
    assert trained[0] == [0, 1, 2, 10, 11, 12]  # turns 1-2; observations at 3-9 and 13-21 (the last)
    assert trained[1] == [0, 1, 2, 10, 11, 12, 22, 23]
    assert trained[2] == [0, 1, 2, 10, 11, 12, 13]  # one-hop: 3 + 7 observation + answer with EOS
    assert batch.tensor("truncated").tolist() == [0, 1, 0]
    adv, ret, _ = ppo_advantages(batch, kl_coef=0.1, kl_estimator="k1", gamma=0.5, lam=1.0)
    # V = 0, γ = 0.5, λ = 1: A_t = γ^(trainable tokens after t) · G, observation tokens skipped (not
    # discounted) and 0; G = score (terminal) or score + γ·V(s_T) (truncated: 1 + 0.5·0.8 = 1.4)
    expected = torch.zeros(3, 24)
    for row, (tokens, g) in enumerate(zip(trained, (1.0, 1.4, 2.0), strict=True)):
        for k, t in enumerate(reversed(tokens)):
            expected[row, t] = g * 0.5**k
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)  # R = A + V with V = 0


def test_golden_group_advantages_over_multi_turn_rows() -> None:
    batch, trained = _golden_rows()
    # one group of 3: scores 1, 1, 2 -> mean 4/3, unbiased std sqrt(1/3); (r - mean) / (std + 1e-6)
    adv = rl.grpo_advantages(batch.tensor("scores"), batch.tensor("response_mask"), 3, std="group")
    std = math.sqrt(1 / 3)
    for row, score in enumerate((1.0, 1.0, 2.0)):
        want = (score - 4 / 3) / (std + 1e-6)
        for t in range(24):
            assert adv[row, t].item() == pytest.approx(want if t in trained[row] else 0.0, abs=1e-5)


def test_forward_attends_to_observations_the_sampler_saw() -> None:
    """The trainer's teacher-forced log-probs of a multi-turn row equal the sampler's: the forward attends
    to mask-0 observation spans inside the response (rlflow.nodes.forward.sequence_inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    lm = LlamaForCausalLM(cfg).eval()
    # many call-stop tokens make a random model call the (scripted) tool often
    stops = ["</search>", "juju", "sagaton", "balia", "in", "a", "is", ".", "city", "lives"]
    result, _ = _run(
        {"env": "tests.test_agent:EchoEnv", "call_stop_tokens": stops, "greedy": False, "n": 4},
        TWO_HOP,
        ONE_HOP,
        model=lm,
    )
    out = result.outputs
    mask = out["response_mask"]
    holes = (mask.flip(1).cummax(1).values - mask).sum()
    assert holes > 0, "the rollouts hold observation spans between trained tokens"
    batch = _batch(TWO_HOP, ONE_HOP)
    prompts = batch.tensor("prompt_ids").repeat_interleave(4, 0)
    pmask = batch.tensor("prompt_mask").repeat_interleave(4, 0)
    with torch.no_grad():
        logits = response_logits(lm, prompts, pmask, out["response_ids"], mask).float()
    trainer = rl.label_logprobs(logits, out["response_ids"], mask)
    torch.testing.assert_close(trainer, out["logprobs"], atol=1e-4, rtol=0)


class EchoEnv:
    """Answers every step with a fixed 3-token observation."""

    def reset(self, prompt: str) -> None:
        return None

    def step(self, turn_text: str) -> EnvStep:
        return EnvStep("<result> no results </result>")


@pytest.mark.parametrize(
    ("path", "kind"),
    [("Raising.search", "raised"), ("Hanging.search", "timeout"), ("Garbage.search", "garbage")],
)
def test_failing_tools_are_contained_and_counted(path: str, kind: str) -> None:
    args = {"tools": [f"tests.test_agent:{path}"], "tool_timeout": 0.3}
    with pytest.raises(
        NodeError,
        match=f"node 'gen': the environment failed on every row of the call \\(2 rows; first error: {kind}: ",
    ):
        _run(args, TWO_HOP, ONE_HOP)  # every row's every step failed: the run stops, naming the first error
    with pytest.warns(EnvironmentWarning, match="node 'gen': 100% of the environment's steps failed"):
        result, _ = _run(
            {**args, "stop_when_all_env_rows_fail": False}, TWO_HOP, ONE_HOP
        )  # the scripted policy calls `search`; every call fails: error observation, the episode continues
    err = "<result> error </result>"
    two = _expected(
        ("<search> juju </search>", 1), (err, 0), ("<search> sagaton </search>", 1), (err, 0),
        ("<answer> balia </answer>", 1), ("<eos>", 1),
    )  # fmt: skip
    assert result.outputs["response_ids"][0].tolist() == two[0]
    assert result.outputs["response_mask"][0].tolist() == two[1]
    m = result.metrics
    assert m["env/error_ratio"] == 1.0 and m[f"env/{kind}_count"] == 3.0
    assert sum(m[f"env/{k}_count"] for k in ("raised", "timeout", "garbage", "invalid")) == 3.0
    assert result.outputs["tool_calls"].tolist() == [2, 1]


class BadInit:
    """An environment whose constructor raises."""

    def __init__(self) -> None:
        raise RuntimeError("no environment today")

    def reset(self, prompt: str) -> None:
        return None

    def step(self, turn_text: str) -> EnvStep:
        return EnvStep("<result> no results </result>")


class HangingReset(EchoEnv):
    """An environment whose reset never returns in time."""

    def reset(self, prompt: str) -> None:
        time.sleep(5)


@pytest.mark.parametrize("path", ["BadInit", "HangingReset"])
def test_an_environment_that_fails_to_start_is_contained(path: str) -> None:
    """A constructor that raises or a reset that hangs is contained like a step: the row's calls get the
    error observation (counted as raised) and, when told to, the run goes on; by default it stops, naming
    the node and the first error."""
    args = {"env": f"tests.test_agent:{path}", "tool_timeout": 0.3}
    with pytest.raises(
        NodeError, match=r"node 'gen': the environment failed on every row .* starting the environment: "
    ):
        _run(args, TWO_HOP, ONE_HOP)
    with pytest.warns(EnvironmentWarning, match="node 'gen': 100% of the environment's steps failed"):
        result, _ = _run({**args, "stop_when_all_env_rows_fail": False}, TWO_HOP, ONE_HOP)
    m = result.metrics
    assert m["env/setup_error_count"] == 2.0
    assert m["env/raised_count"] == 3.0 and m["env/error_ratio"] == 1.0
    err = "<result> error </result>"
    two = _expected(
        ("<search> juju </search>", 1), (err, 0), ("<search> sagaton </search>", 1), (err, 0),
        ("<answer> balia </answer>", 1), ("<eos>", 1),
    )  # fmt: skip
    assert result.outputs["response_ids"][0].tolist() == two[0]
    assert result.outputs["response_mask"][0].tolist() == two[1]


def test_tool_args_reach_the_tool() -> None:
    """tool_args are the tool's options: another world (seed) answers the same search differently."""
    a, _ = _run({"tools": ["search"]}, ONE_HOP)
    b, _ = _run({"tools": ["search"], "tool_args": {"search": {"seed": 1}}}, ONE_HOP)
    assert a.outputs["response_ids"][0, 3:10].tolist() != b.outputs["response_ids"][0, 3:10].tolist()
    assert a.outputs["response_mask"][0, 3].item() == 0  # an observation


def test_run_steps_contains_every_failure_and_never_waits_past_the_deadline() -> None:
    release = threading.Event()

    def hang() -> EnvStep:
        release.wait(30)
        return EnvStep("late")

    def boom() -> EnvStep:
        raise ValueError("bad")

    calls = [lambda: EnvStep("ok"), boom, hang, lambda: 42, lambda: EnvStep(7),  # type: ignore[arg-type]
             lambda: EnvStep("x", reward=math.nan), lambda: "plain"]  # fmt: skip
    out = run_steps(calls, timeout=0.2)
    release.set()
    assert [o.error for o in out] == ["", "raised", "timeout", "garbage", "garbage", "garbage", ""]
    assert out[0].step == EnvStep("ok") and out[6].step == EnvStep("plain")
    assert "ValueError: bad" in out[1].detail


def test_invalid_calls_are_the_models_and_a_disabled_tool_answers_empty() -> None:
    env = make_env_factory(None, None, ["search"], {"search": {"people": 8}})()
    with pytest.raises(Exception, match="no call of a known tool"):
        env.step("<lookup> juju </lookup>")
    quiet = make_env_factory(None, None, ["search"], None, disabled=True)()
    assert quiet.step("<search> juju </search>") == EnvStep("<result> </result>", tool_calls=1)
    with pytest.raises(RegistryError, match="did you mean 'search'"):
        make_env_factory(None, None, ["serch"], None)


class FlakyEnv:
    """Fails in turn: raises, hangs, returns garbage, answers."""

    counter = itertools.count()

    def reset(self, prompt: str) -> None:
        return None

    def step(self, turn_text: str) -> Any:
        k = next(self.counter) % 4
        if k == 0:
            raise RuntimeError("flaky")
        if k == 1:
            time.sleep(30)
        if k == 2:
            return ["garbage"]
        return EnvStep("<result> no results </result>")


def _search_graph(
    tmp_path: Path,
    overrides: list[str],
    actor: dict[str, Any] | None = None,
    plan: dict[str, Any] | None = None,
) -> Any:
    """examples/search/grpo.yaml with the SFT graph's model made from its config (or ``actor``), placed by
    ``plan`` (none: one process)."""
    import yaml

    raw = yaml.safe_load((ROOT / "examples/search/grpo.yaml").read_text())
    sft = yaml.safe_load((ROOT / "examples/search/sft.yaml").read_text())
    raw["models"]["actor"] = actor or sft["models"]["actor"]
    if plan is not None:
        raw["plan"] = plan
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_graph(str(path), [f"run.output_dir={tmp_path / 'run'}", *overrides])


def test_runtime_run_with_a_flaky_environment_finishes_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    monkeypatch.chdir(ROOT)
    stops = "['</search>','juju','in','a','is','.','city','lives','where','does','what','do','?',':']"
    graph = _search_graph(
        tmp_path,
        [
            "run.iterations=2", "run.eval_interval=0", "run.checkpoint_interval=0", "algorithm.prompts=2",
            "algorithm.n_samples=2", "algorithm.world.people=16", "data.generator.args.eval_size=8",
            "nodes.actor_gen.args.tools=null", "nodes.actor_gen.args.tool_args=null",
            "nodes.actor_gen.args.env=tests.test_agent:FlakyEnv", "nodes.actor_gen.args.tool_timeout=0.2",
            f"nodes.actor_gen.args.call_stop_tokens={stops}",
        ],
    )  # fmt: skip
    c = Controller(resolve_plan(graph, None))
    try:
        c.run()
    finally:
        c.close()
    rows = read_metrics(tmp_path / "run").to_pylist()
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    counts = {k: sum(r[f"env/{k}_count"] for r in rows) for k in ("raised", "timeout", "garbage")}
    assert all(v > 0 for v in counts.values()), counts
    assert all(0 < r["env/error_ratio"] <= 1 for r in rows)
    for r in rows:
        assert r["num_turns/max"] >= 2 and r["tool_call_counts/mean"] > 0
        assert r["rollout/logprob_gap_max"] < 1e-3  # the trainer sees the observations the sampler saw
    _assert_tool_rows(tmp_path / "run", worker=0, iterations=[1, 2])


def test_runtime_run_whose_environment_never_starts_stops_naming_node_and_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39: an environment whose constructor raises on every row trained to the end, exit 0, with
    env/error_ratio 1.0 only in the metrics; now the first iteration stops with the node and the error."""
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.controller import Controller

    monkeypatch.chdir(ROOT)
    graph = _search_graph(
        tmp_path,
        [
            "run.iterations=2", "run.eval_interval=0", "run.checkpoint_interval=0", "algorithm.prompts=2",
            "algorithm.n_samples=2", "algorithm.world.people=16", "data.generator.args.eval_size=8",
            "nodes.actor_gen.args.tools=null", "nodes.actor_gen.args.tool_args=null",
            "nodes.actor_gen.args.env=tests.test_agent:BadInit",
        ],
    )  # fmt: skip
    c = Controller(resolve_plan(graph, None))
    try:
        with pytest.raises(NodeError) as err:
            c.run()
    finally:
        c.close()
    assert "node 'actor_gen': the environment failed on every row of the call (4 rows; first error: " in str(
        err.value
    )
    assert "RuntimeError: no environment today" in str(err.value)


def _assert_tool_rows(run_dir: Path, worker: int, iterations: list[int]) -> None:
    """The trace holds ``tool`` rows of actor_gen on ``worker`` in every iteration, each inside the node's
    own row there (one row per turn that stepped the environment)."""
    from rlflow.schedulers.records.rundir import read_trace

    trace = read_trace(run_dir).to_pylist()
    tools = [r for r in trace if r["kind"] == "tool"]
    assert sorted({r["iteration"] for r in tools}) == iterations
    assert {(r["node"], r["worker"], r["tokens"], r["bytes_moved"]) for r in tools} == {
        ("actor_gen", worker, 0, 0)
    }
    for r in tools:
        (node,) = [n for n in trace if n["kind"] == "node" and n["node"] == "actor_gen"
                   and n["iteration"] == r["iteration"] and n["worker"] == worker]  # fmt: skip
        assert node["start_s"] <= r["start_s"] <= r["end_s"] <= node["end_s"]


def test_agent_generate_samples_ahead_with_staleness(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asynchronous RL (staleness 1) through the one-process loop: iteration k samples with the weights of
    version max(0, k - 2) (0 optimizer steps in both iterations here), so the lag is k - 1; the rollout
    metrics and the tool rows come through the asynchronous loop as through the synchronous one."""
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    monkeypatch.chdir(ROOT)
    stops = "['</search>','juju','in','a','is','.','city','lives','where','does','what','do','?',':']"
    with pytest.warns(UserWarning, match="cannot overlap"):
        graph = _search_graph(
            tmp_path,
            ["nodes.actor_gen.staleness=1", "run.iterations=2", "run.eval_interval=0",
             "run.checkpoint_interval=0", "algorithm.prompts=2", "algorithm.n_samples=2",
             "algorithm.world.people=16", "data.generator.args.eval_size=8",
             f"nodes.actor_gen.args.call_stop_tokens={stops}"],
        )  # fmt: skip
    c = Controller(resolve_plan(graph, None))
    try:
        c.run()
        assert c.loop is not None
    finally:
        c.close()
    rows = read_metrics(tmp_path / "run").to_pylist()
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    for r in rows:
        k = int(r["iteration"])
        assert r["rollout/weight_version"] == 0 and r["async/staleness_max"] == k - 1
        assert r["num_turns/max"] >= 2 and r["tool_call_counts/mean"] > 0 and r["env/error_ratio"] == 0
    _assert_tool_rows(tmp_path / "run", worker=0, iterations=[1, 2])


@pytest.mark.slow
def test_agent_generate_on_2_workers_records_tool_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DistExecutor runs agent_generate on worker 1 and trains on worker 0 (weights synced between):
    the rollout metrics come back from the worker and its tool phases reach the trace as worker 1's rows."""
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller
    from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor

    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    stops = "['</search>','juju','in','a','is','.','city','lives','where','does','what','do','?',':']"
    one = {"layout": "d1t1p1m1"}
    plan = {"actor_gen": {"devices": "1", **one}, "reward": {"devices": "1", **one},
            "ref": {"devices": "0", **one}, "actor_train": {"devices": "0", **one}}  # fmt: skip
    graph = _search_graph(
        tmp_path,
        ["run.devices=2", "run.iterations=2", "run.eval_interval=0", "run.checkpoint_interval=0",
         "algorithm.prompts=2", "algorithm.n_samples=2", "algorithm.world.people=16",
         "data.generator.args.eval_size=8", f"nodes.actor_gen.args.call_stop_tokens={stops}"],
        plan=plan,
    )  # fmt: skip
    c = Controller(resolve_plan(graph, None))
    try:
        assert isinstance(c.executor, DistExecutor)
        c.run()
    finally:
        c.close()
    rows = read_metrics(tmp_path / "run").to_pylist()
    assert [int(r["iteration"]) for r in rows] == [1, 2]
    for r in rows:
        assert r["num_turns/mean"] >= 1 and r["num_turns/max"] >= 2 and r["tool_call_counts/mean"] > 0
        assert r["env/error_ratio"] == 0 and r["timing_s/agent_tool/actor_gen"] > 0
        assert r["rollout/logprob_gap_max"] < 1e-3  # worker 1's rollouts, worker 0's synced weights
    _assert_tool_rows(tmp_path / "run", worker=1, iterations=[1, 2])


def _validate(tmp_path: Path, overrides: list[str]) -> list[str]:
    from rlflow.schedulers.commands.validate import runtime_mistakes

    return runtime_mistakes(_search_graph(tmp_path, overrides))


def test_validation_names_file_node_and_key(tmp_path: Path) -> None:
    out = _validate(tmp_path, ["nodes.actor_gen.args.tools=[serch]", "nodes.actor_gen.args.tool_args=null"])
    assert any("graph.yaml: nodes.actor_gen.args.tools: unknown tool 'serch' (did you mean 'search'?)" in m
               for m in out), out  # fmt: skip
    out = _validate(tmp_path, ["nodes.actor_gen.args.env=nope:Env"])
    assert any("nodes.actor_gen.args.env: name either env or tools" in m for m in out), out
    out = _validate(tmp_path, ["nodes.actor_gen.args.tools=null", "nodes.actor_gen.args.tool_args=null",
                               "nodes.actor_gen.args.env=no_such_env"])  # fmt: skip
    assert any("nodes.actor_gen.args.env: unknown environment 'no_such_env'" in m for m in out), out
    out = _validate(tmp_path, ["nodes.actor_gen.args.tool_args={lookup: {top_k: 2}}"])
    assert any("nodes.actor_gen.args.tool_args: tool_args names ['lookup']" in m for m in out), out
    with pytest.raises(GraphError, match=r"graph.yaml: nodes.actor_gen.interrupt_every: function "
                       r"'agent_generate' does not sample in segments"):  # fmt: skip
        _search_graph(tmp_path, ["nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=8"])
    for over, key, message in (
        (["nodes.actor_gen.args.tools=[null]", "nodes.actor_gen.args.tool_args=null"], "tools",
         "expected a list of tool names"),
        (["nodes.actor_gen.args.tools=[1]", "nodes.actor_gen.args.tool_args=null"], "tools",
         "expected a list of tool names"),
        (["nodes.actor_gen.args.tools=[search,search]", "nodes.actor_gen.args.tool_args=null"], "tools",
         "names a tool twice"),
        (["nodes.actor_gen.args.tool_args.search=5"], "tool_args.search", "expected a mapping of options"),
        (["nodes.actor_gen.args.env_args={a: 1}"], "env_args", "applies to 'env'"),
    ):  # fmt: skip
        out = _validate(tmp_path, over)  # a clear message naming the key, never a traceback
        assert any(f"graph.yaml: nodes.actor_gen.args.{key}: {message}" in m for m in out), out
    out = _validate(tmp_path, ["nodes.actor_gen.args.call_stop_tokens=null"])
    assert any("nodes.actor_gen.args.call_stop_tokens: name the token" in m for m in out), out
    for bad, key in (("max_turns=0", "max_turns"), ("tool_timeout=0", "tool_timeout"),
                     ("call_stop_tokens=[9999]", "call_stop_tokens")):  # fmt: skip
        with pytest.raises(GraphError, match=rf"graph.yaml: nodes.actor_gen.args.{key}"):
            _search_graph(tmp_path, [f"nodes.actor_gen.args.{bad}"])


def test_an_agent_node_on_pipeline_stages_is_refused_by_graph_and_planner(tmp_path: Path) -> None:
    """An agent_generate node at pp = 2 (each stage would step its own environments, whose timeouts can
    differ): the graph's plan checks name the file and key before anything starts, and the planner never
    proposes a pipelined layout for it."""
    import dataclasses

    from rlflow.dataflow.errors import PlanError
    from rlflow.schedulers.planner.cluster_files import load_cluster
    from rlflow.schedulers.planner.graph_problem import problem_from_graph
    from rlflow.schedulers.planner.search import Searcher

    one = {"devices": "0", "layout": "d1t1p1m1"}
    plan = {
        "actor_gen": {"devices": "0-1", "layout": "d1t1p2m1"},
        "reward": one,
        "ref": one,
        "actor_train": one,
    }
    with pytest.raises(
        PlanError, match=r"graph.yaml: plan.actor_gen.layout: an agent_generate node cannot run"
    ):
        _search_graph(tmp_path, ["run.devices=2"], plan=plan)
    problem = problem_from_graph(_search_graph(tmp_path, ["run.devices=4"], plan={}), prompt_len=8)
    gen = problem.node("actor_gen")
    assert gen.function == "agent_generate"
    searcher = Searcher(problem, dataclasses.replace(load_cluster("cpu-local"), devices_per_host=4))
    for size in (2, 4):
        layouts = searcher.layouts(gen, size)
        assert layouts and all(layout.pp == 1 for layout in layouts), layouts
