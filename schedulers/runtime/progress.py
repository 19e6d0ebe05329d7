"""Progress of a run on stderr: a tqdm bar on a terminal, else a line at most every 10 s.

Two times, each named where it shows: the wall-clock rate since the start (``s/it wall``: evaluation and
checkpoints included, what the remaining time is estimated from) and ``s/iter``, the last iteration's own
time (``timing_s/iteration``: evaluation and checkpoints excluded), the number ``rlflow runs`` shows in
its ``s/iter`` column.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["LineProgress", "progress_bar"]


def progress_bar(enabled: bool, start: int, total: int) -> Any:
    """A tqdm bar on a terminal; in a log (stderr not a TTY) a line at most every 10 s and at the end."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return LineProgress(start, total)
    from tqdm import tqdm

    return tqdm(
        total=total, initial=start, desc="rlflow", unit="it", file=sys.stderr, dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
        "[{elapsed}<{remaining}, {rate_inv_fmt} wall incl. eval]{postfix}",
    )  # fmt: skip


class LineProgress:
    """The part of tqdm's interface the run loop uses, printing
    ``rlflow: iteration i/n (R s/it wall, eval and checkpoints included) s/iter=S fields``."""

    def __init__(self, start: int, total: int, every_s: float = 10.0) -> None:
        self.n, self.total, self.every_s = start, total, every_s
        self.t0 = self.last = time.monotonic()
        self.done = 0
        self.fields: dict[str, str] = {}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.done += n

    def set_postfix(self, fields: dict[str, str]) -> None:
        self.fields = dict(fields)
        now = time.monotonic()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            rate = (now - self.t0) / max(1, self.done)
            extra = "".join(f" {k}={v}" for k, v in self.fields.items())
            print(
                f"rlflow: iteration {self.n}/{self.total} ({rate:.3g} s/it wall, eval and checkpoints "
                f"included){extra}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        pass
