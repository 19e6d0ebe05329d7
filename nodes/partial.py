"""Interruptible generation (partial rollouts): a generate node's responses sampled in segments.

A generate node with ``interrupt_every: S`` (tokens) and ``staleness`` η >= 1 is called once per segment
of one iteration (the asynchronous loop, :mod:`rlflow.schedulers.runtime.asynchronous`, sends the calls
and the weight syncs between them). Segment ``j`` samples at most ``S`` new tokens for every response that
is still unfinished, under the weights the rank holds at that moment, by resubmitting prompt + tokens so far
as a new prompt (the KV cache of the old weights is not reused: the continuation is prefilled under the
new weights, as AReaL's interrupted rollouts recompute theirs). Every token keeps the version (optimizer
steps) and the log-prob of the weights that sampled it, so behaviour-policy log-probs stay exact per token
(what decoupled PPO and the rollout corrections read). The state between segments lives on the rank that
runs the node (:attr:`rlflow.nodes.context.NodeContext.partial`) and is checkpointed with the node's
random generator.

Off by default (``interrupt_every: 0``): AReaL (Fu et al., 2025, arXiv:2505.24298) and verl's fully
asynchronous trainer interrupt rollouts when new weights *arrive*, which costs no waiting but depends on
timing; rlflow fixes the interruption points in its version schedule so that seeded runs stay exactly
reproducible, and then a segment that reads the newest allowed version waits for that training step. The
option therefore trades some of η's throughput for fresher tokens (README "Asynchronous RL").

Shape legend: B prompts, N = B * n rows, M unfinished rows, L continuation width, R = ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["PartialRollout"]


@dataclass
class PartialRollout:
    """One iteration's responses between segments, on the rank that samples them (plain lists: picklable
    into a checkpoint).

    Attributes:
        prompts: per row (N) its prompt tokens (pads dropped).
        ids, logprobs, versions: per row its response tokens so far, their sampler log-probs (nats) and the
            weight version (optimizer steps) that sampled each.
        alive: per row whether it may continue (no stop token, budget left).
        first_version: the version of segment 0 (a row's version when it holds no token).
        segments: segments run so far.
    """

    prompts: list[list[int]]
    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    alive: list[bool] = field(default_factory=list)
    first_version: int = 0
    segments: int = 0

    @classmethod
    def start(
        cls, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, version: int
    ) -> PartialRollout:
        """The state before segment 0: ``n`` rows per prompt (``[B,P]`` left-padded), none sampled."""
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
        prompts = [list(r) for r in rows for _ in range(n)]
        count = len(prompts)
        return cls(
            prompts,
            [[] for _ in range(count)],
            [[] for _ in range(count)],
            [[] for _ in range(count)],
            [True] * count,
            version,
        )

    def continuation(self, pad_id: int, device: torch.device) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The unfinished rows and their prompts to continue: ``(rows, ids [M,L], mask [M,L])``, each the
        original prompt followed by the tokens sampled so far, left-padded (as a generate node's prompts)."""
        rows = [r for r, a in enumerate(self.alive) if a]
        seqs = [self.prompts[r] + self.ids[r] for r in rows]
        width = max((len(s) for s in seqs), default=0)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                ids[i, width - len(s) :] = torch.tensor(s)
                mask[i, width - len(s) :] = 1
        return rows, ids.to(device), mask.to(device)

    def extend(
        self,
        rows: Sequence[int],
        ids: torch.Tensor,
        mask: torch.Tensor,
        logprobs: torch.Tensor,
        version: int,
        budget: int,
        max_new_tokens: int,
        stop_ids: Sequence[int],
    ) -> int:
        """Append one segment's tokens (``[M,budget]`` right-padded, rows in :meth:`continuation`'s order),
        sampled under weight ``version``; a row stays alive when it filled the segment without a stop
        token and has budget left. Returns the tokens appended."""
        stops = set(int(s) for s in stop_ids)
        added = 0
        for i, r in enumerate(rows):
            keep = mask[i].bool().cpu()
            toks = ids[i].cpu()[keep].tolist()
            lps = logprobs[i].float().cpu()[keep].tolist()
            self.ids[r] += toks
            self.logprobs[r] += lps
            self.versions[r] += [version] * len(toks)
            added += len(toks)
            ended = not toks or toks[-1] in stops or len(toks) < budget
            self.alive[r] = not ended and len(self.ids[r]) < max_new_tokens
        self.segments += 1
        return added

    def tensors(
        self, max_new_tokens: int, pad_id: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The finished responses as a generate node returns them: ``response_ids [N,R]``, ``response_mask
        [N,R]``, ``logprobs [N,R]`` (right-padded: pad id, 0, 0), ``token_weight_version [N,R]`` int64
        (each token's version; after a row's end the row's ``weight_version``) and ``weight_version [N]``
        int64: the oldest version among the row's tokens (the bound ``staleness`` holds for)."""
        count = len(self.prompts)
        ids = torch.full((count, max_new_tokens), pad_id, dtype=torch.long)
        mask = torch.zeros((count, max_new_tokens), dtype=torch.long)
        lps = torch.zeros((count, max_new_tokens), dtype=torch.float32)
        oldest = torch.tensor([min(v, default=self.first_version) for v in self.versions], dtype=torch.long)
        token_versions = oldest[:, None].repeat(1, max_new_tokens)
        for r in range(count):
            t = len(self.ids[r])
            if t:
                ids[r, :t] = torch.tensor(self.ids[r])
                mask[r, :t] = 1
                lps[r, :t] = torch.tensor(self.logprobs[r])
                token_versions[r, :t] = torch.tensor(self.versions[r])
        return ids.to(device), mask.to(device), lps.to(device), token_versions.to(device), oldest.to(device)
