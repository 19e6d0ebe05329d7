"""The checks that end a weight sync into a vLLM engine: the engine serves exactly the new weights, and no
prefix-cache block computed with the old ones can serve a later request.

- **Weights** (:func:`check_reload`): the worker's digest check of the reload
  (:class:`~rlflow.nodes.engines.vllm_worker.ReloadCheck`: every tensor as vLLM holds it against the sent
  tensors loaded into it, each parameter loaded, each layer re-processed) and vLLM's mapping of sent names
  to its tensors against the mapping of the engine's first reload, which the probe verified
  (:mod:`rlflow.nodes.engines.probe`; the digests are blind to where in a tensor an element lands).
- **Prefix cache** (:class:`CacheCheck`): after ``reset_prefix_cache`` the engine must hold no cached
  block. In the caller's process vLLM's scheduler is read directly (the block pool's table of cached block
  hashes must be empty: free). An engine in other processes is asked with a canary request of one full
  KV block plus a token, run before the load (so that a block computed with the old weights is cached)
  and again after the reset, which must then report no cached token (``RequestOutput.num_cached_tokens``).
  The canary's prefill costs one block of tokens twice per sync. An engine whose context cannot hold one
  full block and a token never caches a block: nothing to check (:attr:`CacheCheck.needed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlflow.nodes.engines.probe import WeightSyncError

__all__ = ["CacheCheck", "check_reload"]

_SHOWN = 4  # problems named in an error message (the count says how many more)


def check_reload(
    where: str,
    report: Mapping[str, Any],
    reference: Mapping[str, Sequence[str]] | None,
    *,
    model: str,
    version: int,
) -> None:
    """Raise :class:`WeightSyncError` naming ``where`` (node and model), ``model`` and ``version`` when the
    worker's digest ``report`` (``problems``: list of lines; ``sources``: engine tensor -> the sent names
    vLLM loaded into it) found a problem, or when its mapping differs from ``reference`` (the first,
    probed reload's ``sources``; ``None``: this is that reload)."""
    problems = list(report["problems"])
    if reference is not None and dict(report["sources"]) != dict(reference):
        sources = report["sources"]
        for name in sorted(set(sources) | set(reference)):
            got, want = sources.get(name), reference.get(name)
            if got != want:
                problems.append(
                    f"'{name}' was loaded from {got or 'nothing'}, on the verified first reload from {want}"
                )
    if problems:
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise WeightSyncError(
            f"{where}: the vLLM engine does not hold weight version {version} of model '{model}' as sent: "
            + "; ".join(problems[:_SHOWN])
            + more
            + "; the weight sync failed"
        )


class CacheCheck:
    """Whether a vLLM engine's prefix cache is empty after ``reset_prefix_cache`` (module docstring: how).

    Args:
        llm: the running ``vllm.LLM``.
        in_process: the engine runs in this process (its scheduler is read directly).
        vocab_size, max_model_len: the model's; the canary's ids are below ``vocab_size``.
        generate: ``generate(prompts, params)``: the engine's ``LLM.generate``, watched (the canary's calls).
    """

    def __init__(
        self,
        llm: Any,
        *,
        in_process: bool,
        vocab_size: int,
        max_model_len: int,
        generate: Callable[[list[Any], Any], Sequence[Any]],
    ) -> None:
        cache = llm.llm_engine.vllm_config.cache_config
        self.llm = llm
        self.in_process = in_process
        self.generate = generate
        self.block_size = int(cache.block_size)
        self.needed = bool(cache.enable_prefix_caching) and max_model_len >= self.block_size + 2
        """Whether the engine can ever cache a block (prefix caching on; its context holds one full block
        and the token it generates): else there is nothing to check."""
        g = torch.Generator().manual_seed(20260101)
        self.ids = torch.randint(0, vocab_size, (self.block_size + 1,), generator=g).tolist()

    def cached_blocks(self) -> int:
        """In-process engine: the cached blocks in vLLM's block pool (``cached_block_hash_to_block``)."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        return len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)

    def _canary(self) -> int:
        """Run the canary (one token generated); its prompt tokens served from the prefix cache."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        out = self.generate([TokensPrompt(prompt_token_ids=self.ids)], params)
        return int(out[0].num_cached_tokens or 0)

    def before_load(self) -> None:
        """Engine in other processes: run the canary, so that a block computed with the old weights is
        cached (its second run, after the reset, must miss it). Nothing otherwise."""
        if self.needed and not self.in_process:
            self._canary()

    def after_reset(self, where: str, *, reset: bool) -> None:
        """Raise :class:`WeightSyncError` naming ``where`` when the reset failed (``reset``: its return
        value; vLLM refuses while blocks are in use) or the engine still holds a cached block."""
        if not reset:
            raise WeightSyncError(
                f"{where}: the vLLM engine refused to reset its prefix cache (blocks still in use), so "
                "blocks computed with the old weights could serve later requests; the weight sync failed"
            )
        if not self.needed:
            return
        left = self.cached_blocks() if self.in_process else self._canary()
        if left:
            what = (
                f"{left} cached blocks" if self.in_process else f"a canary request hit {left} cached tokens"
            )
            raise WeightSyncError(
                f"{where}: the vLLM engine's prefix cache still holds blocks computed with the old weights "
                f"after its reset ({what}); the weight sync failed"
            )
