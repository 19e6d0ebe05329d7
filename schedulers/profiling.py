"""``rlflow profile``: measure this machine for one model shape and fit the cost model's rates and overheads.

Measured (seconds: the mean over at least ``repeats`` calls and 0.1 s after a warm-up call, a sustained
rate), with the torch thread count the runtime's workers use (``DistConfig.threads``, set here and
recorded per row), so the fitted rates are a worker's:
  * forward, backward and one decode step of one transformer block (``transformers``'
    ``LlamaDecoderLayer`` built from the model's config) over a grid of batch sizes × sequence lengths;
  * the same calls on the whole model cut to one layer (``rlflow.nodes.models.build_model``), through the code
    the node functions run (``response_logits`` + ``label_logprobs`` forward, its backward, and
    ``rlflow.nodes.generation.generate`` per generated token: ``model_forward`` / ``model_backward`` /
    ``model_decode``), a forward after 20 ms idle (``model_cold``) and a whole train step (``model_step``);
  * the same model in the runtime's 2-way layouts (``runtime.distributed.layouts.apply_layout`` on gloo):
    tensor parallel forward, backward, decode (``tp_*``) and an FSDP2 train micro-batch and optimizer
    step (``fsdp_*``);
  * AdamW steps with gradient clipping over a grid of tensor counts × sizes (``optimizer``);
  * gloo all-reduce, all-gather, reduce-scatter and broadcast among ``n`` worker processes
    (``torch.multiprocessing.spawn``) for several sizes;
  * the controller → worker round trip of a command through the runtime's pickled pipe protocol
    (``runtime.distributed.protocol.send``/``recv``), empty and carrying a batch
    of several sizes (``dispatch``);
  * the runtime itself on two workers (a real ``Controller`` run of a tiny GRPO-shaped probe graph, read
    from its trace): the latency from a node's dependency ending to the node starting (``runtime_gap``),
    the controller's own time per iteration (``runtime_iteration``) and whole nodes as a worker runs
    them (``runtime_generate``, ``runtime_inference``, ``runtime_train``);
  * hashing weights as the weight sync verifies them (``realloc.execute.weights_checksum``, ``digest``);
  * train steps of the one-layer model in one worker process alone and in the ``n`` processes at once
    (``parallel``): how much slower ``n`` busy workers run, other tenants of the cores included;
  * when vLLM is installed (and not with ``--quick``), the vLLM engine serving the one-layer model, once
    (not per round: one start costs 10-20 s on CPU), in a spawned process (``profile_engine``): its start
    (``engine_start``), one generated token after ``batch`` prompts of ``seq`` tokens (``engine_prefill``),
    the seconds per further decode step of ``batch`` rows (``engine_decode``), and loading and verifying
    a weight version (``engine_load``, ``engine_verify``).
Every measurement runs ``rounds`` times, one round after another: a row keeps its median over the rounds,
the runtime probe's samples of every round are kept (the fit takes medians), so a burst of other tenants'
load spoils one round, not the fit (on a shared 2-core VM the same run took 9 ms or 20 ms per node a
minute apart). Rows go to Parquet with columns ``hardware, model, op, batch, seq, group_size, count,
bytes, flops, seconds, threads, cores`` (``count``: parameter tensors of an optimizer row; ``cores``: the
CPU cores this process may run on; the runtime probe's nodes add ``steps, first_pass``), keyed by hardware
and model shape key (``ModelShape.key()``).

The fit of these rows is :mod:`rlflow.schedulers.planner.calibration` (torch-free).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlflow.schedulers.planner.calibration import DECODE_STEPS, hardware_key, host_cores
from rlflow.schedulers.planner.cluster import COLLECTIVES, ClusterSpec
from rlflow.schedulers.planner.cost import forward_flops
from rlflow.schedulers.planner.problem import ModelShape

__all__ = [
    "ENGINE_DECODE_STEPS",
    "append_rows",
    "profile_block",
    "profile_collectives",
    "profile_digest",
    "profile_dispatch",
    "profile_engine",
    "profile_layouts",
    "profile_model_calls",
    "profile_optimizer",
    "profile_runtime",
    "run_profile",
    "worker_threads",
]

# A small default block (a few hundred K params) so a CPU profile takes about a minute.
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
}
WINDOW_S = 0.1  # seconds each measurement runs for at least
ENGINE_DECODE_STEPS = 8  # decode steps timed beyond the first token (engine_decode)
IDLE_S = 0.02  # idle seconds before each cold call (model_cold)


def worker_threads() -> int:
    """Torch threads per runtime worker (``DistConfig.threads``)."""
    from rlflow.schedulers.runtime.distributed.protocol import DistConfig

    return DistConfig().threads


def _time(fn: Callable[[], object], repeats: int, window_s: float = WINDOW_S) -> float:
    """Mean seconds per call of ``fn`` over at least ``repeats`` calls and ``window_s`` seconds, after a
    warm-up call: the sustained rate, which counts the time slices a busy host takes away as a node that
    runs for seconds sees them (the median of a few short calls does not)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - t0 < window_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def _time_cold(fn: Callable[[], object], repeats: int, idle_s: float = IDLE_S) -> float:
    """Mean seconds of ``fn`` called after ``idle_s`` idle seconds each time, as a worker calls a node's
    model after waiting for the command (caches and clocks have cooled; measured ~1.8× a warm call)."""
    fn()
    samples = []
    for _ in range(max(repeats, 10)):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.mean(samples)


def _row(op: str, seconds: float, **fields: Any) -> dict[str, Any]:
    row = {"op": op, "batch": 0, "seq": 0, "group_size": 1, "count": 1, "flops": 0.0, "bytes": 0}
    row.update(fields)
    row["seconds"] = float(seconds)
    return row


def _decode_step(layer: Any, cache: Any, x1: torch.Tensor, p1: torch.Tensor, pe1: Any) -> Callable[[], None]:
    """One decode step against a fixed cache: the cache is reset to its prefilled length each call."""
    keys, values = cache.layers[0].keys, cache.layers[0].values

    def step() -> None:
        cache.layers[0].keys, cache.layers[0].values = keys, values
        layer(x1, position_ids=p1, past_key_values=cache, use_cache=True, position_embeddings=pe1)

    return step


def _one_layer(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "num_hidden_layers": 1}


def profile_block(
    config: dict[str, Any], batch_sizes: Sequence[int], seq_lens: Sequence[int], repeats: int = 2
) -> list[dict[str, Any]]:
    """Forward / backward / decode-step seconds of one ``LlamaDecoderLayer`` (fp32, this process).

    Returns rows with ``op``, ``batch``, ``seq``, ``flops`` (analytic, ``cost.forward_flops`` of one layer)
    and ``bytes`` (decode: weights + KV cache read per step) and ``seconds``.
    """
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**_one_layer(config))
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    rope = LlamaRotaryEmbedding(cfg)
    shape = ModelShape.from_config(_one_layer(config), dtype="float32")
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
                t_fwd = _time(forward, repeats)

            def fwd_bwd(x: torch.Tensor = x) -> None:
                forward(x).sum().backward()

            t_fb = _time(fwd_bwd, repeats)
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
                t_dec = _time(_decode_step(layer, cache, x1, p1, pe1), repeats)
            kv_bytes = 2 * shape.kv_dim * s * b * 4
            dec_flops = 2.0 * b * shape.layer_params + 4.0 * b * s * shape.q_dim
            rows += [
                _row("forward", t_fwd, batch=b, seq=s, flops=fwd_flops),
                _row("backward", max(t_fb - t_fwd, 1e-9), batch=b, seq=s, flops=2 * fwd_flops),
                _row("decode", t_dec, batch=b, seq=s, flops=dec_flops, bytes=layer_bytes + kv_bytes),
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
    from rlflow.dataflow.spec import OptimizerSpec
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import TokenizerInfo, build_model, response_logits
    from rlflow.nodes.rl import label_logprobs
    from rlflow.nodes.train import build_optimizer

    cfg = {"model_type": "llama", **_one_layer(config)}
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
                t_fwd = _time(logprobs, repeats)
            t_fb = _time(lambda: logprobs().mean().backward(), repeats)
            model.zero_grad(set_to_none=True)
            prompt_s = torch.randint(1, vocab, (b, max(1, s)), generator=gen)

            def sample(tokens: int, prompt: torch.Tensor = prompt_s, rng: torch.Generator = gen) -> None:
                generate(model, info, prompt, torch.ones_like(prompt), max_new_tokens=tokens, generator=rng)

            one = _time(partial(sample, 1), repeats)
            more = _time(partial(sample, 1 + DECODE_STEPS), repeats)
            if (b, s) == (sorted(batch_sizes)[len(batch_sizes) // 2], max(seq_lens)):
                rows.append(_row("model_cold", _time_cold(logprobs, repeats), batch=b, seq=s))

                def train_step(logprobs: Callable[[], torch.Tensor] = logprobs) -> None:
                    logprobs().mean().backward()
                    torch.nn.utils.clip_grad_norm_(params, 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)

                rows.append(_row("model_step", _time(train_step, repeats), batch=b, seq=s))
            rows += [
                _row("model_forward", t_fwd, batch=b, seq=s, flops=head * b * n_resp),
                _row("model_backward", max(t_fb - t_fwd, 1e-9), batch=b, seq=s, flops=2 * head * b * n_resp),
                _row("model_decode", max(more - one, 1e-9) / DECODE_STEPS, batch=b, seq=s, flops=head * b),
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

            rows.append(_row("optimizer", _time(step, repeats), count=count, bytes=32 * numel * count))
    return rows


# ---- parallel layouts -------------------------------------------------------------------------------


def _layout_worker(
    rank: int, world: int, config: dict[str, Any], dp: int, tp: int, batch: int, seq: int, repeats: int
) -> list[dict[str, Any]]:
    """On ``dp · tp`` ranks: the one-layer model in the runtime's layout (``apply_layout``; FSDP2 when
    dp > 1), timed as :func:`profile_model_calls` times it (rank 0 returns the rows)."""
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import TokenizerInfo, build_model, response_logits
    from rlflow.nodes.rl import label_logprobs
    from rlflow.schedulers.planner.plans import Layout
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout, dist_clip_grad_norm_
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache

    cfg = {"model_type": "llama", **_one_layer(config)}
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
        t_fb = _time_collective(lambda: logprobs().mean().backward(), repeats)
        rows = [
            _row("fsdp_step", t_fb, **where),
            _row("fsdp_optimizer", _time_collective(step, repeats), count=len(params), **where),
        ]
    else:
        with torch.no_grad():
            t_fwd = _time_collective(logprobs, repeats)
        t_fb = _time_collective(lambda: logprobs().mean().backward(), repeats)
        model.zero_grad(set_to_none=True)
        info = TokenizerInfo(pad_id=0, eos_id=-1)
        prompt_s = torch.randint(1, vocab, (batch, max(1, seq)), generator=gen)

        def sample(tokens: int) -> None:
            generate(model, info, prompt_s, torch.ones_like(prompt_s), max_new_tokens=tokens, generator=gen)

        one = _time_collective(partial(sample, 1), repeats)
        more = _time_collective(partial(sample, 1 + DECODE_STEPS), repeats)
        rows = [
            _row("tp_forward", t_fwd, **where),
            _row("tp_backward", max(t_fb - t_fwd, 1e-9), **where),
            _row("tp_decode", max(more - one, 1e-9) / DECODE_STEPS, **where),
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
    for dp, tp in ((1, degree), (degree, 1)):
        rows += run_group(_layout_worker, degree, (config, dp, tp, batch, seq, repeats), timeout_s=600.0)[0]
    return rows


# ---- collectives ------------------------------------------------------------------------------------


def _time_collective(fn: Callable[[], object], repeats: int, window_s: float = WINDOW_S) -> float:
    """:func:`_time` for a collective: every rank makes the same number of calls (rank 0 decides)."""
    import torch.distributed as dist

    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    first = time.perf_counter() - t0
    more = torch.tensor([math.ceil(max(0.0, window_s - first) / max(first / repeats, 1e-9))])
    dist.broadcast(more, 0)
    for _ in range(int(more.item())):
        fn()
    return (time.perf_counter() - t0) / (repeats + int(more.item()))


def _busy_loop(seconds: float = 0.5, threads: int = 1, config: dict[str, Any] | None = None) -> float:
    """Mean seconds per train step (forward, backward, AdamW) of the one-layer model of ``config``
    (default :data:`DEFAULT_CONFIG`) on 4 rows of 16 tokens and ``threads`` torch threads, run for
    ``seconds`` (the ``parallel`` rows). Node-like work: a matmul loop alone fits in cache and showed
    4 busy processes on 2 cores x2.1 where model steps showed x2.4-3.3."""
    from rlflow.nodes.models import build_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = {"model_type": "llama", **_one_layer(config or DEFAULT_CONFIG)}
        model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(1, int(cfg["vocab_size"]), (4, 16), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            calls += 1
        return (time.perf_counter() - t0) / calls
    finally:
        torch.set_num_threads(before)


def _all_gather(out: torch.Tensor, part: torch.Tensor) -> object:
    import torch.distributed as dist

    # torch >= 2.13 names it all_gather_single (the older name warns on every call)
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, part)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> object:
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, full)


def _collective_worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    repeats: int,
    threads: int,
    out_dir: str,
    config: dict[str, Any] | None = None,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lines = []
        for op in COLLECTIVES:
            for nbytes in sizes:
                numel = max(world, nbytes // 4 // world * world)  # full tensor, divisible by the group
                full = torch.zeros(numel, dtype=torch.float32)
                part = torch.zeros(numel // world, dtype=torch.float32)
                fn: Callable[[], object] = {
                    "all_reduce": partial(dist.all_reduce, full),
                    "all_gather": partial(_all_gather, full, part),
                    "reduce_scatter": partial(_reduce_scatter, part, full),
                    "broadcast": partial(dist.broadcast, full, 0),
                }[op]
                dist.barrier()
                lines.append(f"{op} {numel * 4} {_time_collective(fn, repeats)}")
        dist.barrier()  # then every rank busy at once: the slowdown of `world` busy workers
        per_unit = torch.tensor([_busy_loop(threads=threads, config=config)], dtype=torch.float64)
        dist.all_reduce(per_unit)
        lines.append(f"parallel 0 {float(per_unit) / world}")
        if rank == 0:
            Path(out_dir, f"collectives-{world}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile_collectives(
    group_sizes: Sequence[int],
    sizes_bytes: Sequence[int] = (4096, 64 << 10, 1 << 20, 4 << 20),
    repeats: int = 10,
    threads: int = 1,
    config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Seconds of each gloo collective (``cluster.COLLECTIVES``) among ``n`` local processes for each size
    (bytes of the full tensor), one row per (collective, n, size); and ``parallel`` rows: seconds per
    unit of node-like work (:func:`_busy_loop` of ``config``) in one spawned process alone and in all ``n``
    at once (mean over them), so ``seconds(n) / seconds(1)`` is how much slower ``n`` busy workers run on this
    host, other tenants of its cores included (``ClusterSpec.slowdown``)."""
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # the busy loop alone runs in a spawned worker too: this process's state (allocator, imports)
        # made it slower here than in a worker, i.e. slowdowns below 1
        for n in (1, *sorted({n for n in group_sizes if n >= 2})):
            args = (n, _free_port(), list(sizes_bytes) if n > 1 else [], repeats, threads, tmp, config)
            mp.spawn(_collective_worker, args=args, nprocs=n)
            for line in Path(tmp, f"collectives-{n}.txt").read_text().splitlines():
                op, nbytes, seconds = line.split()
                rows.append(_row(op, float(seconds), group_size=n, bytes=int(nbytes)))
    return rows


# ---- dispatch -----------------------------------------------------------------------------------------


def _echo_worker(address: tuple[str, int], authkey: bytes) -> None:
    """A stand-in worker: answers every ``run`` command with its batch as the outputs, like a node."""
    from multiprocessing.connection import Client

    from rlflow.schedulers.runtime.distributed.protocol import recv, send

    torch.set_num_threads(1)
    conn = Client(address, authkey=authkey)
    try:
        while True:
            msg = recv(conn)
            if msg[0] == "stop":
                return
            _, cmd, _name, _iteration, batch = msg
            payload = {"outputs": batch, "metrics": {}, "tokens": 0, "version": 0, "start": 0.0, "end": 0.0}
            send(conn, ("done", cmd, 0, payload))
    finally:
        conn.close()


def profile_dispatch(
    sizes_bytes: Sequence[int] = (0, 64 << 10, 1 << 20), repeats: int = 20
) -> list[dict[str, Any]]:
    """Seconds of a controller → worker → controller round trip of a ``run`` command carrying a batch of
    ``bytes`` (an int64 tensor; 0: an empty batch) that the worker sends back as its outputs, over the
    runtime's protocol (pickled messages on a ``multiprocessing.connection`` pipe). The controller writes
    its trace once per iteration, not per node: that is in the runtime probe's ``runtime_iteration``."""
    import multiprocessing as mp
    from multiprocessing.connection import Listener

    from rlflow.dataflow.batch import Batch
    from rlflow.schedulers.runtime.distributed.protocol import recv, send

    authkey = os.urandom(16)
    rows: list[dict[str, Any]] = []
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        proc = mp.get_context("spawn").Process(target=_echo_worker, args=(listener.address, authkey))
        proc.start()
        try:
            conn = listener.accept()
            for nbytes in sizes_bytes:
                batch = Batch({"ids": torch.zeros(nbytes // 8, dtype=torch.int64)}) if nbytes else Batch()

                def trip(batch: Batch = batch) -> None:
                    send(conn, ("run", 0, "profile", 0, batch))
                    recv(conn)

                rows.append(_row("dispatch", _time(trip, repeats), bytes=int(nbytes)))
            send(conn, ("stop",))
            conn.close()
        finally:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
    return rows


# ---- the runtime's own costs ------------------------------------------------------------------------


def _probe_graph(config: dict[str, Any], out: Path, iterations: int, tokenizer: Path) -> dict[str, Any]:
    """A GRPO-shaped graph of the one-layer model of ``config`` on two devices: 8 prompts × 2 samples,
    8 new tokens; generation, a reward model and training on device 0, reference log-probs replicated
    on devices 0 and 1 (dp = 2, submitted first while both are free).
    A real run of it measures the runtime (its latencies, its nodes as a worker runs them)."""
    model = {
        "model_type": "llama", **_one_layer(config), "max_position_embeddings": 128,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    seq = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]
    one = {"layout": "d1t1p1m1"}
    return {
        "models": {
            # float32 on every device, as the profile's other probes (its fits price 4-byte weights)
            "actor": {
                "config": model,
                "tokenizer": str(tokenizer),
                "optimizer": {"lr": 1.0e-4},
                "dtype": "float32",
            },
            "ref": {"init_from": "actor", "trainable": False, "dtype": "float32"},
            "rm": {"init_from": "actor", "trainable": False, "head": "score", "dtype": "float32"},
        },
        "data": {
            "generator": {
                "name": "arith",
                "args": {"digits": 2, "train_size": 256, "eval_size": 8, "seed": 0},
            },
            "fields": {"prompt": "prompt"},
            "tokenize": ["prompt"],
            "tokenizer": "actor",
        },
        "nodes": {
            "actor_gen": {
                "model": "actor", "kind": "generate", "function": "generate", "inputs": seq[:2],
                "outputs": ["response_ids", "response_mask", "logprobs"], "batch_size": 8,
                "args": {"n": 2, "max_new_tokens": 8},
            },
            "ref": {
                "model": "ref", "kind": "inference", "function": "logprobs", "inputs": seq,
                "outputs": {"logprobs": "ref_logprobs"}, "batch_size": 8,
            },
            "rm": {"model": "rm", "kind": "inference", "function": "rm_score", "inputs": seq,
                   "outputs": ["scores"], "batch_size": 8},
            "actor_train": {
                "model": "actor", "kind": "train", "function": "grpo_actor",
                "inputs": [*seq, "logprobs", "ref_logprobs", "scores"], "batch_size": 8, "mini_batches": 2,
            },
        },
        "plan": {
            "actor_gen": {"devices": 0, **one}, "ref": {"devices": "0-1", "layout": "d2t1p1m1"},
            "rm": {"devices": 0, **one},
            "actor_train": {"devices": 0, **one},
        },
        "run": {"iterations": iterations, "seed": 0, "output_dir": str(out), "checkpoint_interval": 0,
                "eval_interval": 0, "devices": 2},
    }  # fmt: skip


def profile_runtime(
    config: dict[str, Any] | None = None, iterations: int = 8, warmup: int = 2
) -> list[dict[str, Any]]:
    """The runtime measured by a real run (``Controller`` + ``DistExecutor``, two worker processes) of a
    probe graph of the one-layer model of ``config`` (:func:`_probe_graph`), read from its trace:

      * ``runtime_gap``: per single-device node whose worker last ran one of its dependencies, seconds
        from that dependency's end to the node's start (the reply, the controller's bookkeeping and
        submission, the transfer and run commands): the dispatch the simulator puts before each node;
      * ``runtime_iteration``: per iteration, ``timing_s/iteration`` minus the span from its first node's
        start to its last node's end (the next batch, the source rows, the trace and metrics);
      * ``runtime_skew``: per run of the replicated node, how much later each further rank started than
        the first;
      * ``runtime_generate`` / ``runtime_inference`` / ``runtime_train``: the span of each node on one
        device (``batch`` rows, ``seq`` prompt and ``count`` generated tokens, ``steps`` optimizer
        steps, ``first_pass``, ``model`` the probe model's shape key and ``head``): whole nodes as a
        worker runs them, cooled by the other nodes between them, which ``node_s``, ``decode_s`` and
        ``step_s`` are calibrated on
        (the model-call rows time the same calls hot, in a loop).

    """
    import yaml

    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.tasks.arith_tokenizer import save_tokenizer
    from rlflow.schedulers.planner.problem import problem_from_graph
    from rlflow.schedulers.records.rundir import read_metrics, read_trace
    from rlflow.schedulers.runtime.controller import Controller

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp, "run")
        tokenizer = save_tokenizer(Path(tmp, "tokenizer"))
        graph_file = Path(tmp, "probe.yaml")
        spec = _probe_graph(dict(config or DEFAULT_CONFIG), run_dir, warmup + iterations, tokenizer)
        graph_file.write_text(yaml.safe_dump(spec))
        graph = load_graph(str(graph_file))
        controller = Controller(graph, run_dir=run_dir, progress=False)
        try:
            controller.run()
        finally:
            controller.close()
        trace = [r for r in read_trace(run_dir).to_pylist() if r["iteration"] > warmup]
        metrics = {r["iteration"]: r for r in read_metrics(run_dir).to_pylist()}
        problem = problem_from_graph(graph)  # the prompt length measured on its data
    timed = {n.name: n for n in problem.nodes if len(graph.placement(n.name).devices) == 1}
    rows: list[dict[str, Any]] = []
    for it in sorted({r["iteration"] for r in trace}):
        rows_of: dict[str, list[dict[str, Any]]] = {}
        for r in trace:
            if r["iteration"] == it and r["kind"] == "node":
                rows_of.setdefault(r["node"], []).append(r)
        start = {n: min(r["start_s"] for r in rs) for n, rs in rows_of.items()}
        end = {n: max(r["end_s"] for r in rs) for n, rs in rows_of.items()}
        devices = {n: {r["device"] for r in rs} for n, rs in rows_of.items()}
        for name, rs in rows_of.items():
            if len(rs) > 1:  # a replicated node: how much later each further rank started
                rows.append(
                    _row("runtime_skew", (max(r["start_s"] for r in rs) - start[name]) / (len(rs) - 1))
                )
                continue
            if name in timed:
                node = timed[name]
                shape = problem.models[node.model]
                rows.append(
                    _row(f"runtime_{node.kind}", end[name] - start[name], batch=node.rows,
                         seq=node.prompt_len, count=node.gen_len, steps=node.epochs * node.mini_batches,
                         first_pass=node.first_pass, model=shape.key(), head=shape.head)
                )  # fmt: skip
            # the latency from a dependency's end to this node's start, when the worker went from the one
            # straight to the other (not queued behind another node)
            before = [n for n in rows_of if devices[n] & devices[name] and end[n] <= start[name]]
            last = max(before, key=lambda n: end[n], default=None)
            if last in graph.dependencies(name) and len(rows_of[last]) == 1:
                rows.append(_row("runtime_gap", start[name] - end[last]))
        busy = max(end.values()) - min(start.values())
        rows.append(_row("runtime_iteration", max(0.0, float(metrics[it]["timing_s/iteration"]) - busy)))
    return rows


def profile_digest(nbytes: int = 16 << 20, repeats: int = 3) -> list[dict[str, Any]]:
    """Seconds of ``realloc.execute.weights_checksum`` over ``nbytes`` of float32 weights."""
    from rlflow.schedulers.realloc.execute import weights_checksum

    weights = {"w": torch.zeros(nbytes // 4, dtype=torch.float32)}
    return [_row("digest", _time(lambda: weights_checksum(weights), repeats), bytes=nbytes)]


# ---- the vLLM engine ------------------------------------------------------------------------------


def _engine_rows(
    config: dict[str, Any],
    batch_sizes: Sequence[int],
    seq_lens: Sequence[int],
    repeats: int,
    threads: int,
    rounds: int,
) -> list[dict[str, Any]]:
    """:func:`profile_engine`'s measurements, in the process that calls it (an in-process engine)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.models import build_model, load_tokenizer
    from rlflow.nodes.tasks.arith_tokenizer import save_tokenizer

    torch.set_num_threads(threads)
    steps = ENGINE_DECODE_STEPS
    cfg = {
        "model_type": "llama", **_one_layer(config), "max_position_embeddings": max(seq_lens) + steps + 8,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile").eval()
    shape = ModelShape.from_config(cfg, dtype="float32")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(save_tokenizer(Path(tmp, "tokenizer")))
        t0 = time.perf_counter()
        engine = VllmEngine(
            model, tokenizer, where="rlflow profile (model 'profile')", max_rows=max(batch_sizes), seed=0,
            in_process=True,
        )  # fmt: skip
        rows.append(_row("engine_start", time.perf_counter() - t0))
        try:
            gen = torch.Generator().manual_seed(0)
            # ids the tokenizer knows (vLLM checks prompts against it), past the special tokens
            high = min(len(tokenizer), shape.vocab_size)

            def call(b: int, seq: int, tokens: int) -> None:
                """``b`` prompts of ``seq`` tokens, ``tokens`` generated each, as the node submits them (one
                request per row, sampled, per-token log-probs); the prefix cache emptied first so each
                call computes its prefill as new prompts do."""
                ids = torch.randint(4, high, (b, seq), generator=gen).tolist()
                params = [
                    SamplingParams(n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0,
                                   seed=i, detokenize=False, skip_special_tokens=False)
                    for i in range(b)
                ]  # fmt: skip
                engine.llm.reset_prefix_cache()
                engine.llm.generate([TokensPrompt(prompt_token_ids=r) for r in ids], params, use_tqdm=False)

            def measure(version: int) -> list[dict[str, Any]]:
                out, first = [], {}
                for b in batch_sizes:
                    for seq in seq_lens:
                        first[(b, seq)] = _time(partial(call, b, seq, 1), repeats)
                        out.append(
                            _row("engine_prefill", first[(b, seq)], batch=b, seq=seq, count=1,
                                 flops=forward_flops(shape, b, seq))
                        )  # fmt: skip
                seq = min(seq_lens)
                for b in batch_sizes:
                    more = _time(partial(call, b, seq, 1 + steps), repeats)
                    per_step = max(more - first[(b, seq)], 1e-9) / steps
                    out.append(_row("engine_decode", per_step, batch=b, seq=seq, count=steps))
                stats = engine.sync(model, model="profile", version=version)
                out.append(_row("engine_load", stats.seconds, bytes=stats.bytes))
                return [*out, _row("engine_verify", stats.verify_seconds)]

            engine.sync(model, model="profile", version=1)  # warm-up: the first load costs ~10x more
            rows += _median_rounds([measure(version) for version in range(2, 2 + max(1, rounds))])
        finally:
            engine.close()
    return rows


def profile_engine(
    config: dict[str, Any] | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4),
    seq_lens: Sequence[int] = (32, 64),
    repeats: int = 2,
    threads: int | None = None,
    rounds: int = 3,
) -> list[dict[str, Any]]:
    """The vLLM engine (``rlflow.nodes.engines.vllm_engine.VllmEngine``, in-process, fp32) serving the
    one-layer model of ``config``, started once in a spawned process (vLLM keeps an in-process engine's
    state in its globals and resets torch's threads: this process stays as it was) with ``threads`` torch
    threads (default: a runtime worker's); the calls below are measured ``rounds`` times one after another
    and each row keeps its median (as :func:`run_profile`'s rounds). Rows (seconds):

      * ``engine_start``: starting the engine (writing the weights, vLLM's start, the first probe);
      * ``engine_prefill`` per ``batch`` × ``seq``: one generated token after ``batch`` fresh prompts of
        ``seq`` tokens (``flops``: their forward FLOPs);
      * ``engine_decode`` per ``batch`` (shortest ``seq``): seconds per decode step, from ``count`` =
        :data:`ENGINE_DECODE_STEPS` further tokens;
      * ``engine_load`` / ``engine_verify``: loading a full weight version (``bytes``) and its probe
        (``VllmEngine.sync``), after one unmeasured load.

    Raises:
        NodeError: vLLM is missing or the engine fails to start (the caller checks ``vllm_missing`` first).
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    threads = worker_threads() if threads is None else threads
    args = (dict(config or DEFAULT_CONFIG), list(batch_sizes), list(seq_lens), repeats, threads, rounds)
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_engine_rows, *args).result()


def run_profile(
    cluster: ClusterSpec,
    config: dict[str, Any] | None = None,
    out: str | Path = "profile.parquet",
    batch_sizes: Sequence[int] = (1, 2, 4),
    seq_lens: Sequence[int] = (32, 64),
    group_sizes: Sequence[int] = (2,),
    repeats: int = 2,
    threads: int | None = None,
    rounds: int = 3,
    engine: bool = False,
) -> Path:
    """Profile a block, the model's calls (alone and, with a group size >= 2, in 2-way tensor- and
    FSDP2-parallel layouts, and the runtime's own costs on two workers), the optimizer, collectives, the
    dispatch, hashing and the slowdown of busy workers with ``threads`` torch threads (default: a runtime
    worker's), and with ``engine`` the vLLM engine once (:func:`profile_engine`, first: a broken vLLM
    stops the profile before the rest runs); append rows to ``out`` (Parquet), return its path.

    ``rounds``: the measurements run that many times one after another and each row keeps its median
    seconds, so a burst of other tenants' load spoils one round of a row, not the fit (on a shared
    2-core host single rounds moved fitted overheads by up to 4x between profiles).
    """
    config = dict(config or DEFAULT_CONFIG)
    key = ModelShape.from_config(config).key()
    threads = worker_threads() if threads is None else threads

    def measure() -> list[dict[str, Any]]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rows = profile_block(config, batch_sizes, seq_lens, repeats)
            rows += profile_model_calls(config, batch_sizes, seq_lens, repeats)
            rows += profile_optimizer() + profile_digest()
        finally:
            torch.set_num_threads(before)
        rows += profile_collectives(group_sizes, threads=threads, config=config) + profile_dispatch()
        if any(n >= 2 for n in group_sizes):
            rows += profile_layouts(
                config, sorted(batch_sizes)[len(batch_sizes) // 2], max(seq_lens), repeats
            )
        return rows

    engine_rows = profile_engine(config, batch_sizes, seq_lens, repeats, threads, rounds) if engine else []
    rounds_rows, runtime_rows = [], []
    for _ in range(max(1, rounds)):
        rounds_rows.append(measure())
        if any(n >= 2 for n in group_sizes):  # samples of every round; the fit takes their medians
            runtime_rows += profile_runtime(config)
    rows = _median_rounds(rounds_rows) + runtime_rows + engine_rows
    hw, cores = hardware_key(cluster), host_cores()
    for row in rows:
        row.update(hardware=hw, threads=threads, cores=cores)
        row.setdefault("model", key)
    return append_rows(rows, out)


def append_rows(rows: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Append profile ``rows`` to the Parquet file ``out`` (created if missing); a column only some rows
    have (the probe's ``steps``) is null in the others. Returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for row in rows for k in row))  # from_pylist reads the first row's keys
    table = pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows])
    path = Path(out)
    if path.exists():
        table = pa.concat_tables([pq.read_table(path), table], promote_options="default")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def _median_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of repeated rounds of the same measurements (same rows, same order), each with its
    median seconds over the rounds."""
    return [
        {**same[0], "seconds": statistics.median(r["seconds"] for r in same)}
        for same in zip(*rounds, strict=True)
    ]
