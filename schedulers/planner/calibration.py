"""Fit the cost model's rates and overheads to a profile (``rlflow profile``'s Parquet rows,
:mod:`rlflow.schedulers.profiling`); pure and torch-free, for ``rlflow plan`` and ``rlflow run``.

``apply_profile`` turns the rows into the cluster's rates:
  * the matmul curve ``e·x/(x + x½)`` (x = tokens per micro-batch) is fitted by least squares on
    ``1/eff = 1/e + (x½/e)/x``; decode steps give the memory-streaming efficiency (bytes read / seconds /
    peak bandwidth);
  * each collective and group size ``n`` gets a link from the line ``seconds = α + β · bytes`` (Hockney's
    α-β model): latency per ring step ``α / steps`` and bandwidth ``volume / β`` (``cluster.ring_shape``);
    the all-reduce fit at the largest ``n`` is also the intra-host link;
  * the optimizer rows give ``seconds = τ · tensors + bytes / rate`` (least squares): ``step_tensor_s``
    = τ and the optimizer's streaming efficiency = rate / peak memory bandwidth;
  * ``dispatch_s`` is the median ``runtime_gap`` (without the probe: the empty round trip),
    ``dispatch_bandwidth`` = 2 · bytes / the extra seconds of the other round trips (the batch travels
    there and back), ``iteration_s`` the median ``runtime_iteration``; ``digest_bandwidth`` = bytes /
    seconds;
  * a CPU cluster (one whose file sets ``cores_per_host``) takes the measured cores and slowdowns
    ``seconds(n) / seconds(1)`` of the ``parallel`` rows;
  * then each model-call overhead (``call_s``, ``node_s``, ``backward_s``, ``decode_s``, ``step_s``,
    ``tp_module_s``, ``tp_module_backward_s``, ``fsdp_unit_s``, ``dtensor_tensor_s``) is set, in that
    order, so that the cost model with everything fitted so far reproduces the calls it is measured on
    (the median over the grid of the value solving ``prediction = seconds``; predictions are affine in
    it): the part of a call its FLOPs, bytes and collectives do not explain. With the runtime probe's
    rows, ``node_s``, ``decode_s`` and ``step_s`` are then set again on its inference, generate and
    train nodes: what a worker's node costs beyond the same calls timed hot in a loop (its caches cooled
    by the other nodes, the node function's own work);
  * the vLLM engine's rows (``engine_*``, when the profile measured the engine) give
    ``ClusterSpec.engine`` (:class:`~rlflow.schedulers.planner.cluster.EngineRates`) against the cost
    model's roofline of each timed call at the profiled shape (``vllm_cost.py``, "Generation with the vLLM
    engine", engine rates neutral): least squares ``seconds = prefill_call_s + prefill_scale · roofline``
    over ``engine_prefill`` (one generated token after ``batch`` prompts of ``seq`` tokens; a scale that
    comes out <= 0, e.g. from one token count, is taken as 1 and the call cost as the mean rest, a call
    cost < 0 as 0 with the scale fitted through the origin), and ``seconds − roofline = decode_step_s +
    decode_row_s · rows`` over ``engine_decode`` (seconds per further decode step of ``batch`` rows),
    each coefficient at least 0, as the built-in loop's overheads; ``load_bandwidth`` = the median
    bytes / seconds of ``engine_load``, ``verify_s`` and ``start_s`` the medians of ``engine_verify`` and
    ``engine_start``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cluster import (
    COLLECTIVES,
    WORKER_THREADS,
    ClusterSpec,
    EngineRates,
    LinkSpec,
    Overheads,
    ring_shape,
)
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.shapes import ModelShape

__all__ = ["DECODE_STEPS", "apply_profile", "hardware_key", "host_cores"]

DECODE_STEPS = 4  # generated tokens timed beyond the first (model_decode)


def hardware_key(cluster: ClusterSpec) -> str:
    """``cluster name / machine`` — a profile is only applied to the hardware it was measured on."""
    return f"{cluster.name.split('@')[0]}/{platform.machine()}"


def host_cores() -> int:
    """CPU cores this process may run on (its affinity set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx, b


def _fit_plane(xs: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a·x₁ + b·x₂`` (no intercept); returns (a, b) (0, 0 when singular)."""
    s11 = sum(x1 * x1 for x1, _ in xs)
    s12 = sum(x1 * x2 for x1, x2 in xs)
    s22 = sum(x2 * x2 for _, x2 in xs)
    t1 = sum(x1 * y for (x1, _), y in zip(xs, ys, strict=True))
    t2 = sum(x2 * y for (_, x2), y in zip(xs, ys, strict=True))
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return 0.0, 0.0
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def apply_profile(
    cluster: ClusterSpec, path: str | Path, model: str | None = None, threads: int | None = None
) -> ClusterSpec:
    """``cluster`` with rates, collective links, overheads (and cores) fitted from a profile of its hardware.

    Args:
        model: use only that model shape's block rows (collectives and dispatch rows are shape-free).
        threads: use only rows measured with this many torch threads (default: a runtime worker's,
            ``WORKER_THREADS``; rows
            written before the column existed count as measured so).

    Raises:
        PlanError: the file cannot be read, is not a profile, or has no rows for this hardware (and model,
            and thread count).
    """
    import pyarrow.parquet as pq

    threads = WORKER_THREADS if threads is None else threads
    try:
        rows = pq.read_table(str(path)).to_pylist()
    except (OSError, ValueError) as err:  # missing, unreadable, or not Parquet (pyarrow's ArrowInvalid)
        why = "no such file" if isinstance(err, FileNotFoundError) else str(err)
        raise PlanError(f"{path}: cannot read a profile ({why}); write one with `rlflow profile`") from None
    if rows and not {"hardware", "op", "seconds"} <= rows[0].keys():
        raise PlanError(
            f"{path}: not a profile (no hardware/op/seconds columns); write one with `rlflow profile`"
        )
    for i, row in enumerate(rows):
        _check_row(row, f"{path}: row {i}")
    hw = hardware_key(cluster)
    shape_free = {*COLLECTIVES, "allreduce", "dispatch", "digest", "parallel", *_RUNTIME_OPS}
    rows = [
        {**r, "op": "all_reduce" if r["op"] == "allreduce" else r["op"]}
        for r in rows
        if r["hardware"] == hw
        and (model is None or r.get("model") == model or r["op"] in shape_free)
        and r.get("threads") in (None, threads)
    ]
    if not rows:
        raise PlanError(
            f"{path}: no profile rows for hardware {hw!r}" + (f" and model {model!r}" if model else "")
            + f" measured with {threads} thread(s) per worker"
        )  # fmt: skip
    try:
        fitted = _fit(cluster, rows)
    except PlanError as err:  # e.g. a model shape key that names no shape
        raise PlanError(f"{path}: {err}") from None
    _check_fitted(fitted, path)
    return fitted


# Columns a profile row of each op needs (beyond hardware, op, seconds), as `rlflow profile` writes them.
_SHAPE_COLUMNS = ("model", "batch", "seq", "group_size")
_NEEDS: dict[str, tuple[str, ...]] = {
    "forward": ("batch", "seq", "flops"),
    "backward": ("batch", "seq", "flops"),
    "decode": ("bytes",),
    **{op: ("group_size", "bytes") for op in (*COLLECTIVES, "allreduce")},
    "optimizer": ("bytes",),
    "dispatch": ("bytes",),
    "digest": ("bytes",),
    "parallel": ("group_size",),
    **{op: _SHAPE_COLUMNS for op in ("model_forward", "model_cold", "model_backward", "model_decode",
                                     "model_step", "tp_forward", "tp_backward", "tp_decode", "fsdp_step",
                                     "fsdp_optimizer")},
    **{f"runtime_{k}": ("model", "batch", "seq", "count") for k in ("generate", "inference", "train")},
    "engine_prefill": ("model", "batch", "seq"),
    "engine_decode": ("model", "batch", "seq", "count"),
    "engine_load": ("bytes",),
}  # fmt: skip
# Whole numbers >= 0 (>= 1 where the row's op needs them: the fits divide by them); the rest numbers >= 0.
_COUNTS = ("batch", "seq", "group_size", "count", "cores", "steps", "threads")
_NUMBERS = ("seconds", "flops", "bytes")


def _check_row(row: dict[str, Any], where: str) -> None:
    """Refuse a profile row the fits cannot use: ``hardware``/``op`` (and ``model``) not text, a number
    column that is not a finite number >= 0 (counts and sizes whole numbers, >= 1 where the op needs them),
    or a column its op needs (:data:`_NEEDS`) missing.

    Raises:
        PlanError: naming ``where`` (file and row) and the column.
    """
    for key in ("hardware", "op"):
        if not isinstance(row.get(key), str):
            raise PlanError(f"{where}: column {key}: expected text, got {_show(row.get(key))}")
    for key in _NEEDS.get(row["op"], ()):
        if row.get(key) is None:
            raise PlanError(f"{where}: column {key}: missing, which op {row['op']!r} needs")
    if row.get("model") is not None and not isinstance(row["model"], str):
        raise PlanError(f"{where}: column model: expected a shape key, got {_show(row['model'])}")
    needs = _NEEDS.get(row["op"], ())
    for key in (*_NUMBERS, *_COUNTS):
        value = row.get(key)
        if value is None and key != "seconds":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise PlanError(f"{where}: column {key}: expected a finite number, got {_show(value)}")
        least = 1 if key in needs and key in _COUNTS else 0  # the fits divide by the sizes an op needs
        if value < least or (key in _COUNTS and value != int(value)):
            need = f"a whole number >= {least}" if key in _COUNTS else "a number >= 0"
            raise PlanError(f"{where}: column {key}: expected {need}, got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fitted(cluster: ClusterSpec, path: str | Path) -> None:
    """Refuse a fit that left a rate or fixed cost non-finite or out of range (rows far outside what a
    machine measures: e.g. 1e300 FLOPs in a microsecond)."""
    eff, ov = cluster.efficiency, cluster.overheads
    engine = cluster.engine or EngineRates()
    checks = {
        **{f"efficiency.{f.name}": getattr(eff, f.name) for f in fields(eff)},
        **{f"engine.{k}": v for k, v in vars(engine).items() if not isinstance(v, bool)},
        **{f"intra_host.{k}": getattr(cluster.intra_host, k) for k in ("bandwidth", "latency")},
        **{
            f"overheads.{f.name}": getattr(ov, f.name) for f in fields(ov) if not f.name.endswith("bandwidth")
        },
        **{f"slowdowns.{n}": v for n, v in cluster.slowdowns.items()},
    }
    for key, value in checks.items():
        if key == "engine.load_bandwidth" and value == math.inf:
            continue  # not measured
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise PlanError(
                f"{path}: the profile's rows give {key} = {value!r}; measure again with `rlflow profile`"
            )
    for key in ("matmul", "memory", "link"):
        if getattr(eff, key) <= 0:
            raise PlanError(
                f"{path}: the profile's rows give efficiency.{key} = 0; measure again with `rlflow profile`"
            )


def _fit(cluster: ClusterSpec, rows: list[dict[str, Any]]) -> ClusterSpec:
    """The fits of :func:`apply_profile` on checked rows of this hardware."""
    peak, bw = cluster.device.peak_flops, cluster.device.memory_bandwidth
    eff = cluster.efficiency
    mm = [r for r in rows if r["op"] in ("forward", "backward") and r["seconds"] > 0]
    if len({r["batch"] * r["seq"] for r in mm}) >= 2:
        inv_x = [1.0 / (r["batch"] * r["seq"]) for r in mm]
        inv_e = [r["seconds"] * peak / r["flops"] for r in mm]
        a, b = _fit_line(inv_x, inv_e)
        if a > 0:
            eff = replace(eff, matmul=1.0 / a, half_tokens=max(0.0, b / a))
    dec = [r["bytes"] / r["seconds"] / bw for r in rows if r["op"] == "decode" and r["seconds"] > 0]
    if dec:
        eff = replace(eff, memory=statistics.median(dec))
    link, collectives = cluster.intra_host, dict(cluster.collectives)
    for op in COLLECTIVES:
        for n in sorted({r["group_size"] for r in rows if r["op"] == op}):
            pts = [r for r in rows if r["op"] == op and r["group_size"] == n]
            if len({r["bytes"] for r in pts}) < 2:
                continue
            alpha, beta = _fit_line([float(r["bytes"]) for r in pts], [r["seconds"] for r in pts])
            if beta <= 0:
                continue
            steps, volume = ring_shape(op, n)
            collectives[(op, n)] = LinkSpec(bandwidth=volume / beta, latency=max(0.0, alpha) / steps)
            if op == "all_reduce":
                link = collectives[(op, n)]
    if link is not cluster.intra_host:
        eff = replace(eff, link=1.0)
    opt = [r for r in rows if r["op"] == "optimizer" and r.get("count")]
    ov: dict[str, float] = {}
    if len({(r["count"], r["bytes"]) for r in opt}) >= 2:  # seconds = τ · tensors + bytes / rate
        points = [(float(r["count"]), float(r["bytes"])) for r in opt]
        tau, per_byte = _fit_plane(points, [r["seconds"] for r in opt])
        ov["step_tensor_s"] = max(0.0, tau)
        if per_byte > 0:
            eff = replace(eff, optimizer=1.0 / per_byte / bw)
    empty = [r["seconds"] for r in rows if r["op"] == "dispatch" and r["bytes"] == 0]
    full = [r for r in rows if r["op"] == "dispatch" and r["bytes"] > 0]
    if empty:  # seconds = α + 2 · bytes / bandwidth, α the empty round trip
        ov["dispatch_s"] = statistics.median(empty)
        extra = sum(r["seconds"] - ov["dispatch_s"] for r in full)
        if full and extra > 0:
            ov["dispatch_bandwidth"] = 2.0 * sum(r["bytes"] for r in full) / extra
    gaps = [r["seconds"] for r in rows if r["op"] == "runtime_gap"]
    if gaps:  # the real runtime's node-to-node latency replaces the bare round trip
        ov["dispatch_s"] = statistics.median(gaps)
    between = [r["seconds"] for r in rows if r["op"] == "runtime_iteration"]
    if between:
        ov["iteration_s"] = statistics.median(between)
    skew = [r["seconds"] for r in rows if r["op"] == "runtime_skew"]
    if skew:
        ov["rank_skew_s"] = statistics.median(skew)
    digest = [r["bytes"] / r["seconds"] for r in rows if r["op"] == "digest" and r["seconds"] > 0]
    if digest:
        ov["digest_bandwidth"] = statistics.median(digest)
    cpu = cluster.cores_per_host is not None
    cores = [int(r["cores"]) for r in rows if r.get("cores")]
    alone = [
        r["seconds"] for r in rows if r["op"] == "parallel" and r["group_size"] == 1 and r["seconds"] > 0
    ]
    slowdowns = {  # at least 1: fewer busy workers than cores (the alone run drifted slower) cost nothing
        int(r["group_size"]): max(1.0, r["seconds"] / alone[0])
        for r in rows
        if r["op"] == "parallel" and r["group_size"] > 1 and alone
    }
    fitted = replace(
        cluster,
        efficiency=eff,
        intra_host=link,
        collectives=collectives,
        overheads=replace(cluster.overheads, **ov),
        cores_per_host=max(cores) if cores and cpu else cluster.cores_per_host,
        slowdowns=slowdowns if cpu else cluster.slowdowns,
    )
    # The model calls' fixed costs, each set so that the cost model reproduces the calls measured.
    for name, ops in _CALIBRATED:
        fitted = _calibrate(fitted, name, [(r, _PREDICT[r["op"]]) for r in rows if r["op"] in ops])
    # a profile without the engine's rows keeps the cluster file's published rates
    return replace(fitted, engine=_fit_engine(fitted, rows) or fitted.engine)


def _engine_roofline(cluster: ClusterSpec, row: dict[str, Any], generated: int) -> float:
    """The cost model's seconds of a vLLM engine generating ``generated`` tokens after ``batch`` prompts of
    ``seq`` tokens on the one-layer fp32 model of the row's shape key, the engine's rates neutral (scale
    1, fixed costs 0) and no overheads: what the FLOPs and bytes of the call explain."""
    shape = replace(ModelShape.from_key(row["model"], dtype_bytes=4), num_hidden_layers=1)
    node = PlanNode("gen", "m", "generate", int(row["batch"]), int(row["seq"]), generated, engine="vllm")
    bare = replace(
        cluster, hosts=1, devices_per_host=1, overheads=Overheads(), engine=EngineRates(measured=True)
    )
    return CostModel(PlanProblem({"m": shape}, (node,)), bare).node_cost(node, NodePlacement((0,))).time_s


def _fit_engine(cluster: ClusterSpec, rows: list[dict[str, Any]]) -> EngineRates | None:
    """:class:`EngineRates` from the ``engine_*`` rows (module docstring); None without ``engine_prefill``
    rows (the profile skipped the engine)."""
    prefill = [r for r in rows if r["op"] == "engine_prefill"]
    if not prefill:
        return None
    roof = [_engine_roofline(cluster, r, 1) for r in prefill]
    seconds = [r["seconds"] for r in prefill]
    call_s, scale = _fit_line(roof, seconds)
    if scale <= 0:  # no evidence on the compute (one size, or noise): the roofline's, the rest per call
        call_s, scale = statistics.mean(s - x for s, x in zip(seconds, roof, strict=True)), 1.0
    elif call_s < 0:  # through the origin
        call_s, scale = 0.0, sum(s * x for s, x in zip(seconds, roof, strict=True)) / sum(x * x for x in roof)
    decode = [r for r in rows if r["op"] == "engine_decode"]
    step_s = row_s = 0.0
    if decode:
        steps = [int(r["count"]) for r in decode]
        extra = [
            r["seconds"] - (_engine_roofline(cluster, r, 1 + k) - _engine_roofline(cluster, r, 1)) / k
            for r, k in zip(decode, steps, strict=True)
        ]
        step_s, row_s = _fit_line([float(r["batch"]) for r in decode], extra)
    loads = [r["bytes"] / r["seconds"] for r in rows if r["op"] == "engine_load" and r["seconds"] > 0]
    verify = [r["seconds"] for r in rows if r["op"] == "engine_verify"]
    start = [r["seconds"] for r in rows if r["op"] == "engine_start"]
    return EngineRates(
        prefill_call_s=max(0.0, call_s),
        prefill_scale=scale,
        decode_step_s=max(0.0, step_s),
        decode_row_s=max(0.0, row_s),
        load_bandwidth=statistics.median(loads) if loads else math.inf,
        verify_s=statistics.median(verify) if verify else 0.0,
        start_s=statistics.median(start) if start else 0.0,
        measured=True,
    )


def _probe(cluster: ClusterSpec, row: dict[str, Any]) -> tuple[CostModel, int]:
    """A cost model of the profiled call ``row``: the one-layer fp32 model of its shape key; nodes ``fwd``
    (inference), ``train`` (one step of one micro-batch), ``gen1`` / ``genk`` (generating 1 and
    ``1 + DECODE_STEPS`` tokens) of ``batch`` rows per rank of ``seq`` tokens; its group size. Calls timed
    in a loop are warm: ``node_s`` only counts for ``model_cold``."""
    n = int(row["group_size"])
    shape = replace(ModelShape.from_key(row["model"], dtype_bytes=4), num_hidden_layers=1)
    b, s = int(row["batch"]), int(row["seq"])
    ranks = n if row["op"].startswith("fsdp") else 1
    nodes = (
        PlanNode("fwd", "m", "inference", b, s // 2, s - s // 2),
        PlanNode("train", "m", "train", b * ranks, s // 2, s - s // 2),
        PlanNode("gen1", "m", "generate", b, s, 1),
        PlanNode("genk", "m", "generate", b, s, 1 + DECODE_STEPS),
    )
    warm = cluster.overheads if row["op"] == "model_cold" else replace(cluster.overheads, node_s=0.0)
    host = replace(cluster, hosts=1, devices_per_host=max(cluster.devices_per_host, n), overheads=warm)
    return CostModel(PlanProblem({"m": shape}, nodes), host), n


def _node_s(cluster: ClusterSpec, row: dict[str, Any], node: str, part: str = "time_s") -> float:
    cost, n = _probe(cluster, row)
    fsdp = row["op"].startswith("fsdp")
    layout = Layout(n if fsdp else 1, 1 if fsdp else n, 1, 1)
    return float(getattr(cost.node_cost(node, NodePlacement(tuple(range(n)), layout)), part))


def _backward_s(cluster: ClusterSpec, row: dict[str, Any]) -> float:
    train = _node_s(cluster, row, "train") - _node_s(cluster, row, "train", "optimizer_s")
    return train - _node_s(cluster, row, "fwd")


def _decode_s(cluster: ClusterSpec, row: dict[str, Any]) -> float:
    return (_node_s(cluster, row, "genk") - _node_s(cluster, row, "gen1")) / DECODE_STEPS


def _runtime_node_s(cluster: ClusterSpec, row: dict[str, Any]) -> float:
    """The cost model's seconds of a probe run's node (``runtime_*`` rows of :func:`profile_runtime`) on
    one device."""
    shape = ModelShape.from_key(row["model"], head=str(row.get("head") or "lm"), dtype_bytes=4)
    steps = int(row.get("steps") or 1)
    kind = row["op"].removeprefix("runtime_")
    node = PlanNode(
        "probe", "m", kind, int(row["batch"]), int(row["seq"]), int(row["count"]),
        mini_batches=steps, first_pass=float(row.get("first_pass") or 0.0),
    )  # fmt: skip
    cost = CostModel(PlanProblem({"m": shape}, (node,)), cluster)
    return cost.node_cost(node, NodePlacement((0,), Layout())).time_s


_RUNTIME_OPS = (
    "runtime_gap",
    "runtime_iteration",
    "runtime_skew",
    "runtime_generate",
    "runtime_inference",
    "runtime_train",
)
# Profiled op -> the cost model's prediction of it (seconds).
_PREDICT: dict[str, Callable[[ClusterSpec, dict[str, Any]], float]] = {
    "model_forward": partial(_node_s, node="fwd"),
    "model_cold": partial(_node_s, node="fwd"),
    "model_backward": _backward_s,
    "model_decode": _decode_s,
    "model_step": partial(_node_s, node="train"),
    "tp_forward": partial(_node_s, node="fwd"),
    "tp_backward": _backward_s,
    "tp_decode": _decode_s,
    "fsdp_step": lambda c, r: _node_s(c, r, "train") - _node_s(c, r, "train", "optimizer_s"),
    "fsdp_optimizer": partial(_node_s, node="train", part="optimizer_s"),
    "runtime_generate": _runtime_node_s,
    "runtime_inference": _runtime_node_s,
    "runtime_train": _runtime_node_s,
}
# Overhead -> the profiled ops it is calibrated on, in order (later ones build on earlier ones).
_CALIBRATED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("call_s", ("model_forward",)),
    ("node_s", ("model_cold",)),
    ("backward_s", ("model_backward",)),
    ("decode_s", ("model_decode",)),
    ("step_s", ("model_step",)),
    ("tp_module_s", ("tp_forward", "tp_decode")),
    ("tp_module_backward_s", ("tp_backward",)),
    ("fsdp_unit_s", ("fsdp_step",)),
    ("dtensor_tensor_s", ("fsdp_optimizer",)),
    # whole nodes of the runtime probe, when measured, replace the hot-loop values: a worker's nodes
    # run cooled by the others between them
    ("node_s", ("runtime_inference",)),
    ("decode_s", ("runtime_generate",)),
    ("step_s", ("runtime_train",)),
)


def _calibrate(
    cluster: ClusterSpec,
    name: str,
    measured: list[tuple[dict[str, Any], Callable[[ClusterSpec, dict[str, Any]], float]]],
) -> ClusterSpec:
    """``cluster`` with overhead ``name`` set to the median over ``measured`` (row, prediction) of the value
    that makes the (affine) prediction equal the row's seconds, at least 0; unchanged without rows."""
    values = []
    for row, predict in measured:
        base = predict(replace(cluster, overheads=replace(cluster.overheads, **{name: 0.0})), row)
        unit = predict(replace(cluster, overheads=replace(cluster.overheads, **{name: 1.0})), row) - base
        if unit > 0:
            values.append((row["seconds"] - base) / unit)
    if not values:
        return cluster
    return replace(
        cluster, overheads=replace(cluster.overheads, **{name: max(0.0, statistics.median(values))})
    )
