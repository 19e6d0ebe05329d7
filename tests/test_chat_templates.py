"""Chat templates: message-list fields rendered with the tokenizer's template (hand-derived ids, one BOS),
SFT and DPO replies masked to exactly the assistant's tokens, the node functions receiving those ids
through the runtime, plain text unchanged, bad input refused in one line naming file and key, and multi-turn
agent rollouts keeping the exact tokens the model produced ("token in, token out") on a tokenizer whose
decode -> encode round trip is not the identity.

The tokenizer (:func:`build_tokenizer`): BPE over single characters with one merge, ``a`` + ``b`` -> ``ab``,
so the ids ``[a, b]`` decode to the text ``"ab"`` that encodes as ``[ab]``; its post-processor adds ``<s>``
to plain text, and its chat template writes ``{{ bos_token }}`` itself::

    <s>  <|role|>content<|end|>  ...  [<|assistant|> with the generation prompt]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import yaml
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.data import make_batch
from rlflow.dataflow.errors import DataError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS
from rlflow.nodes.agent.env import EnvStep
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.tasks.hf_tokenizer import save_tokenizer_dir
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.commands import validate
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import TINY_LLAMA, record_batches

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>"]
SPECIALS += ["<|call|>"]
VOCAB = [*SPECIALS, *"abcdefghijklmnopqrstuvwxyz", " ", "?", "ab"]
ID = {t: i for i, t in enumerate(VOCAB)}  # <pad>=0 <s>=1 </s>=2 ... <|call|>=9; a=10 b=11 c=12 e=14; " "=36
PAD, BOS, EOS, _, USER, ASSISTANT, SYSTEM, TOOL, END, CALL = range(len(SPECIALS))
A, B, C, E, SPACE, AB = ID["a"], ID["b"], ID["c"], ID["e"], ID[" "], ID["ab"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(template: str | None = TEMPLATE) -> Any:
    """The BPE tokenizer of the module docstring (with ``template`` as its chat template, or none)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=ID, merges=[("a", "b")], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS)]
    )
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=SPECIALS[4:], padding_side="left",
    )  # fmt: skip
    out.chat_template = template
    return out


TOK = build_tokenizer()


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# Hand-derived renderings. Row 0: "<s><|system|>be<|end|><|user|>ab c<|end|><|assistant|>" then the reply
# "cab<|end|>" ("ab" merges: c, ab). Row 1: "<s><|user|>a<|end|><|assistant|>" then the multi-turn reply
# "b<|end|>" (assistant), "<|tool|>c<|end|>" (tool), "<|assistant|>" (header), "ab<|end|>" (assistant).
SFT_ROWS = [
    {
        "prompt": [{"role": "system", "content": "be"}, user("ab c")],
        "response": [assistant("cab")],
    },
    {
        "prompt": [user("a")],
        "response": [assistant("b"), {"role": "tool", "content": "c", "name": "x"}, assistant("ab")],
    },
]
SFT_PROMPTS = [[BOS, SYSTEM, B, E, END, USER, AB, SPACE, C, END, ASSISTANT], [BOS, USER, A, END, ASSISTANT]]
SFT_REPLIES = [[C, AB, END], [B, END, TOOL, C, END, ASSISTANT, AB, END]]
SFT_MASKS = [[1, 1, 1], [1, 1, 0, 0, 0, 0, 1, 1]]  # assistant content and its <|end|> only
# DPO: prompt "<s><|user|>ab<|end|><|assistant|>"; chosen "c<|end|>"; rejected "a b<|end|>" (no merge)
DPO_ROWS = [{"prompt": [user("ab")], "chosen": [assistant("c")], "rejected": [assistant("a b")]}] * 2
DPO_PROMPT, DPO_CHOSEN, DPO_REJECTED = [BOS, USER, AB, END, ASSISTANT], [C, END], [A, SPACE, B, END]


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {k: [r[k] for r in rows] for k in rows[0]}


def _unpad(ids: torch.Tensor, mask: torch.Tensor, left: bool) -> list[list[int]]:
    """Each row's real tokens (a reply's mask may hold 0 inside it: its width is up to the last 1)."""
    out = []
    for row, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if left:
            out.append(row[len(row) - sum(m) :])
        else:
            last = max((i for i, v in enumerate(m) if v), default=-1)
            out.append(row[: last + 1])
    return out


def test_prompt_is_rendered_with_the_template_and_one_bos() -> None:
    batch = make_batch(_columns(SFT_ROWS), TOK, ("prompt",))
    assert _unpad(batch.tensor("prompt_ids"), batch.tensor("prompt_mask"), left=True) == SFT_PROMPTS
    # the tokenizer's own path gives the same ids: apply_chat_template(tokenize=True), no second <s>
    for row, expected in zip(SFT_ROWS, SFT_PROMPTS, strict=True):
        ids = TOK.apply_chat_template(
            row["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert list(ids) == expected
        assert expected.count(BOS) == 1
    # left-padded: row 1 (5 tokens) behind 6 pads
    assert batch.tensor("prompt_ids")[1].tolist() == [PAD] * 6 + SFT_PROMPTS[1]


def test_plain_text_keeps_its_tokenization_with_a_template_present() -> None:
    batch = make_batch({"prompt": ["ab c"], "response": ["cab"]}, TOK, ("prompt", "response"))
    assert batch.tensor("prompt_ids").tolist() == [[BOS, AB, SPACE, C]]  # the post-processor's <s>
    assert batch.tensor("response_ids").tolist() == [[C, AB, EOS]]  # EOS appended, no <s>
    assert batch.tensor("response_mask").tolist() == [[1, 1, 1]]


def test_sft_reply_mask_covers_exactly_the_assistant_tokens() -> None:
    batch = make_batch(_columns(SFT_ROWS), TOK, ("prompt", "response"))
    ids, mask = batch.tensor("response_ids"), batch.tensor("response_mask")
    assert ids.tolist() == [[*SFT_REPLIES[0], *[PAD] * 5], SFT_REPLIES[1]]  # right-padded, no EOS added
    assert mask.tolist() == [[*SFT_MASKS[0], *[0] * 5], SFT_MASKS[1]]
    # the prompt followed by the reply is the whole conversation as the template renders it
    row = SFT_ROWS[1]
    text = TOK.apply_chat_template(row["prompt"] + row["response"], tokenize=False)
    assert TOK(text, add_special_tokens=False)["input_ids"] == SFT_PROMPTS[1] + SFT_REPLIES[1]


def test_dpo_chosen_and_rejected_are_rendered_after_the_prompt() -> None:
    batch = make_batch(_columns(DPO_ROWS[:1]), TOK, ("prompt", "chosen", "rejected"))
    assert batch.tensor("prompt_ids").tolist() == [DPO_PROMPT]
    assert batch.tensor("chosen_ids").tolist() == [DPO_CHOSEN]
    assert batch.tensor("chosen_mask").tolist() == [[1, 1]]
    assert batch.tensor("rejected_ids").tolist() == [DPO_REJECTED]
    assert batch.tensor("rejected_mask").tolist() == [[1, 1, 1, 1]]


# -------------------------------------------------------------------------------------------------
# Through the runtime: the node functions receive the rendered ids


def _graph_file(
    tmp: Path, rows: list[dict[str, Any]], nodes: dict[str, Any], tokenize: list[str], tokenizer: Any = TOK
) -> Path:
    """A graph file over ``rows`` (a JSONL file) with the tiny Llama and ``tokenizer`` (saved with its chat
    template); returns its path."""
    tok_dir = save_tokenizer_dir(tokenizer, tmp / "tokenizer")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    graph = {
        "models": {
            "actor": {
                "config": {**TINY_LLAMA, "vocab_size": len(VOCAB)},
                "tokenizer": str(tok_dir),
                "optimizer": {"lr": 1.0e-3},
            },
            "ref": {"init_from": "actor", "trainable": False},
        },
        "data": {
            "train": str(data),
            "fields": {k: k for k in rows[0]},
            "tokenize": tokenize,
            "tokenizer": "actor",
            "shuffle": False,
        },
        "nodes": nodes,
        "run": {"iterations": 1, "seed": 1, "output_dir": str(tmp / "run"), "checkpoint_interval": 0,
                "eval_interval": 0, "devices": 1},
    }  # fmt: skip
    if not any(n["model"] == "ref" for n in nodes.values()):
        del graph["models"]["ref"]
    path = tmp / "graph.yaml"
    path.write_text(yaml.safe_dump(graph))
    return path


def _seen_batches(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Batch], dict[str, float]]:
    """Run the graph one iteration; the batch each node function received, by node, and the metrics."""
    controller = Controller(resolve_plan(load_graph(str(path)), None))
    seen = record_batches(controller, monkeypatch)
    return seen, controller.run().metrics


SEQ = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]


def test_sft_node_trains_on_the_rendered_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = {"train": {"model": "actor", "kind": "train", "function": "sft", "inputs": SEQ, "batch_size": 2}}
    seen, metrics = _seen_batches(_graph_file(tmp_path, SFT_ROWS, nodes, ["prompt", "response"]), monkeypatch)
    b = seen["train"]
    assert _unpad(b.tensor("prompt_ids"), b.tensor("prompt_mask"), left=True) == SFT_PROMPTS
    assert _unpad(b.tensor("response_ids"), b.tensor("response_mask"), left=False) == SFT_REPLIES
    assert b.tensor("response_mask").tolist() == [[*SFT_MASKS[0], *[0] * 5], SFT_MASKS[1]]
    assert math.isfinite(metrics["actor/nll"])


def test_dpo_nodes_get_rendered_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def ref(which: str) -> dict[str, Any]:
        return {
            "model": "ref", "kind": "inference", "function": "sequence_logps", "batch_size": 2,
            "inputs": {"prompt_ids": "prompt_ids", "prompt_mask": "prompt_mask",
                       "response_ids": f"{which}_ids", "response_mask": f"{which}_mask"},
            "outputs": {"logps": f"ref_{which}_logps"},
        }  # fmt: skip

    pair = ["prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"]
    nodes = {
        "ref_chosen": ref("chosen"),
        "ref_rejected": ref("rejected"),
        "train": {"model": "actor", "kind": "train", "function": "dpo", "batch_size": 2,
                  "inputs": [*pair, "ref_chosen_logps", "ref_rejected_logps"]},
    }  # fmt: skip
    path = _graph_file(tmp_path, DPO_ROWS, nodes, ["prompt", "chosen", "rejected"])
    seen, metrics = _seen_batches(path, monkeypatch)
    b = seen["train"]
    assert b.tensor("prompt_ids").tolist() == [DPO_PROMPT] * 2
    assert b.tensor("chosen_ids").tolist() == [DPO_CHOSEN] * 2
    assert b.tensor("rejected_ids").tolist() == [DPO_REJECTED] * 2
    assert b.tensor("chosen_mask").tolist() == [[1, 1]] * 2
    assert seen["ref_rejected"].tensor("response_ids").tolist() == [DPO_REJECTED] * 2
    assert math.isfinite(metrics["actor/dpo_loss"])


# -------------------------------------------------------------------------------------------------
# Bad input: one line before anything starts, naming the graph file and the key


def _validate_errors(path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert validate.run(argparse.Namespace(items=[str(path)])) == 2
    return capsys.readouterr().err.splitlines()


def test_message_lists_without_a_chat_template_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = {"train": {"model": "actor", "kind": "train", "function": "sft", "inputs": SEQ, "batch_size": 2}}
    path = _graph_file(tmp_path, SFT_ROWS, nodes, ["prompt", "response"], build_tokenizer(template=None))
    assert load_tokenizer(tmp_path / "tokenizer").chat_template is None
    [line] = _validate_errors(path, capsys)
    assert line.startswith(
        f"rlflow validate: error: {path}: data '{tmp_path / 'data.jsonl'}': data.fields.prompt holds "
    )
    assert "has no chat template" in line


@pytest.mark.parametrize(
    ("prompt", "response", "message"),
    [
        ([{"content": "a"}], [assistant("b")], r"data\.fields\.prompt: row 1, message 0: no 'role'"),
        ([{"role": "user"}], [assistant("b")], r"data\.fields\.prompt: row 1, message 0: no 'content'"),
        ([user("a")], [{"role": "robot", "content": "b"}],
         r"data\.fields\.response: row 1, message 0: unknown role 'robot'; roles: system, user, assistant"),
        ([user("a")], [user("b")],
         r"data\.fields\.response: row 1: the reply's first message has role 'user'"),
        ([], [assistant("b")], r"data\.fields\.prompt: row 1: the message list is empty"),
    ],
)  # fmt: skip
def test_malformed_messages_are_refused_naming_file_key_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], prompt: Any, response: Any, message: str
) -> None:
    import re

    rows = [{"prompt": [user("a")], "response": [assistant("b")]}, {"prompt": prompt, "response": response}]
    nodes = {"train": {"model": "actor", "kind": "train", "function": "sft", "inputs": SEQ, "batch_size": 2}}
    path = _graph_file(tmp_path, rows, nodes, ["prompt", "response"])
    [line] = _validate_errors(path, capsys)
    assert line.startswith(f"rlflow validate: error: {path}: data '{tmp_path / 'data.jsonl'}': ")
    assert re.search(message, line), line


def test_a_field_mixing_text_and_messages_is_refused() -> None:
    # (pyarrow refuses such a JSONL column itself; a generator's rows reach make_batch)
    with pytest.raises(
        DataError, match=r"data\.fields\.response: row 0 holds a message list but row 1 holds 'b'"
    ):
        make_batch(
            {"prompt": [[user("a")]] * 2, "response": [[assistant("b")], "b"]}, TOK, ("prompt", "response")
        )


def test_a_template_that_rewrites_earlier_turns_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # only the last message is rendered with its role: "<s><|user|>a<|end|>" becomes "<s>a<|assistant|>..."
    rewriting = build_tokenizer(
        "{{ bos_token }}{% for m in messages %}{% if loop.last %}<|{{ m.role }}|>{{ m.content }}<|end|>"
        "{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    nodes = {"train": {"model": "actor", "kind": "train", "function": "sft", "inputs": SEQ, "batch_size": 2}}
    path = _graph_file(tmp_path, SFT_ROWS, nodes, ["prompt", "response"], rewriting)
    [line] = _validate_errors(path, capsys)
    assert line.startswith(
        f"rlflow validate: error: {path}: data '{tmp_path / 'data.jsonl'}': data.fields.response: row 0: "
    )
    assert "the chat template does not render the conversation so far as the start of the next" in line
    with pytest.raises(DataError, match=r"data\.fields\.response: row 0: the chat template does not render"):
        make_batch(
            {"prompt": [[user("a")]], "response": [[assistant("b")]]}, rewriting, ("prompt", "response")
        )


# -------------------------------------------------------------------------------------------------
# Token in, token out: the agent keeps the model's ids; only new text (an observation) is tokenized


PROMPT = [user("ab")]
TURNS = [[A, B, CALL], [A, B, C, EOS]]  # model turns: "ab" as two tokens, never the merged "ab" token


class ScriptedLM(nn.Module):
    """A causal-LM stand-in emitting :data:`TURNS` (logit 2 on the scripted token); it records the context of
    each prefill (one per model turn)."""

    def __init__(self, prompt_len: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.prompt_len = prompt_len
        self.contexts: list[list[int]] = []

    def next_token(self, ctx: list[int]) -> int:
        response = ctx[self.prompt_len :]
        turn = response.count(CALL)
        since = response[response.index(AB) + 1 :] if AB in response else response  # after the observation
        return TURNS[turn][len(since)]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kw: Any) -> Any:
        past = kw.get("past_key_values")
        if past is None:
            ctx = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask, strict=True)]
            self.contexts += ctx
        else:
            ctx = [[*c, int(t)] for c, t in zip(past, input_ids[:, -1], strict=True)]
        logits = torch.zeros(len(ctx), 1, len(VOCAB))
        for b, c in enumerate(ctx):
            logits[b, 0, self.next_token(c)] = 2.0
        return SimpleNamespace(logits=logits, past_key_values=ctx)


class EchoEnv:
    """Answers each turn with its own text: the observation ``"ab"`` is new text, tokenized alone."""

    turns: ClassVar[list[str]] = []

    def reset(self, prompt: str) -> None:
        pass

    def step(self, turn_text: str) -> EnvStep:
        EchoEnv.turns.append(turn_text)
        return EnvStep("ab", tool_calls=1)


def test_agent_rollout_keeps_the_exact_model_tokens() -> None:
    ids = TOK.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    prompt = make_batch({"prompt": [PROMPT]}, TOK, ("prompt",))
    prompt_ids = prompt.tensor("prompt_ids")[0].tolist()
    assert prompt_ids == TOK(ids, add_special_tokens=False)["input_ids"] == [BOS, USER, AB, END, ASSISTANT]
    # the tokenizer's round trip is not the identity on what the model emits: [a, b] -> "ab" -> [ab]
    assert TOK(TOK.decode([A, B]), add_special_tokens=False)["input_ids"] == [AB]
    lm = ScriptedLM(len(prompt_ids))
    args = {"greedy": True, "call_stop_tokens": ["<|call|>"], "max_new_tokens": 12, "env": "tests."
            "test_chat_templates:EchoEnv", "max_turns": 3}  # fmt: skip
    ctx = NodeContext(
        node=NodeSpec("gen", "generate", "agent_generate", model="m", args=args),
        model=ModelState("m", lm, "lm", tokenizer=TOK),
        generator=torch.Generator().manual_seed(0),
    )
    EchoEnv.turns = []
    entry = NODE_FUNCTIONS.get("agent_generate")
    out = entry.fn(ctx, prompt, **entry.bind(args)).outputs
    generated = [
        *TURNS[0],
        AB,
        *TURNS[1],
    ]  # model tokens, the observation "ab" (tokenized alone), model tokens
    assert out["response_ids"].tolist() == [[*generated, PAD, PAD, PAD, PAD]]
    assert out["response_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]]
    # the second turn continued from the very ids of the first, not from a re-encoding of their text
    assert lm.contexts == [prompt_ids, [*prompt_ids, A, B, CALL, AB]]
    assert EchoEnv.turns == ["ab"]  # the environment reads the decoded text
