"""The sandbox's cgroups: one per execution under this process's own cgroup (its process count, cgroup v1's
CPU time beside it), found from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``; the stale ones of dead
processes removed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from pathlib import Path

__all__ = [
    "ExecutionCgroups",
    "cgroup_cpu_seconds",
    "cpuacct_dir",
    "own_cgroups",
    "pids_cgroup_dirs",
    "remove_stale",
]

_COUNT = itertools.count()  # one numbering per process: two sandboxes (other limits) never share a name


def own_cgroups() -> dict[str, str]:
    """This process's cgroup path per hierarchy (``v2``, or a v1 hierarchy's controllers), from
    ``/proc/self/cgroup``."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        own["v2" if number == "0" else controllers] = path
    return own


def pids_cgroup_dirs() -> list[tuple[str, Path]]:
    """``(version, directory)`` of this process's cgroup in each hierarchy holding a ``pids`` controller
    (v2 first), read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``."""
    own = own_cgroups()
    found: list[tuple[str, Path]] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        root, point = fields[3], fields[4]
        if kind[0] == "cgroup2" and "v2" in own:
            version, path = "v2", own["v2"]
        elif kind[0] == "cgroup" and "pids" in kind[2].split(","):
            version, path = "v1", next((p for c, p in own.items() if "pids" in c.split(",")), "")
        else:
            continue
        rel = os.path.relpath(path, root) if path.startswith(root) else "."
        found.append((version, Path(point) / rel))
    return sorted(found, key=lambda vd: vd[0], reverse=True)


def cpuacct_dir() -> Path | None:
    """This process's cgroup v1 ``cpuacct`` directory, where this process may create a cgroup (a probe)."""
    own = next((p for c, p in own_cgroups().items() if "cpuacct" in c.split(",")), None)
    for line in Path("/proc/self/mountinfo").read_text().splitlines() if own else []:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if kind[0] == "cgroup" and "cpuacct" in kind[2].split(","):
            assert own is not None
            base = Path(fields[4]) / (os.path.relpath(own, fields[3]) if own.startswith(fields[3]) else ".")
            probe = base / f"rlflow-sandbox-{os.getpid()}-probe"
            with contextlib.suppress(OSError):
                probe.mkdir()
                ok = (probe / "cpuacct.usage").exists()
                probe.rmdir()
                if ok:
                    return base
    return None


def cgroup_cpu_seconds(path: Path) -> float:
    """CPU seconds used by every process that was in the cgroup ``path`` (v1 ``cpuacct.usage``, ns; v2
    ``cpu.stat`` ``usage_usec``); 0.0 where neither can be read."""
    with contextlib.suppress(OSError, ValueError):
        if (path / "cpuacct.usage").exists():
            return int((path / "cpuacct.usage").read_text()) / 1e9
        for line in (path / "cpu.stat").read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) / 1e6
    return 0.0


def remove_stale(base: Path) -> int:
    """Remove the empty ``rlflow-sandbox-<pid>-*`` cgroups under ``base`` whose ``<pid>`` is no longer alive
    (left by a trainer killed with SIGKILL, which runs no sweep); ``rmdir`` only, so a cgroup that still holds
    a process stays, and those of live processes are never touched. How many were removed."""
    removed = 0
    for path in base.glob("rlflow-sandbox-*-*"):
        owner = path.name.split("-")[2]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
            continue  # alive (or alive under another user: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            path.rmdir()
            removed += 1
    return removed


class ExecutionCgroups:
    """One pids cgroup per execution under this process's own cgroup, where this process may create one
    (and, cgroup v1, one ``cpuacct`` cgroup beside it to count its CPU time); creating it removes the stale
    cgroups of dead processes (:func:`remove_stale`)."""

    def __init__(self) -> None:
        self.version, self.base = "", Path()
        self.removed_stale = 0
        self.cpu_base: Path | None = None  # where each execution's CPU time is counted (v2: the pids cgroup)
        for version, base in pids_cgroup_dirs():
            probe = base / f"rlflow-sandbox-{os.getpid()}-probe"
            try:
                if version == "v2" and "pids" not in (base / "cgroup.subtree_control").read_text().split():
                    (base / "cgroup.subtree_control").write_text("+pids")
                probe.mkdir()
                ok = (probe / "pids.max").exists()
                probe.rmdir()
            except OSError:
                continue
            if ok:
                self.version, self.base = version, base
                self.cpu_base = base if version == "v2" else cpuacct_dir()
                self.removed_stale = remove_stale(base) + (
                    remove_stale(self.cpu_base) if self.cpu_base not in (None, base) else 0
                )
                return

    @property
    def available(self) -> bool:
        return bool(self.version)

    def create(self, max_pids: int) -> list[Path]:
        """An execution's cgroups: the pids one, then (cgroup v1) its ``cpuacct`` one, if any."""
        name = f"rlflow-sandbox-{os.getpid()}-{next(_COUNT)}"
        path = self.base / name
        path.mkdir()
        try:
            (path / "pids.max").write_text(str(max_pids))
        except OSError:
            path.rmdir()
            raise
        if self.cpu_base is None or self.cpu_base == self.base:
            return [path]
        try:
            (self.cpu_base / name).mkdir()
        except OSError:
            path.rmdir()
            raise
        return [path, self.cpu_base / name]

    @staticmethod
    def sweep(path: Path) -> None:
        """SIGKILL whatever is left in the cgroup, wait for it to empty (at most 5 s), remove it.

        Raises:
            TimeoutError: it did not empty in 5 s.
        """
        deadline = time.monotonic() + 5.0
        while True:
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except FileNotFoundError:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                path.rmdir()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sandbox's cgroup {path} did not empty after SIGKILL")
            time.sleep(0.01)
