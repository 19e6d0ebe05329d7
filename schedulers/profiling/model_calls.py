"""What a node's compute costs on this host: one ``LlamaDecoderLayer`` (forward, backward, a decode step)
over a grid of batch sizes × sequence lengths, the node functions' model calls on the model cut to one
layer (``model_*`` rows), AdamW steps (``optimizer``), and the same calls in the runtime's 2-way tensor
parallel and FSDP2 layouts (``tp_*``, ``fsdp_*``). Seconds per call, fp32."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from rlflow.schedulers.planner.calibration import DECODE_STEPS
from rlflow.schedulers.planner.call_cost import forward_flops
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.profiling.measure import one_layer, profile_row, time_call, time_cold, time_collective

__all__ = ["profile_block", "profile_layouts", "profile_model_calls", "profile_optimizer", "tp_skipped"]


def _decode_step(layer: Any, cache: Any, x1: torch.Tensor, p1: torch.Tensor, pe1: Any) -> Callable[[], None]:
    """One decode step against a fixed cache: the cache is reset to its prefilled length each call."""
    keys, values = cache.layers[0].keys, cache.layers[0].values

    def step() -> None:
        cache.layers[0].keys, cache.layers[0].values = keys, values
        layer(x1, position_ids=p1, past_key_values=cache, use_cache=True, position_embeddings=pe1)

    return step


def profile_block(
    config: dict[str, Any], batch_sizes: Sequence[int], seq_lens: Sequence[int], repeats: int = 2
) -> list[dict[str, Any]]:
    """Forward / backward / decode-step seconds of one ``LlamaDecoderLayer`` (fp32, this process).

    Returns rows with ``op``, ``batch``, ``seq``, ``flops`` (analytic, ``cost.forward_flops`` of one layer)
    and ``bytes`` (decode: weights + KV cache read per step) and ``seconds``.
    """
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**one_layer(config))
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    rope = LlamaRotaryEmbedding(cfg)
    shape = ModelShape.from_config(one_layer(config), dtype="float32")
    layer_bytes = shape.layer_params * 4
    rows: list[dict[str, Any]] = []
    for b in batch_sizes:
        for s in seq_lens:
            x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
            pos = torch.arange(s)[None].expand(b, -1)
            pe = rope(x, pos)
            fwd_flops = forward_flops(shape, b, s) - 2.0 * b * s * shape.head_params  # one layer, no head

            def forward(x: torch.Tensor = x, pos: torch.Tensor = pos, pe: Any = pe) -> torch.Tensor:
                return layer(x, position_ids=pos, position_embeddings=pe)

            with torch.no_grad():
                t_fwd = time_call(forward, repeats)

            def fwd_bwd(x: torch.Tensor = x) -> None:
                forward(x).sum().backward()

            t_fb = time_call(fwd_bwd, repeats)
            layer.zero_grad(set_to_none=True)
            # Decode: one new token per row attending to a cache of s tokens.
            with torch.no_grad():
                cache = DynamicCache(config=cfg)
                layer(
                    x.detach(),
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    position_embeddings=pe,
                )
                x1 = torch.randn(b, 1, cfg.hidden_size)
                p1 = torch.full((b, 1), s)
                pe1 = rope(x1, p1)
                t_dec = time_call(_decode_step(layer, cache, x1, p1, pe1), repeats)
            kv_bytes = 2 * shape.kv_dim * s * b * 4
            dec_flops = 2.0 * b * shape.layer_params + 4.0 * b * s * shape.q_dim
            rows += [
                profile_row("forward", t_fwd, batch=b, seq=s, flops=fwd_flops),
                profile_row("backward", max(t_fb - t_fwd, 1e-9), batch=b, seq=s, flops=2 * fwd_flops),
                profile_row("decode", t_dec, batch=b, seq=s, flops=dec_flops, bytes=layer_bytes + kv_bytes),
            ]
    return rows


def profile_model_calls(
    config: dict[str, Any], batch_sizes: Sequence[int], seq_lens: Sequence[int], repeats: int = 2
) -> list[dict[str, Any]]:
    """Seconds of the node functions' model calls on the model cut to one layer (fp32, this process).

    ``model_forward``: ``response_logits`` + ``label_logprobs`` over ``batch`` rows of ``seq`` tokens (half
    prompt, half response); ``model_backward``: the backward of their mean; ``model_decode``: one generated
    token of ``generate`` (a decode step with its KV cache and sampling) after a ``seq``-token prompt;
    ``model_step`` (middle batch, longest sequence): a whole train step as ``rlflow.nodes.train.optimize``
    takes it (forward, backward, clipping, AdamW and its schedule, ``zero_grad``);
    ``flops`` is the head's (``2 · tokens · V · H``); the block's share is in :func:`profile_block`'s rows.
    """
    from rlflow.dataflow.model_spec import OptimizerSpec
    from rlflow.nodes.forward import response_logits
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import build_model
    from rlflow.nodes.rl import label_logprobs
    from rlflow.nodes.tokenizers import TokenizerInfo
    from rlflow.nodes.train import build_optimizer

    cfg = {"model_type": "llama", **one_layer(config)}
    model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile")
    model.eval()
    shape = ModelShape.from_config(cfg, dtype="float32")
    head = 2.0 * shape.vocab_size * shape.hidden_size  # FLOPs per token of the output projection
    info = TokenizerInfo(pad_id=0, eos_id=-1)  # no row ever stops early
    params = list(model.parameters())
    optimizer, scheduler = build_optimizer(model, OptimizerSpec(), 1 << 30)
    vocab = shape.vocab_size
    rows: list[dict[str, Any]] = []
    for b in batch_sizes:
        for s in seq_lens:
            n_prompt, n_resp = max(1, s // 2), max(1, s - s // 2)
            gen = torch.Generator().manual_seed(0)
            prompt = torch.randint(1, vocab, (b, n_prompt), generator=gen)
            response = torch.randint(1, vocab, (b, n_resp), generator=gen)
            ones_r = torch.ones_like(response)

            def logprobs(
                prompt: torch.Tensor = prompt, response: torch.Tensor = response, mask: torch.Tensor = ones_r
            ) -> torch.Tensor:
                logits = response_logits(model, prompt, torch.ones_like(prompt), response, mask).float()
                return label_logprobs(logits, response, mask)

            with torch.no_grad():
                t_fwd = time_call(logprobs, repeats)
            t_fb = time_call(lambda: logprobs().mean().backward(), repeats)
            model.zero_grad(set_to_none=True)
            prompt_s = torch.randint(1, vocab, (b, max(1, s)), generator=gen)

            def sample(tokens: int, prompt: torch.Tensor = prompt_s, rng: torch.Generator = gen) -> None:
                generate(model, info, prompt, torch.ones_like(prompt), max_new_tokens=tokens, generator=rng)

            one = time_call(partial(sample, 1), repeats)
            more = time_call(partial(sample, 1 + DECODE_STEPS), repeats)
            if (b, s) == (sorted(batch_sizes)[len(batch_sizes) // 2], max(seq_lens)):
                rows.append(profile_row("model_cold", time_cold(logprobs, repeats), batch=b, seq=s))

                def train_step(logprobs: Callable[[], torch.Tensor] = logprobs) -> None:
                    logprobs().mean().backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)

                rows.append(profile_row("model_step", time_call(train_step, repeats), batch=b, seq=s))
            rows += [
                profile_row("model_forward", t_fwd, batch=b, seq=s, flops=head * b * n_resp),
                profile_row(
                    "model_backward", max(t_fb - t_fwd, 1e-9), batch=b, seq=s, flops=2 * head * b * n_resp
                ),
                profile_row(
                    "model_decode", max(more - one, 1e-9) / DECODE_STEPS, batch=b, seq=s, flops=head * b
                ),
            ]
    return rows


def profile_optimizer(
    counts: Sequence[int] = (4, 32), numels: Sequence[int] = (1024, 65536), repeats: int = 3
) -> list[dict[str, Any]]:
    """Seconds of one optimizer step as ``rlflow.nodes.train.optimize`` takes it (gradient clipping, AdamW,
    ``zero_grad``) over ``count`` fp32 parameter tensors of ``numel`` elements; ``bytes`` is what Adam
    streams (weights, grads, two moments: read and written, 32 bytes per element)."""
    rows: list[dict[str, Any]] = []
    for count in counts:
        for numel in numels:
            params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(count)]
            opt = torch.optim.AdamW(params, lr=1e-4)

            def step(params: list[torch.nn.Parameter] = params, opt: Any = opt) -> None:
                for param in params:
                    param.grad = torch.ones_like(param)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            rows.append(
                profile_row("optimizer", time_call(step, repeats), count=count, bytes=32 * numel * count)
            )
    return rows


# ---- parallel layouts -------------------------------------------------------------------------------


def _layout_worker(
    rank: int, world: int, config: dict[str, Any], dp: int, tp: int, batch: int, seq: int, repeats: int
) -> list[dict[str, Any]]:
    """On ``dp · tp`` ranks: the one-layer model in the runtime's layout (``apply_layout``; FSDP2 when
    dp > 1), timed as :func:`profile_model_calls` times it (rank 0 returns the rows)."""
    from rlflow.nodes.forward import response_logits
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import build_model
    from rlflow.nodes.rl import label_logprobs
    from rlflow.nodes.tokenizers import TokenizerInfo
    from rlflow.schedulers.planner.plans import Layout
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout, dist_clip_grad_norm_
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache

    cfg = {"model_type": "llama", **one_layer(config)}
    model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile")
    mesh = GroupCache(300.0).mesh(MeshSpec.of(range(world), Layout(dp, tp, 1, 1)))
    model = apply_layout(model, mesh, train=dp > 1, where="profile")
    model.eval()
    gen = torch.Generator().manual_seed(0)
    vocab = int(cfg["vocab_size"])
    prompt = torch.randint(1, vocab, (batch, max(1, seq // 2)), generator=gen)
    response = torch.randint(1, vocab, (batch, max(1, seq - seq // 2)), generator=gen)
    ones = torch.ones_like(response)

    def logprobs() -> torch.Tensor:
        logits = response_logits(model, prompt, torch.ones_like(prompt), response, ones).float()
        return label_logprobs(logits, response, ones)

    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> None:  # the optimizer step on the gradients of the last backward
        dist_clip_grad_norm_(params, 1.0)
        opt.step()

    where = {"batch": batch, "seq": seq, "group_size": world}
    if dp > 1:  # FSDP2: a train micro-batch (forward + backward), then optimizer steps over its gradients
        t_fb = time_collective(lambda: logprobs().mean().backward(), repeats)
        rows = [
            profile_row("fsdp_step", t_fb, **where),
            profile_row("fsdp_optimizer", time_collective(step, repeats), count=len(params), **where),
        ]
    else:
        with torch.no_grad():
            t_fwd = time_collective(logprobs, repeats)
        t_fb = time_collective(lambda: logprobs().mean().backward(), repeats)
        model.zero_grad(set_to_none=True)
        info = TokenizerInfo(pad_id=0, eos_id=-1)
        prompt_s = torch.randint(1, vocab, (batch, max(1, seq)), generator=gen)

        def sample(tokens: int) -> None:
            generate(model, info, prompt_s, torch.ones_like(prompt_s), max_new_tokens=tokens, generator=gen)

        one = time_collective(partial(sample, 1), repeats)
        more = time_collective(partial(sample, 1 + DECODE_STEPS), repeats)
        rows = [
            profile_row("tp_forward", t_fwd, **where),
            profile_row("tp_backward", max(t_fb - t_fwd, 1e-9), **where),
            profile_row("tp_decode", max(more - one, 1e-9) / DECODE_STEPS, **where),
        ]
    return rows if rank == 0 else []


def profile_layouts(
    config: dict[str, Any], batch: int, seq: int, repeats: int = 2, degree: int = 2
) -> list[dict[str, Any]]:
    """The one-layer model's calls in the runtime's parallel layouts on ``degree`` gloo processes: tensor
    parallel (``tp_forward``, ``tp_backward``, ``tp_decode`` per generated token) and FSDP2 data parallel
    (``fsdp_step``: a train micro-batch; ``fsdp_optimizer``: the optimizer step over its ``count`` DTensor
    parameters, global-norm clipping included). What they cost beyond the single-process rows and the
    fitted collectives is DTensor / FSDP2 software overhead (``cluster.Overheads``)."""
    from rlflow.schedulers.runtime.distributed.launch import run_group

    rows: list[dict[str, Any]] = []
    layouts = ((degree, 1),) if tp_skipped(config, degree) else ((1, degree), (degree, 1))
    for dp, tp in layouts:
        rows += run_group(_layout_worker, degree, (config, dp, tp, batch, seq, repeats), timeout_s=600.0)[0]
    return rows


def tp_skipped(config: dict[str, Any], degree: int = 2) -> str | None:
    """Why :func:`profile_layouts` measures no tensor-parallel rows for ``config`` (``tp=degree`` does not
    divide one of ``rlflow.dataflow.layout_rules.TP_FIELDS``: no tensor-parallel layout can run the model,
    so its overheads keep the cluster file's values), or ``None``."""
    from rlflow.dataflow.layout_rules import TP_FIELDS

    for field in TP_FIELDS:
        value = config.get(field)
        if isinstance(value, int) and value % degree:
            return f"tp={degree} does not divide {field}={value}"
    return None
