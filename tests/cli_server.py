"""A fork server for the ``rlflow`` command: the docs-commands test (tests/test_readme_commands.py) runs its
fifty-odd commands through it instead of starting a Python process for each.

A fresh ``python -m rlflow.schedulers.cli`` spends 3-8 s of CPU importing torch, transformers and the
command's modules. The server pays that once: it sets the OpenMP wait policy as the ``rlflow`` command does,
imports what the commands import (:func:`_preload`), then listens on a Unix socket. For each request the
client (:func:`call`, the test's ``rlflow`` wrapper) sends its argument list, working directory and
environment, and its stdin/stdout/stderr descriptors; the server forks a child that takes those descriptors,
directory and environment, starts a session of its own (it signals its own process group when it stops
workers), runs the CLI module as ``__main__`` (exactly what ``python -m`` runs), and exits with its status.
The client exits with that status, or 128 + N for a child killed by signal N, and passes SIGINT/SIGTERM on
to the child, as the process it replaces would have received them.

What differs from a fresh process: modules are imported once, so an environment variable a library reads
at import (none of the docs' commands sets one) has the server's value.

Run as ``python tests/cli_server.py SOCKET``; it prints ``listening on SOCKET`` once it accepts requests.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import traceback
from typing import Any

MAX_MESSAGE = 1 << 20  # bytes: a request's JSON (arguments and environment)


def _child(request: dict[str, Any], fds: list[int]) -> int:
    """Become the requested ``rlflow`` process; returns its exit status."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["rlflow", *request["argv"]]
    sys.path[0] = request["cwd"]  # as `python -m` sets it
    import runpy

    try:
        runpy.run_module("rlflow.schedulers.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # the interpreter's own handling of an uncaught error
        traceback.print_exc()
        code = 1
    return code


def _report(conn: socket.socket, pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    try:
        conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
    finally:
        conn.close()


def _preload() -> None:
    """Import what nearly every command imports (the CLI itself imports lazily): the command modules, the
    runtime, torch, and transformers' configuration and model classes for the examples' Llama models
    (``validate`` alone spends ~4 s of CPU reading a model config's class in a fresh process)."""
    import importlib
    import pkgutil

    commands = importlib.import_module("rlflow.schedulers.commands")
    names = [f"{commands.__name__}.{m.name}" for m in pkgutil.iter_modules(commands.__path__)]
    names += ["rlflow.schedulers.cli", "rlflow.schedulers.runtime.controller"]
    names += ["transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama"]
    for name in names:
        importlib.import_module(name)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING["llama"]  # the lookup imports the configuration module


def serve(path: str) -> None:
    """Listen on ``path`` until killed; one forked child per request."""
    from rlflow.schedulers.runtime.threads import set_wait_policy

    set_wait_policy()  # before torch loads OpenMP, as the rlflow command does
    _preload()

    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(16)
    print(f"listening on {path}", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the reader of that line may go away
    while True:
        conn, _ = server.accept()
        message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            code = 1
            try:
                code = _child(json.loads(message), fds)
            finally:
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        threading.Thread(target=_report, args=(conn, pid), daemon=True).start()


def call(path: str, argv: list[str]) -> int:
    """Run ``rlflow ARGV`` in the server at ``path`` with this process's directory, environment and standard
    streams; returns the exit status (128 + N for a child killed by signal N)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(MAX_MESSAGE))["pid"]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    reply = conn.recv(MAX_MESSAGE)
    if not reply:
        raise RuntimeError(f"the rlflow fork server at {path} closed without the status of process {pid}")
    code = int(json.loads(reply)["code"])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    serve(sys.argv[1])
