"""The ``rlflow`` command line.

Subcommands come from :data:`COMMANDS` (subcommand -> module path). Each module exposes
``configure(parser: argparse.ArgumentParser) -> None`` and ``run(args: argparse.Namespace) -> int`` and is
imported only when its subcommand runs (or for ``rlflow --help``). A user mistake (:class:`RlflowError`)
prints ``rlflow <command>: error: <message>`` to stderr (one such line per mistake where the checks before
a run found several: :class:`~rlflow.dataflow.errors.GraphMistakes`; ``rlflow validate`` prints its
mistakes in the same format) and exits with status 2, and so does an ``OSError``
no check foresaw, with the OS's reason and the file (``rlflow <command>: error: <reason>: <file>``; without a
file, the errno's name and where ``--debug`` points); ``--debug`` (before or after the command) or
``RLFLOW_DEBUG=1`` adds the traceback. A
:class:`~rlflow.dataflow.graph.GraphWarning` prints ``rlflow: warning: <message>`` (other warnings as Python
shows them; library use keeps Python's warning display).

Usage: ``rlflow COMMAND ...`` or ``python -m rlflow.schedulers.cli COMMAND ...``.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TextIO

from rlflow.dataflow.errors import GraphMistakes, RlflowError
from rlflow.schedulers.runtime.threads import set_wait_policy

__all__ = ["COMMANDS", "STUCK_THREADS_GRACE_S", "build_parser", "entry", "error_line", "main"]

# One line per subcommand: name -> module exposing configure(parser) and run(args).
COMMANDS: dict[str, str] = {
    "run": "rlflow.schedulers.commands.run",
    "validate": "rlflow.schedulers.commands.validate",
    "show": "rlflow.schedulers.commands.show",
    "functions": "rlflow.schedulers.commands.functions",
    "dashboard": "rlflow.schedulers.commands.dashboard",
    "runs": "rlflow.schedulers.commands.runs",
    "plan": "rlflow.schedulers.commands.plan",
    "profile": "rlflow.schedulers.commands.profile",
    "export": "rlflow.schedulers.commands.export",
}

# Status 2 for every error the user or the host causes: the checks' HostError (a full disk at a checkpoint,
# a port in use) already exit 2, so an OSError they did not foresee gets the same status.
EXIT_USER_ERROR = 2
DEBUG_HELP = "show the traceback of an error (also: environment variable RLFLOW_DEBUG=1)"


def _summary(module: ModuleType) -> str:
    doc = (module.__doc__ or "").strip()
    return doc.splitlines()[0].replace("``", "") if doc else ""  # a terminal shows no reST markup


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser; the subcommands named in ``commands`` (default: all) are fully configured,
    the others only listed."""
    parser = argparse.ArgumentParser(
        prog="rlflow",
        description="rlflow: declarative dataflow-graph engine for RLHF and RL post-training of LMs.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = set(COMMANDS) if commands is None else set(commands)
    for name, path in COMMANDS.items():
        if name not in wanted:
            sub.add_parser(name, help=f"see 'rlflow {name} --help'")
            continue
        if commands is None:  # the full listing (rlflow --help): one broken command must not hide the rest
            try:
                module = importlib.import_module(path)
            except Exception as e:
                sub.add_parser(name, help=f"(unavailable: {type(e).__name__}: {e})")
                continue
        else:
            module = importlib.import_module(path)
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(
            name,
            help=_summary(module),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.configure(p)
        # SUPPRESS: absent after the command, it keeps the value given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        p.set_defaults(_run=module.run)
    return parser


def _show_graph_warnings_plainly() -> None:
    """Show rlflow's own named warnings (:class:`~rlflow.dataflow.graph.GraphWarning`, a tracker's, ...: a
    category defined in an ``rlflow.`` module) as ``rlflow: warning: <message>`` on stderr, without Python's
    file:line and source line; other warnings are shown as before."""
    python_show = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if category.__module__.startswith("rlflow."):
            print(f"rlflow: warning: {message}", file=sys.stderr if file is None else file)
        else:
            python_show(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``rlflow`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Sets OpenMP's wait policy in ``os.environ`` first, before any command imports torch
    (:func:`~rlflow.schedulers.runtime.threads.set_wait_policy`: ``OMP_WAIT_POLICY=PASSIVE`` unless the user
    set it or ``GOMP_SPINCOUNT``)."""
    set_wait_policy()
    with warnings.catch_warnings():  # restores warnings.showwarning (and the filters) on return
        _show_graph_warnings_plainly()
        return _main(argv)


STUCK_THREADS_GRACE_S = 5.0
"""Seconds :func:`entry` waits, once the command is done, for threads that would keep the process alive."""


def entry() -> None:
    """The ``rlflow`` command (console script, ``python -m rlflow.schedulers.cli``): :func:`main`, then exit
    with its status. Threads still running then (an abandoned iteration's: a reward service that never
    finishes its reply, a sandbox pool waiting out its executions) get :data:`STUCK_THREADS_GRACE_S` seconds;
    past that the process exits at once, naming them, as interpreter shutdown would wait for them forever.
    """
    code = main()
    deadline = time.monotonic() + STUCK_THREADS_GRACE_S
    for t in _running_threads():
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = _running_threads()
    if stuck:
        names = ", ".join(sorted(t.name for t in stuck)[:3])
        print(
            f"rlflow: {len(stuck)} thread(s) still running after {STUCK_THREADS_GRACE_S:g} s ({names}): "
            "exiting without waiting for them",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _running_threads() -> list[threading.Thread]:
    """Non-daemon threads but this one that are alive (interpreter shutdown joins them)."""
    me = threading.current_thread()
    return [t for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser([chosen] if chosen in COMMANDS else None)
    args, extra = parser.parse_known_args(args_list)
    # Dotted overrides may follow options (`rlflow run g.yaml --resume run.iterations=5`).
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra
        ):
            args.overrides.extend(extra)
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    run = getattr(args, "_run", None)
    if run is None:
        parser.error(f"command '{args.command}' is unavailable")
    debug = args.debug or os.environ.get("RLFLOW_DEBUG", "") not in ("", "0")
    try:
        return int(run(args))
    except RlflowError as e:
        _error(args.command, e.messages if isinstance(e, GraphMistakes) else str(e), debug)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"rlflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `rlflow runs --json | head`: the reader left; no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # what the OS refused (a path, a permission, disk space) that no check foresaw
        _error(args.command, _os_error_message(e, debug), debug)
        return EXIT_USER_ERROR


def _os_error_message(e: OSError, debug: bool) -> str:
    """``<reason>: <file>[: <file2>]``; without a file (a full disk reported by a write on an open file) the
    errno's name and, unless ``debug`` shows it, a pointer to the traceback that says where."""
    reason = e.strerror or str(e) or type(e).__name__
    where = ": ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    if where:
        return f"{reason}: {where}"
    code = errno.errorcode.get(e.errno, "") if isinstance(e.errno, int) else ""
    detail = f"{code}, " if code else ""
    return f"{reason} ({detail}the OS named no file)" + ("" if debug else "; --debug shows where")


def _error(command: str, message: str | Sequence[str], debug: bool) -> None:
    """Print ``rlflow <command>: error: <message>`` (one such line per message of several: every mistake
    of a :class:`~rlflow.dataflow.errors.GraphMistakes`), after the traceback being handled (and its notes:
    a failed worker's own traceback) when ``debug``; without it, a pointer to ``--debug`` where a worker's
    traceback was left out."""
    messages = [message] if isinstance(message, str) else list(message)
    if debug:
        traceback.print_exc()
    elif getattr(sys.exc_info()[1], "__notes__", None):  # a failed worker's traceback (pool.worker_error)
        messages[-1] += " (--debug shows the worker's traceback)"
    for line in messages:
        print(error_line(command, line), file=sys.stderr)


def error_line(command: str, message: str) -> str:
    """The line every ``rlflow`` command reports a mistake with: ``rlflow <command>: error: <message>``
    (``rlflow validate`` prints each mistake of each file so, as the CLI prints an error that stopped a
    command)."""
    return f"rlflow {command}: error: {message}"


if __name__ == "__main__":
    entry()
