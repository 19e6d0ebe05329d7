"""How many torch/OpenMP threads each rlflow process uses, and how its waiting threads wait: one rule for the
single-process runtime, the embedded launcher's workers, :func:`run_group`'s processes, Ray actors and
torchrun workers.

The rule (:func:`choose_threads`): a process gets the cores of its host divided among the rlflow
processes placed on that host, ``max(1, cores // processes)``; ``cores`` is what the process may run on
(``os.sched_getaffinity``: a ``taskset``/cgroup limit counts) or, on a Ray node, the node's CPUs. A user
override wins: ``RLFLOW_NUM_THREADS``, else ``OMP_NUM_THREADS`` (its first, outer-level value), each a
whole number ≥ 1, in the environment of the process that starts the run.

Waiting: OpenMP threads that wait at the end of a parallel region spin (libgomp's default: ~300k spins
before sleeping). Next to another busy process a spinning thread takes the core the thread it waits for
needs, and each region lasts until the preempted thread runs again: a 2-thread SFT run went from 0.061 s
to 0.452 s per iteration beside one busy process on 2 cores (``bench/bench_contention.py``). rlflow's
processes therefore run with ``OMP_WAIT_POLICY=PASSIVE`` (waiting threads sleep) unless the user set
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (:func:`wait_settings`). libgomp reads both when it is loaded,
that is at ``import torch``: the ``rlflow`` command sets them before it imports torch
(:func:`set_wait_policy`); a spawned worker or Ray actor gets them in its environment at start
(:func:`worker_env`); a program that imports torch itself and then runs the runtime must set them before
its ``import torch`` (the printed line says when they are missing).

Every choice is printed once as a line on stderr, ``rlflow: threads: ...`` (:meth:`ThreadChoice.line`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from rlflow.dataflow.errors import HostError

__all__ = [
    "OVERRIDES",
    "ThreadChoice",
    "allowed_cores",
    "apply_threads",
    "choose_threads",
    "environment",
    "per_host_threads",
    "set_wait_policy",
    "wait_settings",
    "worker_env",
]

# the user's overrides, the first one set wins
OVERRIDES = ("RLFLOW_NUM_THREADS", "OMP_NUM_THREADS")
# what rlflow sets for waiting OpenMP threads when the user set neither of WAIT_KEYS
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class ThreadChoice:
    """The torch/OpenMP threads of one process and where the number came from.

    Attributes:
        threads: intra-op threads (``torch.set_num_threads``, ``OMP_NUM_THREADS``).
        cores: cores of the host the process may use (affinity, or a Ray node's CPUs).
        processes: rlflow processes placed on that host, this one included.
        source: ``"cores"`` (``cores // processes``) or the override's variable name.
    """

    threads: int
    cores: int
    processes: int
    source: str

    def line(
        self, who: str = "per process", where: str = "this host", wait: Mapping[str, str] | None = None
    ) -> str:
        """The printed line, e.g. ``rlflow: threads: 2 per process (2 cores allowed / 1 process on this
        host), OMP_WAIT_POLICY=PASSIVE``; ``wait``: the wait settings the processes start with (default:
        this process's, ``os.environ``)."""
        plural = "es" if self.processes > 1 else ""
        share = f"{self.cores} cores allowed / {self.processes} process{plural} on {where}"
        why = share if self.source == "cores" else f"{self.source}={self.threads}; {share}"
        if self.threads * self.processes > self.cores:
            why += f": {self.threads * self.processes} threads on {self.cores} cores, oversubscribed"
        env = os.environ if wait is None else wait
        waits = ", ".join(f"{k}={env[k]}" for k in WAIT_KEYS if k in env) or (
            "OMP_WAIT_POLICY unset: waiting threads spin (set OMP_WAIT_POLICY=PASSIVE before importing torch)"
        )
        return f"rlflow: threads: {self.threads} {who} ({why}), {waits}"


def parse_override(name: str, text: str) -> int:
    """The thread count an override variable holds (``OMP_NUM_THREADS``: its first, outer-level value).

    Raises:
        HostError: not a whole number ≥ 1 (names the variable and its value).
    """
    first = text.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise HostError(f"{name}={text!r}: expected a whole number of threads >= 1")
    return int(first)


def choose_threads(
    cores: int, processes: int, env: Mapping[str, str], fixed: int | None = None
) -> ThreadChoice:
    """The threads of one of ``processes`` rlflow processes sharing a host of ``cores`` cores.

    ``max(1, cores // processes)``, unless ``env`` sets ``RLFLOW_NUM_THREADS`` or else ``OMP_NUM_THREADS``
    (an empty value counts as unset), and ``fixed`` (a program's ``DistConfig.threads``) before both.
    Examples: 2 cores, 1 process -> 2; 2 cores, 2 workers -> 1; 16 cores, 3 workers -> 5; 2 cores,
    4 workers -> 1 (oversubscribed, said by :meth:`ThreadChoice.line`).

    Raises:
        HostError: an override that is not a whole number ≥ 1.
        ValueError: ``cores`` or ``processes`` < 1 (a caller's bug).
    """
    if cores < 1 or processes < 1:
        raise ValueError(f"cores ({cores}) and processes ({processes}) must be >= 1")
    if fixed is not None:
        return ThreadChoice(fixed, cores, processes, "DistConfig.threads")
    for name in OVERRIDES:
        text = env.get(name, "").strip()
        if text:
            return ThreadChoice(parse_override(name, text), cores, processes, name)
    return ThreadChoice(max(1, cores // processes), cores, processes, "cores")


def per_host_threads(
    hosts: Sequence[str], cores: Mapping[str, int], env: Mapping[str, str], fixed: int | None = None
) -> list[ThreadChoice]:
    """Rank -> its choice, for ranks placed on ``hosts`` (rank -> host id) with ``cores`` (host id -> its
    cores): the processes of a host are the ranks placed on it.

    Raises:
        HostError: an invalid override (:func:`choose_threads`).
        KeyError: a host without a core count.
    """
    count = Counter(hosts)
    return [choose_threads(cores[h], count[h], env, fixed) for h in hosts]


def allowed_cores() -> int:
    """Cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def wait_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The wait settings a process should start with: the user's ``OMP_WAIT_POLICY``/``GOMP_SPINCOUNT``
    where ``env`` sets either, else ``OMP_WAIT_POLICY=PASSIVE``."""
    mine = {k: env[k] for k in WAIT_KEYS if k in env}
    return mine or dict(PASSIVE)


def worker_env(choice: ThreadChoice, env: Mapping[str, str]) -> dict[str, str]:
    """Environment variables for a worker process started with ``choice``: ``OMP_NUM_THREADS`` and the
    wait settings of ``env`` (:func:`wait_settings`), read by libgomp when the worker imports torch."""
    return {"OMP_NUM_THREADS": str(choice.threads), **wait_settings(env)}


def set_wait_policy() -> None:
    """Set this process's wait settings (:func:`wait_settings` of ``os.environ``); call before ``import
    torch`` (the ``rlflow`` command does), later it changes nothing for this process's OpenMP threads."""
    os.environ.update(wait_settings(os.environ))


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (processes spawned in it inherit them), then restore
    each variable (removed again where it was unset)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def apply_threads(choice: ThreadChoice, line: str | None = None) -> None:
    """Use ``choice.threads`` intra-op threads in this process (``torch.set_num_threads``) and print
    ``line`` (default :meth:`ThreadChoice.line`) on stderr; ``line=""`` prints nothing."""
    import torch

    torch.set_num_threads(choice.threads)
    text = choice.line() if line is None else line
    if text:
        print(text, file=sys.stderr, flush=True)
