"""The run directory's lock: at most one live run writes a run directory.

A run holds an exclusive ``flock`` on ``<run_dir>/run.lock`` for its whole life and writes its pid and host
into the file once it holds the lock. The kernel drops the lock when the holding process ends, however it
ends (SIGKILL included), so a dead run leaves no stale lock: a second ``rlflow run`` on the directory (new,
``--overwrite`` or ``--resume``) fails at once with the holder named, and succeeds once the holder is gone.

``flock`` locks an open file description, not a process: the descriptor is opened close-on-exec, so
spawned workers do not inherit it. It is advisory (only rlflow takes it) and reaches other hosts only on
file systems whose kernel client forwards it (Linux NFS emulates it with byte-range locks).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rlflow.dataflow.errors import HostError
from rlflow.schedulers.records.rundir import LOCK_FILE

__all__ = ["LockHolder", "RunDirLock", "lock_holder"]

# `lock_holder` probes with a shared lock held for microseconds; a run that meets it retries this long
# before reporting the directory as held.
_RETRY_S: Final = 1.0


@dataclass(frozen=True)
class LockHolder:
    """The process holding a run directory's lock: ``pid`` and ``host`` (``None`` when not written yet)."""

    pid: int | None
    host: str | None

    def __str__(self) -> str:
        if self.pid is None:
            return "a process that has not written its pid yet"
        return f"pid {self.pid} on host {self.host or '?'}"


class RunDirLock:
    """An exclusive, process-lifetime lock on ``run_dir`` (file ``run.lock`` inside it).

    :meth:`acquire` creates ``run_dir`` if needed; :meth:`release` removes it again when this lock created
    it and nothing but the lock file was written (a run that failed before starting leaves nothing).
    Both are idempotent.
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self._created = False
        self._kept = 0  # > 0 within kept(): release() keeps the lock

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> RunDirLock:
        """Take the lock (no-op when held) and write this process's pid and host into it; returns ``self``.

        Raises:
            HostError: another live process holds the lock (its pid and host named), ``run_dir`` is a file,
                or it cannot be created or written (the OS's reason named).
        """
        if self._fd is not None:
            return self
        deadline = time.monotonic() + _RETRY_S
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise HostError(
                    f"run directory '{self.run_dir}' is in use by a live run ({holder}; lock {self.path}); "
                    "wait for it to end, stop it, or choose another run.output_dir"
                ) from None
            # A run that created the directory removes the lock file when it fails early: the file locked
            # here may have been unlinked between open and flock. Lock the file that is there now.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
        except OSError as e:
            os.close(fd)
            raise HostError(f"run.output_dir '{self.run_dir}': cannot write {self.path}: {e.strerror}") from e
        self._fd = fd
        return self

    def _open(self) -> int:
        """Create ``run_dir`` if needed and open the lock file (created if missing)."""
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise HostError(f"run.output_dir '{self.run_dir}' is a file, not a directory")
        try:
            if not self.run_dir.is_dir():
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._created = True
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            reason = "is not writable" if isinstance(e, PermissionError) else "cannot be used"
            raise HostError(
                f"run.output_dir '{self.run_dir}' {reason}: {e.strerror}: {e.filename or self.path}"
            ) from e

    def release(self) -> None:
        """Drop the lock (no-op when not held); remove the directory if this lock created it and it holds
        nothing else."""
        if self._kept:
            return
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._created and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                self.path.unlink()  # still locked: a waiting run then sees the file gone and retries
                self.run_dir.rmdir()
        except OSError:
            pass  # leftovers are harmless: an empty directory or an unlocked lock file
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def kept(self) -> Iterator[RunDirLock]:
        """Within, :meth:`release` keeps the lock: a supervised run's attempts (each a controller that
        releases the lock when it ends) hold the directory from the first to the last, so that no other run
        takes it between a failure and its restart. Released at the end as usual (``__exit__``)."""
        self._kept += 1
        try:
            yield self
        finally:
            self._kept -= 1

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> LockHolder:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        record = {}
    pid, host = record.get("pid"), record.get("host")
    return LockHolder(pid if isinstance(pid, int) else None, host if isinstance(host, str) else None)


def lock_holder(run_dir: str | os.PathLike[str]) -> LockHolder | None:
    """The live process holding ``run_dir``'s lock, or ``None`` when no process holds it (or the directory
    has no lock file, e.g. one written before locks existed, or it cannot be read)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
