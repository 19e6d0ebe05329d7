"""List run directories with their status (running, finished, failed, resumable; "restarted 2×" after a
run's supervised restarts) and last metrics.

`rlflow runs [DIR]` (default ./runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.records.run_status import restart_count, with_restarts
from rlflow.schedulers.records.rundir import (
    LOCK_FILE,
    STATUS_FILE,
    latest_checkpoint,
    read_metrics,
    read_status,
)
from rlflow.schedulers.records.runlock import lock_holder

# Shown when logged, in this order (column title, metric name).
SUMMARY: Final[tuple[tuple[str, str], ...]] = (
    ("reward", "critic/score/mean"),
    ("kl", "actor/kl"),
    ("ppo_kl", "actor/ppo_kl"),
    ("tok/s", "perf/throughput"),
    ("s/iter", "timing_s/iteration"),
    ("val_acc", "val/accuracy"),
)
MAX_DEPTH: Final = 4
SECONDS_NOTE: Final = (
    "s/iter: the last iteration's own time (timing_s/iteration), evaluation and checkpoints excluded; "
    "the progress line's s/iter= is the same number"
)


@dataclass(frozen=True)
class RunInfo:
    """What `rlflow runs` shows about one run directory."""

    path: str
    status: str  # running | finished | failed | resumable | unknown
    iteration: int | None
    updated: str | None
    checkpoint: int | None
    last_metrics: dict[str, float]
    restarts: int = 0  # supervised restarts status.json records (docs/operations.md)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 probes without signalling)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def run_status(status: dict[str, Any] | None, has_checkpoint: bool, locked: bool | None = None) -> str:
    """Derived status: ``running`` needs a live run, told by the run directory's lock (``locked``), or
    where the directory has no lock file (``None``: written before locks) by a live pid; a dead,
    interrupted or failed run with a checkpoint is ``resumable``, without one ``failed``."""
    if status is None:
        return "unknown"
    state = status.get("state")
    if state == "finished":
        return "finished"
    if state == "running":
        pid = status.get("pid")
        if locked if locked is not None else isinstance(pid, int) and pid_alive(pid):
            return "running"
    elif state not in ("failed", "interrupted"):
        return "unknown"
    return "resumable" if has_checkpoint else "failed"


def _locked(run_dir: Path) -> bool | None:
    """Whether a live run holds ``run_dir``'s lock; ``None`` when it has no lock file. Unlike a pid, a
    lock cannot outlive its run nor belong to a recycled pid."""
    if not (run_dir / LOCK_FILE).is_file():
        return None
    return lock_holder(run_dir) is not None


def find_runs(root: Path) -> list[Path]:
    """Directories holding ``status.json`` under ``root`` (``root`` itself included), not looking
    inside a run directory nor deeper than :data:`MAX_DEPTH` levels."""
    found: list[Path] = []

    def walk(directory: Path, depth: int) -> None:
        if (directory / STATUS_FILE).is_file():
            found.append(directory)
            return
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found


def describe(run_dir: Path) -> RunInfo:
    status = read_status(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    metrics = read_metrics(run_dir)
    last: dict[str, float] = {}
    if metrics.num_rows:
        for _, name in SUMMARY:
            if name in metrics.column_names:
                values = [v for v in metrics.column(name).to_pylist() if v is not None and math.isfinite(v)]
                if values:
                    last[name] = float(values[-1])
    iteration = status.get("iteration") if status else None
    return RunInfo(
        path=str(run_dir),
        status=run_status(status, checkpoint is not None, _locked(run_dir)),
        iteration=iteration if isinstance(iteration, int) else None,
        updated=str(status["updated"]) if status and "updated" in status else None,
        checkpoint=checkpoint[0] if checkpoint else None,
        last_metrics=last,
        restarts=restart_count(status),
    )


def format_table(infos: list[RunInfo]) -> str:
    """The runs as a text table with the ``SUMMARY`` metrics any logged (and what ``s/iter`` means)."""
    shown = [(title, name) for title, name in SUMMARY if any(name in i.last_metrics for i in infos)]
    header = ["RUN", "STATUS", "ITER", "CKPT", "UPDATED", *(t for t, _ in shown)]
    rows = [header]
    for info in infos:
        rows.append(
            [
                info.path,
                with_restarts(info.status, info.restarts),
                "" if info.iteration is None else str(info.iteration),
                "" if info.checkpoint is None else str(info.checkpoint),
                info.updated or "",
                *(f"{info.last_metrics[n]:.4g}" if n in info.last_metrics else "" for _, n in shown),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
    if any(name == "timing_s/iteration" for _, name in shown):
        table += "\n" + SECONDS_NOTE
    return table


DEFAULT_DIR = "runs"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", nargs="?", default=DEFAULT_DIR, metavar="DIR", help="where to look (default ./runs)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per run")


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir() and root.exists():
        raise DataError(f"runs directory {str(root)!r} is not a directory")
    if not root.is_dir() and args.dir != DEFAULT_DIR:  # a directory the user named: likely a typo
        raise DataError(f"runs directory {str(root)!r} does not exist")
    if not root.is_dir():
        print(f"no runs yet: {root}/ does not exist (`rlflow run` writes its runs there)")
        return 0
    infos = [describe(p) for p in find_runs(root)]
    if args.json:
        for info in infos:
            print(json.dumps(asdict(info)))
    elif not infos:
        print(f"no run directories under {root}")
    else:
        print(format_table(infos))
    return 0
