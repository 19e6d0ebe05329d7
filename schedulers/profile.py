"""``rlflow profile``: measure this machine for one model shape and fit the cost model's efficiencies.

Measured (seconds, median of ``repeats`` after one warm-up):
  * forward, backward and one decode step of one transformer block (``transformers``'
    ``LlamaDecoderLayer`` built from the model's config) over a grid of batch sizes × sequence lengths;
  * an AdamW step over the block's parameters;
  * gloo all-reduce among ``n`` worker processes (``torch.multiprocessing.spawn``) for several sizes.
Rows go to Parquet with columns ``hardware, model, op, batch, seq, group_size, bytes, flops, seconds``
(keyed by hardware and model shape key, ``ModelShape.key()``).

``apply_profile`` turns the rows into the cluster file's efficiencies: the matmul curve
``e·x/(x + x½)`` (x = tokens per micro-batch) is fitted by least squares on ``1/eff = 1/e + (x½/e)/x``;
decode steps give the memory-streaming efficiency (bytes read / seconds / peak bandwidth); all-reduce
times give link bandwidth and latency from the ring model ``2(n−1)/n · bytes/bw + 2(n−1) · latency``.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dataflow.errors import PlanError
from schedulers.cluster import ClusterSpec, Efficiency, LinkSpec
from schedulers.cost import forward_flops
from schedulers.problem import ModelShape

__all__ = ["apply_profile", "hardware_key", "profile_block", "profile_collectives", "run_profile"]

# A small default block (a few hundred K params) so a CPU profile takes seconds.
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
}


def hardware_key(cluster: ClusterSpec) -> str:
    """``cluster name / machine`` — a profile is only applied to the hardware it was measured on."""
    return f"{cluster.name.split('@')[0]}/{platform.machine()}"


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


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

    cfg = LlamaConfig(**{**config, "num_hidden_layers": 1})
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    rope = LlamaRotaryEmbedding(cfg)
    shape = ModelShape.from_config({**config, "num_hidden_layers": 1}, dtype="float32")
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
            dec_flops = 2.0 * b * shape.layer_params + 4.0 * b * s * shape.hidden_size
            rows += [
                {"op": "forward", "batch": b, "seq": s, "flops": fwd_flops, "bytes": 0, "seconds": t_fwd},
                {"op": "backward", "batch": b, "seq": s, "flops": 2 * fwd_flops, "bytes": 0,
                 "seconds": max(t_fb - t_fwd, 1e-9)},
                {"op": "decode", "batch": b, "seq": s, "flops": dec_flops, "bytes": layer_bytes + kv_bytes,
                 "seconds": t_dec},
            ]  # fmt: skip
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-4)
    for p in layer.parameters():
        p.grad = torch.randn_like(p)
    t_opt = _time(opt.step, repeats)
    rows.append(
        {"op": "optimizer", "batch": 0, "seq": 0, "flops": 0.0, "bytes": shape.layer_params * 4 * 4 * 2,
         "seconds": t_opt}
    )  # fmt: skip
    return rows


def _collective_worker(
    rank: int, world: int, port: int, sizes: list[int], repeats: int, out_dir: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lines = []
        for nbytes in sizes:
            tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
            dist.barrier()
            seconds = _time(partial(dist.all_reduce, tensor), repeats)
            lines.append(f"{nbytes} {seconds}")
        if rank == 0:
            Path(out_dir, f"allreduce-{world}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile_collectives(
    group_sizes: Sequence[int], sizes_bytes: Sequence[int] = (4096, 1 << 20, 4 << 20), repeats: int = 3
) -> list[dict[str, Any]]:
    """Seconds of a gloo all-reduce among ``n`` local processes for each size (one row per (n, size))."""
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in group_sizes:
            if n < 2:
                continue
            mp.spawn(_collective_worker, args=(n, _free_port(), list(sizes_bytes), repeats, tmp), nprocs=n)
            for line in Path(tmp, f"allreduce-{n}.txt").read_text().splitlines():
                nbytes, seconds = line.split()
                rows.append(
                    {"op": "allreduce", "batch": 0, "seq": 0, "group_size": n, "flops": 0.0,
                     "bytes": int(nbytes), "seconds": float(seconds)}
                )  # fmt: skip
    return rows


def run_profile(
    cluster: ClusterSpec,
    config: dict[str, Any] | None = None,
    out: str | Path = "profile.parquet",
    batch_sizes: Sequence[int] = (1, 2, 4),
    seq_lens: Sequence[int] = (32, 64),
    group_sizes: Sequence[int] = (2,),
    repeats: int = 2,
) -> Path:
    """Profile a block, the optimizer and collectives; append rows to ``out`` (Parquet); return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    config = dict(config or DEFAULT_CONFIG)
    key = ModelShape.from_config(config).key()
    rows = profile_block(config, batch_sizes, seq_lens, repeats) + profile_collectives(group_sizes)
    hw = hardware_key(cluster)
    for row in rows:
        row.setdefault("group_size", 1)
        row["hardware"] = hw
        row["model"] = key
    table = pa.Table.from_pylist(rows)
    path = Path(out)
    if path.exists():
        old = pq.read_table(path)
        table = pa.concat_tables([old, table.select(old.column_names)])
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx, b


def apply_profile(cluster: ClusterSpec, path: str | Path, model: str | None = None) -> ClusterSpec:
    """``cluster`` with efficiencies (and the intra-host link) fitted from a profile of its hardware.

    Raises:
        PlanError: the file has no rows for this hardware (and model, when given).
    """
    import pyarrow.parquet as pq

    rows = pq.read_table(str(path)).to_pylist()
    hw = hardware_key(cluster)
    rows = [
        r
        for r in rows
        if r["hardware"] == hw and (model is None or r["model"] == model or r["op"] == "allreduce")
    ]
    if not rows:
        raise PlanError(
            f"{path}: no profile rows for hardware {hw!r}" + (f" and model {model!r}" if model else "")
        )
    peak, bw = cluster.device.peak_flops, cluster.device.memory_bandwidth
    eff = cluster.efficiency
    mm = [r for r in rows if r["op"] in ("forward", "backward") and r["seconds"] > 0]
    if len({r["batch"] * r["seq"] for r in mm}) >= 2:
        inv_x = [1.0 / (r["batch"] * r["seq"]) for r in mm]
        inv_e = [r["seconds"] * peak / r["flops"] for r in mm]
        a, b = _fit_line(inv_x, inv_e)
        if a > 0:
            eff = replace(eff, matmul=min(1.0, 1.0 / a), half_tokens=max(0.0, b / a))
    dec = [r["bytes"] / r["seconds"] / bw for r in rows if r["op"] == "decode" and r["seconds"] > 0]
    if dec:
        eff = replace(eff, memory=min(1.0, statistics.median(dec)))
    link = cluster.intra_host
    ar = [r for r in rows if r["op"] == "allreduce"]
    if len({r["bytes"] for r in ar}) >= 2:
        xs = [2.0 * (r["group_size"] - 1) / r["group_size"] * r["bytes"] for r in ar]
        lat, inv_bw = _fit_line(xs, [r["seconds"] for r in ar])
        n = max(r["group_size"] for r in ar)
        if inv_bw > 0:
            link = LinkSpec(bandwidth=1.0 / inv_bw, latency=max(0.0, lat / (2 * (n - 1))))
            eff = replace(eff, link=1.0)
    return replace(cluster, efficiency=Efficiency(**eff.__dict__), intra_host=link)
