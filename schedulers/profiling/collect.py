"""``rlflow profile``'s whole measurement: every probe of this package, ``rounds`` times with medians
kept, each row stamped with the hardware, model shape key, torch threads and cores, appended to Parquet."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlflow.schedulers.planner.calibration import hardware_key, host_cores
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.profiling.communication import profile_collectives, profile_digest, profile_dispatch
from rlflow.schedulers.profiling.engine import profile_engine
from rlflow.schedulers.profiling.measure import DEFAULT_CONFIG, append_rows, median_rounds, worker_threads
from rlflow.schedulers.profiling.model_calls import (
    profile_block,
    profile_layouts,
    profile_model_calls,
    profile_optimizer,
)
from rlflow.schedulers.profiling.runtime_probe import profile_runtime

__all__ = ["run_profile"]


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
    rows = median_rounds(rounds_rows) + runtime_rows + engine_rows
    hw, cores = hardware_key(cluster), host_cores()
    for row in rows:
        row.update(hardware=hw, threads=threads, cores=cores)
        row.setdefault("model", key)
    return append_rows(rows, out)
