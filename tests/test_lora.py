"""LoRA (issue 35) through rlflow's node functions and single-process runtime, on tiny models.

- One optimizer step of a LoRA model through a train node (``LocalExecutor.run_node``) equals the same step
  taken by hand on ``peft.get_peft_model`` of an identically built base (loss, adapter gradients, updated
  adapters), with the loss written out here: SFT's masked NLL and GRPO's clipped surrogate + k3 KL term.
- A reference declared ``base_of: actor`` gives exactly the log-probs of a separately built base, shares the
  actor's parameter storage, and leaves the adapters trainable; evaluating it runs the base too.
- Every registered train function trains only the adapters (and a value/score head unless
  ``lora.train_head: false``); base weights stay bit-identical.
- A run checkpoints the adapters and their optimizer state only, and resumes exactly; a resumed LoRA copy of a
  trained model starts from that model's initial weights; the adapters' init is seeded, not global.
- ``rlflow validate`` refuses every bad ``lora``/``base_of`` before anything runs, naming file, model and key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import ModelError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.loader import loads_graph
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.lora import ADAPTER_FILE, adapter_state_dict, set_adapter_state
from rlflow.nodes.models import build_model, save_pretrained
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import list_checkpoints, read_metrics
from rlflow.schedulers.runtime.controller import Controller
from rlflow.schedulers.runtime.executor import LocalExecutor
from rlflow.schedulers.runtime.instances import build_models, save_model
from tests.harness import TINY_LLAMA, stopped_copy

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
ROWS = 8  # rows of a hand-made batch: whole groups of 2 and of 4 samples
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
# A tiny GRPO graph with a LoRA actor and its base as the reference: 2 prompts × 2 samples per iteration.
GRPO = f"""
models:
  actor:
    config: {json.dumps(TINY_LLAMA)}
    tokenizer: examples/arith/tokenizer
    optimizer: {{lr: 1.0e-2, warmup_steps: 0, weight_decay: 0.1, grad_clip: 0.1}}
    lora: {json.dumps(LORA)}
  ref:
    base_of: actor
data:
  generator: {{name: arith, args: {{digits: 1, train_size: 16, eval_size: 4, seed: 0}}}}
  fields: {{prompt: prompt, answer: answer}}
  tokenize: [prompt]
  tokenizer: actor
nodes:
  actor_gen:
    model: actor
    kind: generate
    function: generate
    inputs: [prompt_ids, prompt_mask]
    outputs: [response_ids, response_mask, logprobs]
    batch_size: 2
    args: {{n: 2, max_new_tokens: 4}}
  reward:
    kind: inference
    function: rule_reward
    inputs: [response_ids, response_mask, answer]
    outputs: [scores]
    batch_size: 4
    batch_unit: samples
    args: {{fn: arith_exact}}
  ref:
    model: ref
    kind: inference
    function: logprobs
    inputs: [prompt_ids, prompt_mask, response_ids, response_mask]
    outputs: {{logprobs: ref_logprobs}}
    batch_size: 2
  actor_train:
    model: actor
    kind: train
    function: grpo_actor
    inputs: [prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ref_logprobs, scores]
    batch_size: 2
    args: {{kl_loss_coef: 0.04}}
run: {{iterations: 4, seed: 1, checkpoint_interval: 2, eval_interval: 0, devices: 1}}
"""

# the same graph without LoRA: a plain actor and a frozen copy of it as the reference
PLAIN = (
    "models.actor.lora=null",
    "models.ref.base_of=null",
    "models.ref.init_from=actor",
    "models.ref.trainable=false",
)

load_builtin_functions()


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(ROOT)  # graphs name the tokenizer relative to the repository root
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these tiny matrices are slower on more threads, much slower on a busy machine
    yield
    torch.set_num_threads(threads)


def graph(text: str, *overrides: str, source: str = "lora.yaml") -> Graph:
    return loads_graph(text, source=source, overrides=overrides)


# the distillation example's student and teacher from configs (its stages 1-2 write their checkpoints)
DISTILL = "examples/distill/distill.yaml"
DISTILL_MODELS = [
    f"models.{m}.{key}={value}"
    for m, hidden in (("student", 32), ("teacher", 48))
    for key, value in (
        ("path", "null"),
        ("config", json.dumps({**TINY_LLAMA, "hidden_size": hidden})),
        ("tokenizer", "examples/arith/tokenizer"),
    )
]


def example(path: str, *overrides: str) -> Graph:
    extra = DISTILL_MODELS if path == DISTILL else []
    return graph((ROOT / path).read_text(), *extra, *overrides, source=path)


def lora_overrides(model: str, **extra: object) -> list[str]:
    return [f"models.{model}.lora.{k}={json.dumps(v)}" for k, v in {**LORA, **extra}.items()]


def seq_batch(rows: int = ROWS, seed: int = 0) -> Batch:
    """``rows`` sequences: 3 prompt tokens (no padding), up to 4 response tokens right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 19, (rows, 3), generator=g)
    lengths = torch.tensor([4, 3, 4, 2, 1, 4, 3, 4][:rows])
    mask = (torch.arange(4)[None] < lengths[:, None]).long()
    response = torch.randint(3, 19, (rows, 4), generator=g) * mask
    return Batch(
        {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "response_ids": response,
         "response_mask": mask}
    )  # fmt: skip


def hand_logprobs(model: torch.nn.Module, b: Batch) -> torch.Tensor:
    """log π(y_t | x, y_<t) ``[B, R]`` of the response tokens, 0 on padding, from the model's logits: the
    logit at position ``t`` predicts token ``t + 1`` (prompts unpadded, so positions are 0..L-1)."""
    ids = torch.cat([b.tensor("prompt_ids"), b.tensor("response_ids")], 1)
    attention = torch.cat([b.tensor("prompt_mask"), b.tensor("response_mask")], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()
    width = b.tensor("prompt_ids").shape[1]
    lp = torch.log_softmax(logits[:, width - 1 : -1], -1)
    return lp.gather(-1, b.tensor("response_ids")[..., None]).squeeze(-1) * b.tensor("response_mask")


def random_adapters(module: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Set the adapters (and a training head) to random values: with ``B != 0`` the ``A`` matrices get a
    gradient too, and a base view differs from the LoRA model."""
    g = torch.Generator().manual_seed(seed)
    state = {k: 0.2 * torch.randn(v.shape, generator=g) for k, v in adapter_state_dict(module).items()}
    set_adapter_state(module, state)
    return state


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def by_hand(g: Graph, adapters: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The actor built again from its spec (the seed ``build_models`` gives the first model), adapters applied
    with ``peft.get_peft_model`` and set to ``adapters``; torch's AdamW with the graph's settings."""
    spec = g.spec.models["actor"]
    base = build_model(config=spec.config, seed=g.spec.run.seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    peft.set_peft_model_state_dict(model, adapters)
    model.eval()
    o = spec.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def hand_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float) -> float:
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    return float(norm)


def assert_same_step(ex: LocalExecutor, model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    """The runtime's actor after its step equals the hand-stepped peft model: adapters and their (clipped)
    gradients close, base weights bit-identical to before; the optimizer holds the adapters only."""
    ours = dict(ex.models["actor"].module.named_parameters())
    theirs = dict(model.base_model.model.named_parameters())  # type: ignore[union-attr]
    assert ours.keys() == theirs.keys()
    adapters = [n for n in ours if is_adapter(n)]
    assert len(adapters) == 8  # q_proj, v_proj × 2 layers × (A, B)
    for n, p in ours.items():
        if is_adapter(n):
            assert p.requires_grad and p.grad is not None and theirs[n].grad is not None, n
            torch.testing.assert_close(p.grad, theirs[n].grad, rtol=1e-4, atol=1e-7, msg=n)
            torch.testing.assert_close(p.detach(), theirs[n].detach(), rtol=1e-5, atol=1e-7, msg=n)
            assert not torch.equal(p.detach(), before[n]), f"{n} did not move"
        else:
            assert not p.requires_grad and p.grad is None, n
            assert torch.equal(p.detach(), before[n]) and torch.equal(p.detach(), theirs[n].detach()), n
    optimizer = ex.models["actor"].optimizer
    assert optimizer is not None
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(ours[n]) for n in adapters}


def test_sft_step_equals_peft_by_hand() -> None:
    g = example(
        "examples/sft.yaml", *lora_overrides("actor"), "nodes.actor_train.mini_batches=1",
        "models.actor.optimizer={lr: 0.01, warmup_steps: 0, weight_decay: 0.1, grad_clip: 0.1}",
    )  # fmt: skip
    ex = LocalExecutor(g, CPU)
    actor = ex.models["actor"].module
    adapters = random_adapters(actor)
    before = snapshot(actor)
    model, opt = by_hand(g, adapters)
    b = seq_batch()
    # SFT (token-mean): the mean of -log π over the response tokens of the whole mini-batch
    mask = b.tensor("response_mask")
    loss = -hand_logprobs(model, b).sum() / mask.sum()
    norm = hand_step(model, opt, loss, clip=0.1)
    metrics = ex.run_node("actor_train", b, 0).metrics
    assert metrics["actor/nll"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert norm > 0.1  # the clip acted, in both
    assert_same_step(ex, model, before)


def test_grpo_step_equals_peft_by_hand_and_the_reference_is_the_base() -> None:
    g = graph(GRPO)
    ex = LocalExecutor(g, CPU)
    actor = ex.models["actor"].module
    adapters = random_adapters(actor)
    before = snapshot(actor)
    model, opt = by_hand(g, adapters)
    b = seq_batch()
    mask = b.tensor("response_mask").float()
    with torch.no_grad():
        old = hand_logprobs(model, b)
    ref = old - 0.3 * torch.rand(old.shape, generator=torch.Generator().manual_seed(1)) * mask
    scores = torch.tensor([1.0, 0.0, 0.25, 0.75, 1.0, 1.0, 0.0, 0.5])
    b = Batch({**dict(b.items()), "logprobs": old, "ref_logprobs": ref, "scores": scores})
    # GRPO advantages (groups of n = 2): (r - group mean) / (unbiased group std + 1e-6), on every token
    pairs = scores.view(-1, 2)
    adv = ((pairs - pairs.mean(1, keepdim=True)) / (pairs.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    lp = hand_logprobs(model, b)
    ratio = torch.exp(lp - lp.detach())  # one mini-batch: π_old is this forward's, the ratio is 1
    n_tok = mask.sum()
    pg = (-adv * ratio * mask).sum() / n_tok  # clipping is inactive at ratio 1
    x = lp - ref  # k3 = exp(-x) - 1 + x (Schulman 2020), weight kl_loss_coef = 0.04
    kl = ((torch.exp(-x) - 1 + x) * mask).sum() / n_tok
    norm = hand_step(model, opt, pg + 0.04 * kl, clip=0.1)
    metrics = ex.run_node("actor_train", b, 0).metrics
    assert metrics["actor/pg_loss"] == pytest.approx(pg.item(), rel=1e-5, abs=1e-7)
    assert metrics["actor/kl_loss"] == pytest.approx(kl.item(), rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert_same_step(ex, model, before)

    # The reference (base_of: actor) is the actor's module with the adapters off: no copy of any weight.
    view = ex.models["ref"].module
    assert view is actor
    assert {p.data_ptr() for p in view.parameters()} == {p.data_ptr() for p in actor.parameters()}
    ref_lp = ex.run_node("ref", seq_batch(), 0).outputs["logprobs"]
    assert all(p.requires_grad == is_adapter(n) for n, p in actor.named_parameters())  # adapters still train
    with torch.no_grad():
        assert not torch.allclose(hand_logprobs(actor, seq_batch()), ref_lp, atol=1e-3)  # adapters matter
    # ... and its log-probs are exactly a separately built base's, through the same node function.
    plain = graph(GRPO, *PLAIN)
    base_lp = LocalExecutor(plain, CPU).run_node("ref", seq_batch(), 0).outputs["logprobs"]
    assert torch.equal(ref_lp, base_lp)


def test_evaluating_a_base_view_runs_the_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run.eval.model: ref`` (a base view) evaluates with the adapters off: the model the evaluation's
    decode loop receives computes what a separately built base computes."""
    import rlflow.schedulers.runtime.evaluation as evaluation

    seen: list[torch.Tensor] = []

    def recording(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        with torch.no_grad():
            seen.append(hand_logprobs(module, seq_batch()))
        return generate(module, *args, **kwargs)

    generate = evaluation.generate
    monkeypatch.setattr(evaluation, "generate", recording)
    for out, overrides in (("lora", ()), ("plain", PLAIN)):
        c = controller(tmp_path / out, *overrides, "run.eval.model=ref", "run.eval.size=2")
        if out == "lora":
            random_adapters(c.executor.models["actor"].module)
        c.evaluate()
        c.close()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])


# ---- every train function ------------------------------------------------------------------------------
def node_inputs(inputs: tuple[str, ...], rows: int = ROWS) -> Batch:
    """A batch holding ``inputs`` (canonical names): sequences, log-probs, values, scores and preference
    pairs of ``rows`` rows."""
    g = torch.Generator().manual_seed(2)
    seq = seq_batch(rows)
    mask = seq.tensor("response_mask")
    lp = -torch.rand(mask.shape, generator=g) * mask - 1.0 * mask
    other = seq_batch(rows, seed=3)
    values = {
        **dict(seq.items()),
        "logprobs": lp,
        "ref_logprobs": lp - 0.1 * mask,
        "teacher_logprobs": lp + 0.2 * mask,
        "values": torch.randn(mask.shape, generator=g) * mask,
        "scores": torch.rand(rows, generator=g),
        "greedy_scores": torch.rand(rows, generator=g),
        "truncated": torch.zeros(rows, dtype=torch.long),
        "bootstrap_values": torch.zeros(rows),
        "chosen_ids": seq.tensor("response_ids"),
        "chosen_mask": mask,
        "rejected_ids": other.tensor("response_ids"),
        "rejected_mask": other.tensor("response_mask"),
        "ref_chosen_logps": -torch.rand(rows, generator=g) - 2.0,
        "ref_rejected_logps": -torch.rand(rows, generator=g) - 2.0,
    }
    return Batch({k: values[k] for k in inputs})


# (graph file, train node, its model, extra lora settings, whether a head trains)
TRAIN_CASES = [
    ("examples/ppo.yaml", "actor_train", "actor", {}, False),
    ("examples/ppo.yaml", "critic_train", "critic", {}, True),
    ("examples/ppo.yaml", "critic_train", "critic", {"train_head": False}, False),
    ("examples/grpo.yaml", "actor_train", "actor", {}, False),
    ("examples/rloo.yaml", "actor_train", "actor", {}, False),
    ("examples/reinforce_pp.yaml", "actor_train", "actor", {}, False),
    ("examples/remax.yaml", "actor_train", "actor", {}, False),
    ("examples/sft.yaml", "actor_train", "actor", {}, False),
    ("examples/dpo.yaml", "actor_train", "actor", {"target_modules": "all-linear"}, False),
    ("examples/reward_model.yaml", "reward_train", "reward", {}, True),
    (DISTILL, "student_train", "student", {}, False),
]


def test_the_cases_cover_every_registered_train_function() -> None:
    functions = {f for f in NODE_FUNCTIONS if NODE_FUNCTIONS.get(f).kind == "train"}
    covered = {example(f).spec.nodes[node].function for f, node, *_ in TRAIN_CASES}
    assert covered == functions


@pytest.mark.parametrize(("path", "node", "model", "extra", "head"), TRAIN_CASES)
def test_every_train_function_trains_only_the_adapters(
    path: str, node: str, model: str, extra: dict[str, object], head: bool
) -> None:
    overrides = [*lora_overrides(model, **extra), f"nodes.{node}.mini_batches=1", f"nodes.{node}.epochs=1"]
    g = example(path, *overrides)
    ex = LocalExecutor(g, CPU)
    module = ex.models[model].module
    random_adapters(module)
    before = snapshot(module)
    fn = g.function(node)
    ex.run_node(node, node_inputs(fn.inputs), 0)
    assert ex.models[model].version == 1
    moved = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    heads = {n for n, _ in module.named_parameters() if n.startswith("value_head.")}
    for n, p in module.named_parameters():
        assert p.requires_grad == (is_adapter(n) or (head and n in heads)), n
    assert {n for n in moved if n not in heads} == {n for n in before if is_adapter(n)}
    # the head moves when it trains (a reward model's bias cancels out of its pairwise loss: not all of it)
    assert bool(moved & heads) == head


# ---- checkpoints and resume ----------------------------------------------------------------------------
def controller(out: Path, *overrides: str, resume: bool = False) -> Controller:
    g = resolve_plan(graph(GRPO, f"run.output_dir={out}", *overrides), None)
    return Controller(g, resume=resume)


def test_checkpoints_hold_the_adapters_and_resume_exactly(tmp_path: Path) -> None:
    straight = controller(tmp_path / "a")
    straight.run()  # 4 iterations, checkpoints after 2 and 4
    resumed = controller(stopped_copy(tmp_path / "a", 2, tmp_path / "b"), resume=True)
    assert resumed.start_iteration == 2
    resumed.run()
    ours = adapter_state_dict(resumed.executor.models["actor"].module)
    theirs = adapter_state_dict(straight.executor.models["actor"].module)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    a, b = read_metrics(tmp_path / "a").to_pylist(), read_metrics(tmp_path / "b").to_pylist()
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b, strict=True):
        keys = [k for k in ra if k.startswith(("actor/", "critic/", "response_length/"))]
        assert keys and {k: ra[k] for k in keys} == {k: rb[k] for k in keys}

    # The checkpoint: the actor's adapters as a PEFT adapter directory, no base weights, nothing for the
    # reference; optimizer state for the 8 adapter tensors only.
    _, last = list_checkpoints(tmp_path / "a")[-1]
    assert sorted(p.name for p in (last / "models").iterdir()) == ["actor"]
    saved = last / "models" / "actor"
    assert sorted(p.name for p in saved.glob("*.safetensors")) == [ADAPTER_FILE]
    assert not (saved / "config.json").exists()
    assert load_file(str(saved / ADAPTER_FILE)).keys() == theirs.keys()
    state = torch.load(last / "state.pt", weights_only=False)
    adam = state["executor"]["models"]["actor"]["optimizer"]["state"]
    shapes = sorted(tuple(s["exp_avg"].shape) for s in adam.values())
    assert shapes == sorted(tuple(t.shape) for t in theirs.values())

    # A checkpoint's adapters do not load into the graph without lora (nor a whole model into one with it).
    plain = graph(GRPO, *PLAIN)
    with pytest.raises(ModelError, match=r"model 'actor': the checkpoint's .* holds LoRA adapters"):
        build_models(plain, CPU, last, move=False)
    # Nor adapters trained at another rank or scale alpha / rank (another policy): the key is named.
    for key, value, had in (("rank", 8, 4), ("alpha", 32, 8)):
        with pytest.raises(ModelError, match=rf"models\.actor\.lora\.{key}: .* trained with {key} {had}"):
            build_models(graph(GRPO, f"models.actor.lora.{key}={value}"), CPU, last, move=False)


def test_a_targeted_output_head_saves_its_adapters_not_its_base_weight() -> None:
    """peft's adapter state would hold the frozen ``[V, H]`` weight of a targeted ``lm_head`` too
    (``save_embedding_layers="auto"``): the adapter state (checkpoints, syncs, exports) is the adapters."""
    state = adapter_state_dict(build_models(graph(GRPO, "models.actor.lora.target_modules=[q_proj,lm_head]"),
                                            CPU, None, move=False)[0]["actor"])  # fmt: skip
    assert sorted(state) == sorted(
        f"base_model.model.{m}.lora_{ab}.weight"
        for m in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj")
        for ab in "AB"
    )


def test_validate_names_an_adapter_directory_given_as_a_model_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA run's checkpoint (adapters only) given as a model's ``path``: refused before launch, saying how
    to make a model of it."""
    g = graph(GRPO)
    executor = LocalExecutor(g, CPU)
    save_model(executor.models["actor"].module, g.spec.models["actor"], None, tmp_path / "adapter")
    path = "examples/sft.yaml"
    assert (
        main(["validate", path, f"models.actor.path={tmp_path / 'adapter'}", "models.actor.config=null"]) == 2
    )
    err = capsys.readouterr().err
    assert "models.actor.path:" in err and "holds LoRA adapters only" in err and "--merge" in err, err


def test_resumed_lora_copy_of_a_trained_model_starts_from_its_initial_weights(tmp_path: Path) -> None:
    """A LoRA critic copying (``init_from``) a fully trained actor: on a resume its base is the actor's
    initial weights, not the checkpoint's trained ones (only the critic's adapters are saved)."""
    g = example("examples/ppo.yaml", *lora_overrides("critic"))
    fresh, _ = build_models(g, CPU, None, move=False)
    trained = {k: v + 1.0 for k, v in fresh["actor"].state_dict().items()}
    fresh["actor"].load_state_dict(trained)
    ckpt = tmp_path / "ckpt"
    save_pretrained(fresh["actor"], None, ckpt / "models" / "actor")
    save_model(fresh["critic"], g.spec.models["critic"], None, ckpt / "models" / "critic")
    resumed, _ = build_models(g, CPU, ckpt, move=False)
    assert torch.equal(
        resumed["actor"].state_dict()["model.embed_tokens.weight"], trained["model.embed_tokens.weight"]
    )
    ours, theirs = resumed["critic"].state_dict(), fresh["critic"].state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_adapter_init_is_seeded_not_global() -> None:
    g = graph(GRPO)
    torch.manual_seed(0)
    first = adapter_state_dict(LocalExecutor(g, CPU).models["actor"].module)
    torch.manual_seed(1)
    second = adapter_state_dict(LocalExecutor(g, CPU).models["actor"].module)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert any(bool(v.abs().sum() > 0) for k, v in first.items() if "lora_A" in k)


# ---- bad input -----------------------------------------------------------------------------------------
LORA_EXAMPLE = "examples/lora/grpo.yaml"
BAD = [
    (
        LORA_EXAMPLE,
        ["models.actor.lora.target_modules=[q_proj,qproj]"],
        "models.actor.lora.target_modules: ['qproj'] match no layer of the model; its linear layers are "
        "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
    ),
    (
        "examples/ppo.yaml",
        ["models.critic.lora.target_modules=[lm_head]"],  # a value model has no lm_head
        "models.critic.lora.target_modules: ['lm_head'] match no layer",
    ),
    (LORA_EXAMPLE, ["models.actor.lora.rank=0"], "models.actor.lora.rank: must be >= 1, got 0"),
    (
        LORA_EXAMPLE,
        ["models.actor.lora.rank=129"],
        "models.actor.lora.rank: 129 is above the smaller side of q_proj (128), v_proj (128)",
    ),
    (
        LORA_EXAMPLE,
        ["models.actor.lora.target_modules=[all-linear]"],
        "models.actor.lora.target_modules: write all-linear as a plain string",
    ),
    (LORA_EXAMPLE, ["models.actor.lora.dropout=0.1"], "models.actor.lora.dropout: 0.1: rlflow trains with"),
    (LORA_EXAMPLE, ["models.actor.trainable=false"], "models.actor.lora: the model is frozen"),
    (
        "examples/ppo.yaml",
        ["models.ref.trainable=true", "models.ref.lora.rank=4"],
        "models.ref.lora: no train node trains 'ref'",
    ),
    (LORA_EXAMPLE, ["models.actor.lora=null"], "models.ref.base_of: 'actor' has no 'lora' section"),
    (LORA_EXAMPLE, ["models.ref.base_of=actr"], "models.ref.base_of: unknown model 'actr' (did you mean"),
    (
        LORA_EXAMPLE,
        ["nodes.actor_train.model=ref"],
        "models.ref.base_of: a base view is frozen",
    ),
    (LORA_EXAMPLE, ["models.actor.lora.train_head=true"], "models.actor.lora.train_head: an lm head"),
    (
        "examples/ppo.yaml",
        [*lora_overrides("critic"), "models.ref.base_of=critic", "models.ref.init_from=null",
         "models.ref.head=value"],
        "models.ref.base_of: the value head of 'critic' trains in full",
    ),
    (
        LORA_EXAMPLE,
        ["models.ref.base_of=null", "models.ref.init_from=actor", "models.ref.ema={source: actor}"],
        "models.ref.ema.source: 'actor' trains LoRA adapters",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("path", "overrides", "message"), BAD, ids=[b[2].split(":")[0] for b in BAD])
def test_validate_refuses_bad_lora(
    path: str, overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", path, *overrides]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: {message}" in err, err


def test_validate_accepts_the_lora_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", LORA_EXAMPLE]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {LORA_EXAMPLE}")
