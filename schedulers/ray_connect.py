"""The driver's connection to a Ray cluster, shared by the Ray launcher
(:mod:`rlflow.schedulers.runtime.distributed.ray_launch`) and ``rlflow plan --cluster ray``
(:mod:`rlflow.schedulers.planner.ray_cluster`).

Every failure is one line, within seconds: Ray not installed (:func:`import_ray`), an address where nothing
answers a TCP connection within :data:`CONNECT_TIMEOUT_S` seconds, or an address that answers but is not a
Ray head (Ray's own retries are bounded to the same time).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from types import ModuleType

from rlflow.dataflow.errors import HostError

__all__ = ["CONNECT_TIMEOUT_S", "RAY_MISSING", "connect", "import_ray"]

RAY_MISSING = "Ray is not installed (--launcher ray and --cluster ray need it): pip install 'rlflow[ray]'"
CONNECT_TIMEOUT_S = 5.0  # an address must answer a TCP connection within this


def import_ray() -> ModuleType:
    """The ``ray`` module.

    Raises:
        HostError: Ray is not installed (one line naming the extra to install).
    """
    try:
        import ray
    except ImportError:
        raise HostError(RAY_MISSING) from None
    return ray


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` address; ``None`` for ``auto``/``local`` and ``ray://`` (Ray's)."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HostError(f"--address {address!r}: expected HOST:PORT (a Ray head's GCS address), or 'auto'")
    return host.strip("[]"), int(port)


def connect(address: str | None, local_cpus: int | None = None) -> bool:
    """Connect this process (the driver) to a Ray cluster; ``True`` if this call started the connection.

    ``address``: ``HOST:PORT`` of a running head (``ray start --head`` prints it), ``auto`` (the cluster
    this host joined), or ``None`` (``RAY_ADDRESS`` if set, else a local instance started for this run and
    stopped with it, offering ``local_cpus`` CPUs, default this host's cores: a CPU device is a worker
    process, which may share cores as the embedded launcher's do). Already connected: nothing to do.

    Raises:
        HostError: Ray is not installed, or nothing answers at ``address`` within
            :data:`CONNECT_TIMEOUT_S` seconds, or Ray refused the connection (one line each).
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    target = address or os.environ.get("RAY_ADDRESS") or None
    where = _host_port(target) if target else None
    if where is not None:  # Ray's own client retries for a minute: find a dead address in seconds
        try:
            socket.create_connection(where, timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            reason = e.strerror or type(e).__name__
            if isinstance(e, TimeoutError | socket.timeout):
                reason = f"no answer within {CONNECT_TIMEOUT_S:.0f} s"
            raise HostError(f"--address {target}: no Ray cluster reachable there ({reason})") from None
    # Ray's own retries (~1 s each, 20 by default) bounded to the same seconds, for a port that answers
    # but is not a Ray head; its C++ warnings, one per retry, kept off the terminal.
    env = {"RAY_BACKEND_LOG_LEVEL": "error"}
    if where is not None:
        env["RAY_gcs_server_port_wait_time_s"] = str(int(CONNECT_TIMEOUT_S))
    before = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if before[k] is None})
    local = {} if target else {"num_cpus": max(os.cpu_count() or 1, local_cpus or 0)}
    quiet = _quiet_stderr() if where is not None else contextlib.nullcontext()
    try:
        with quiet:
            ray.init(
                address=target,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=False,
                **local,
            )
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HostError(f"--address {target or 'local'}: cannot connect to Ray: {first}") from None
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
    return True


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send the process's stderr (file descriptor 2: Ray's C++ client logs one warning per connection
    retry there) to /dev/null for the ``with`` block."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
