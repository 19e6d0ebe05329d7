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

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.engines.probe import WeightSyncError
from rlflow.nodes.engines.vllm_processes import EngineDiedError

__all__ = ["CacheCheck", "ReloadMapping", "check_reload"]

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


class ReloadMapping:
    """vLLM's mapping of sent names to its tensors as the engine's first checked reload, verified by the
    probe, observed it (``sources``; ``None`` until then)."""

    def __init__(self) -> None:
        self.sources: dict[str, Any] | None = None

    def verify(
        self,
        where: str,
        report: Mapping[str, Any] | None,
        probe: Callable[[], float],
        *,
        model: str,
        version: int,
    ) -> float | None:
        """Verify a reload by its digest ``report`` (:func:`check_reload` against :attr:`sources`), and by
        ``probe()`` (raises on a gap; returns it) on the first checked reload (its mapping then becomes
        :attr:`sources`) or when the reload was not checked (``report`` None). Returns the probe's gap,
        ``None`` when the digests alone verified the reload.

        Raises:
            WeightSyncError: as :func:`check_reload` and the probe.
        """
        if report is not None:
            check_reload(where, report, self.sources, model=model, version=version)
            if self.sources is not None:
                return None
        gap = probe()
        if report is not None:
            self.sources = dict(report["sources"])
        return gap


class CacheCheck:
    """Whether a vLLM engine's prefix cache is empty after ``reset_prefix_cache`` (module docstring: how).

    Args:
        llm: the running ``vllm.LLM``.
        in_process: the engine runs in this process (its scheduler is read directly).
        vocab_size, max_model_len: the model's; the canary's ids are below ``vocab_size``.
        call: ``call(what, fn, *args, **kwargs)``: a call into the engine, watched
            (:func:`~rlflow.nodes.engines.vllm_processes.watched_call`).
    """

    def __init__(
        self,
        llm: Any,
        *,
        in_process: bool,
        vocab_size: int,
        max_model_len: int,
        call: Callable[..., Any],
    ) -> None:
        cache = llm.llm_engine.vllm_config.cache_config
        self.llm = llm
        self.in_process = in_process
        self.call = call
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
        prompt = [TokensPrompt(prompt_token_ids=self.ids)]
        out = self.call("the prefix-cache check", self.llm.generate, prompt, params, use_tqdm=False)
        return int(out[0].num_cached_tokens or 0)

    def before_load(self) -> None:
        """Engine in other processes: run the canary, so that a block computed with the old weights is
        cached (its second run, after the reset, must miss it). Nothing otherwise."""
        if self.needed and not self.in_process:
            self._canary()

    def reset(self, where: str) -> None:
        """Reset the prefix cache (``LLM.reset_prefix_cache``) and check that it holds no block.

        Raises:
            WeightSyncError: naming ``where`` (node and model), when vLLM refused the reset (it does while
                blocks are in use) or the engine still holds a cached block after it; NodeError: the call
                failed (``EngineDiedError``: the engine's process died).
        """
        try:
            reset = self.call("a prefix-cache reset", self.llm.reset_prefix_cache)
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(f"{where}: resetting the vLLM engine's prefix cache failed: {e}") from e
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
