"""Expert-parallel generation on a process group: the ``generate`` node function on an ep group (experts
split, ``NodeContext.keep_going`` the runtime's lockstep) against the same rows decoded by one process at
ep 1 (the whole model, no lockstep), as every rank of ``tests/test_dist_experts.py``'s group computes it.

Each rank gets its own prompts, seed and ``stop_tokens`` that end rows early, so the ranks' rows finish at
different decode steps (the case checks that they do: otherwise lockstep would never be exercised). Cases:
sampled with ``n`` 2 over 2 micro-batches (the loop compacts its cache: a finished rank forwards one dummy
row); the same with ``record_routes`` (the uncompacted loop: every row forwarded; its routes must be the
rank's own, not the dummy forwards'); greedy; and an interruptible node's segments (``interrupt_every``)
where one rank has no rows left in the last segment (it forwards a dummy prompt until the other's end).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.node_spec import NodeSpec

PROMPTS = 4  # per rank
PROMPT_SEED, GEN_SEED = 122, 12  # chosen so that the ranks' rows end at different steps (checked)
MAX_NEW = 10
STOP = list(range(3, 10))  # with EOS: 8 of the 32 ids end a row


def _prompts(rank: int) -> Batch:
    g = torch.Generator().manual_seed(PROMPT_SEED + rank)
    mask = torch.ones(PROMPTS, 5, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    return Batch({"prompt_ids": torch.randint(7, 32, (PROMPTS, 5), generator=g) * mask, "prompt_mask": mask})


def _tokenizer() -> Any:
    class Tok:  # the ids TokenizerInfo reads (the MoE config's pad and EOS)
        pad_token_id, eos_token_id = 0, 2

    return Tok()


def _ctx(node: NodeSpec, module: torch.nn.Module, seed: int, keep_going: Any, micro: int) -> Any:
    from rlflow.nodes.context import ModelState, NodeContext

    state = ModelState(name="m", module=module, head="lm", tokenizer=_tokenizer())
    gen = torch.Generator().manual_seed(seed)
    return NodeContext(node=node, model=state, micro_batches=micro, generator=gen, keep_going=keep_going)


def _call(node: NodeSpec, module: torch.nn.Module, rank: int, keep_going: Any, micro: int) -> dict[str, Any]:
    """The node's outputs on this rank's prompts (every segment in turn for an interruptible node)."""
    from rlflow.nodes.functions.generate import generate_node

    ctx = _ctx(node, module, GEN_SEED + rank, keep_going, micro)
    batch = _prompts(rank)
    if not node.interrupt_every:
        return dict(generate_node(ctx, batch, **node.args).outputs)
    segments = -(-node.args["max_new_tokens"] // node.interrupt_every)
    out: dict[str, Any] = {}
    for j in range(segments):
        ctx.segment = (j, segments)
        result = generate_node(ctx, batch, **node.args)
        out = dict(result.outputs) if j == segments - 1 else out
    return out


DEFAULTS = {  # the generate function's arguments (its schema's defaults)
    "n": 1,
    "temperature": 1.0,
    "top_p": None,
    "top_k": None,
    "greedy": False,
    "gpu_memory_utilization": None,
    "enable_sleep_mode": False,
    "record_routes": False,
}
CASES = {
    "sampled_compact": ({"n": 2}, 2, 0),
    "sampled_routes": ({"n": 2, "record_routes": True}, 2, 0),
    "greedy": ({"n": 1, "greedy": True}, 1, 0),
    "segments": ({"n": 1}, 1, 4),
}


def generation_diffs(rank: int, lm: torch.nn.Module, mesh_experts: tuple[Any, Any]) -> dict[str, float]:
    """``gen/<case>/<output>``: the largest difference between the ep group's outputs and one process's
    (0 when bit for bit); ``gen/<case>/steps``: this rank's longest response (tokens), which the test
    compares across ranks; ``gen/segments/last_rows``: rows this rank still decoded in the last segment."""
    from rlflow.schedulers.runtime.distributed.experts import decode_lockstep, shard_experts

    _, experts = mesh_experts
    sharded = copy.deepcopy(lm)
    shard_experts(sharded, experts)
    keep_going = decode_lockstep(experts, torch.device("cpu"))
    diffs: dict[str, float] = {}
    for case, (extra, micro, every) in CASES.items():
        args = {**DEFAULTS, "max_new_tokens": MAX_NEW, "stop_tokens": STOP, **extra}
        staleness = {"staleness": 1, "interrupt_every": every} if every else {}
        node = NodeSpec(name="gen", kind="generate", function="generate", model="m", args=args, **staleness)
        ref = _call(node, lm, rank, None, micro)
        got = _call(node, sharded, rank, keep_going, micro)
        assert got.keys() == ref.keys(), (case, got.keys(), ref.keys())
        for key, value in ref.items():
            diffs[f"gen/{case}/{key}"] = float((got[key].double() - value.double()).abs().max())
        lengths = ref["response_mask"].sum(-1)
        diffs[f"gen/{case}/steps"] = float(lengths.max())
        if every:  # rows still decoding in the last segment: longer than the segments before it
            diffs[f"gen/{case}/last_rows"] = float((lengths > every * ((MAX_NEW - 1) // every)).sum())
    return diffs
