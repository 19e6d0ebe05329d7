"""The controller: the DAG is the training loop.

Each iteration the controller draws the data set's next batch of prompts, then walks the graph: a node
is submitted to the executor as soon as the nodes it depends on within the iteration (data edges, and the
order edges that make every call of a model read the weights of the right version) have finished, so
nodes on disjoint meshes run at the same time. It hands each node its input keys (repeating per-prompt
keys ``n`` times for a node whose rows are samples), stores the node's output keys, and drops a key once
its last consumer has been submitted. ``timing_s/<node>`` is the node's span on its workers.
With the distributed executor the store holds references to rows kept on the workers (metadata: rows,
shapes, per-row token counts), never the bulk tensors, which move between workers.
It records metrics and a trace per iteration, evaluates on the held-out split with greedy decoding
(:mod:`rlflow.schedulers.runtime.evaluation`), and writes checkpoints atomically
(:mod:`rlflow.schedulers.runtime.checkpoints`). It knows nothing of the algorithm: PPO, GRPO, DPO, ... are
only graphs.

Iterations are numbered from 1; metrics of iteration ``k`` are logged at ``k``; the evaluation before any
training is logged at iteration 0; checkpoint ``iter-00000k`` holds the state after ``k`` iterations.
"""

from __future__ import annotations

import contextlib
import random
import re
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

import torch

from rlflow.dataflow.context import fitted_splits
from rlflow.dataflow.data import PromptStream
from rlflow.dataflow.errors import DataError, GraphError, HostError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.checks import launch_mistakes
from rlflow.schedulers.records.checkpoint_check import set_aside_broken
from rlflow.schedulers.records.rundir import RunRecorder, latest_checkpoint, remove_run_dir
from rlflow.schedulers.records.runlock import RunDirLock
from rlflow.schedulers.records.trackers import Trackers, check_trackers
from rlflow.schedulers.runtime.asynchronous import AsyncLoop
from rlflow.schedulers.runtime.checkpoints import load_checkpoint, save_checkpoint
from rlflow.schedulers.runtime.choose_executor import make_executor
from rlflow.schedulers.runtime.evaluation import EvalConfig, evaluate, recorded_evals, truncation
from rlflow.schedulers.runtime.executor import Executor
from rlflow.schedulers.runtime.progress import progress_bar
from rlflow.schedulers.runtime.refill import Rounds
from rlflow.schedulers.runtime.version_schedule import staleness_of
from rlflow.schedulers.runtime.walk import Tally, close_iteration, walk

if TYPE_CHECKING:
    from rlflow.schedulers.runtime.restarts import Restart

__all__ = [
    "DEFAULT_STOP_TIMEOUT_S",
    "STOP_SIGNALS",
    "Controller",
    "EvalConfig",
    "RunAbandoned",
    "RunResult",
    "resume_hint",
    "start_checkpoint",
]

# Signals that stop a run gracefully: Ctrl-C, and what Slurm, Kubernetes and a closed terminal send.
STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Slurm's KillWait and Kubernetes' terminationGracePeriodSeconds default to 30 s before SIGKILL: finishing
# the iteration in flight may take 20 of them, leaving 10 for the checkpoint.
DEFAULT_STOP_TIMEOUT_S: Final = 20.0


@dataclass
class RunResult:
    """What :meth:`Controller.run` returns: the last iteration done, its metrics and the eval history
    (iteration -> ``val/*`` metrics; a resumed run's earlier evaluations read back from its metrics)."""

    iteration: int
    metrics: dict[str, float]
    evals: dict[int, dict[str, float]]
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped it (interrupted); None otherwise


class RunAbandoned(BaseException):
    """A stop signal abandoned the iteration in flight: it ran past the stop timeout, or a second signal
    came. The run directory keeps its previous checkpoint; ``signum`` is the signal that stopped the run.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no node's ``except Exception`` swallows it.
    """

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def start_checkpoint(run_dir: Path, *, resume: bool, overwrite: bool) -> tuple[int, Path | None]:
    """Where a run in ``run_dir`` starts: ``(iteration, checkpoint)``, ``(0, None)`` for a new run.

    With ``resume``, broken checkpoints newer than the newest sound one are set aside with a named warning
    (:func:`~rlflow.schedulers.records.checkpoint_check.set_aside_broken`).

    Raises:
        GraphError: ``resume`` and ``overwrite`` together, ``resume`` without a checkpoint, or a run
            directory holding checkpoints with neither.
    """
    if resume and overwrite:
        raise GraphError("--overwrite and --resume contradict each other")
    if resume:  # a broken newest checkpoint: set aside, named, and the newest sound one resumed
        set_aside_broken(run_dir)
    found = latest_checkpoint(run_dir)
    if resume:
        if found is None:
            if not run_dir.exists():
                raise GraphError(f"--resume: run directory '{run_dir}' does not exist; run without --resume")
            raise GraphError(
                f"--resume: no checkpoint in run directory '{run_dir}'; start it again with --overwrite"
            )
        return found
    if not overwrite and found is not None:
        raise GraphError(
            f"run directory '{run_dir}' already holds checkpoints; pass --resume to continue it, "
            "--overwrite to start it again, or choose another run.output_dir"
        )
    return 0, None


class Controller:
    """Runs ``graph`` for ``run.iterations`` iterations on an executor, writing the run directory.

    Args:
        graph: the validated graph.
        run_dir: the run directory (default ``run.output_dir``).
        resume: continue from the latest checkpoint in ``run_dir`` (error if there is none).
        overwrite: delete an existing run directory, once models and data have loaded (refused for a
            directory holding anything a run does not write).
        progress: show progress on stderr (a bar on a terminal, else a line at most every 10 s).
        live_metrics: an optional :class:`rlflow.schedulers.records.telemetry.LiveMetrics` to update each
            iteration.
        predicted_s: the planner's predicted seconds per node, recorded beside measured times in the trace.
        lock: the run directory's lock, already held by the caller (``rlflow run`` takes it before
            planning); default: taken here. Held until :meth:`run` returns or :meth:`close`.
        stop_timeout_s: after SIGTERM or SIGHUP, the seconds the iteration in flight has to finish before
            it is abandoned (:class:`RunAbandoned`).
        executor_config: :class:`~rlflow.schedulers.runtime.distributed.protocol.DistConfig` fields for a
            multi-device plan's executor (e.g. ``ray_address``; :func:`make_executor`).
        on_eval: called with ``(iteration, val/* metrics)`` right after each evaluation, before the
            iteration's metrics are logged (``rlflow run`` prints it, so a run that crashes later still
            showed it).
        restart: this controller is a supervised restart (:mod:`rlflow.schedulers.runtime.restarts`): it
            resumes from the newest sound checkpoint, or starts again at iteration 0 in the same directory
            when there is none, dropping the records after it; ``restart`` joins ``status.json``'s
            ``restarts`` and the first iteration's metrics get ``faults/restarts`` (the run's count) and
            ``faults/iterations_lost``. Not with ``resume`` or ``overwrite``.

    Raises:
        HostError: a live run holds the run directory, or it is a file or not writable.
        DataError, ModelError, GraphError, PlanError: before any training, for bad data, models or plans.
    """

    def __init__(
        self,
        graph: Graph,
        run_dir: str | Path | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = False,
        live_metrics: Any = None,
        predicted_s: dict[str, float] | None = None,
        lock: RunDirLock | None = None,
        stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
        executor_config: dict[str, Any] | None = None,
        on_eval: Callable[[int, dict[str, float]], None] | None = None,
        restart: Restart | None = None,
    ) -> None:
        self.graph = graph
        self.restart = restart
        self.on_eval = on_eval
        self.executor_config = dict(executor_config or {})
        self.stop_timeout_s = stop_timeout_s
        self.predicted_s = dict(predicted_s or {})
        self.spec_run = graph.spec.run
        self.run_dir = Path(run_dir or self.spec_run.output_dir)
        self.progress = progress
        self.live = live_metrics
        self.order = graph.execution_order()
        self.dependencies = {name: graph.dependencies(name) for name in self.order}
        if resume and overwrite:
            raise GraphError("--overwrite and --resume contradict each other")
        self.lock = lock if lock is not None else RunDirLock(self.run_dir)
        assert self.lock.run_dir.resolve() == self.run_dir.resolve(), "the lock is on another directory"
        self.lock.acquire()  # before reading or deleting anything in the run directory
        try:
            self._open(resume=resume, overwrite=overwrite)
        except BaseException:  # e.g. Ctrl-C after the workers started: none is left running
            executor = self.__dict__.get("executor")
            try:
                if executor is not None:
                    executor.close(force=True)
                if self.restart is not None and "start_iteration" in self.__dict__:  # its status said running
                    with contextlib.suppress(Exception):  # the error being raised matters more
                        RunRecorder(self.run_dir).write_status("failed", self.start_iteration)
            finally:
                self.lock.release()
            raise

    def _open(self, *, resume: bool, overwrite: bool) -> None:
        """Build the executor, data and recorder (the rest of ``__init__``, under the lock)."""
        graph = self.graph
        check_trackers(graph.spec)  # run.trackers: known names, their libraries installed
        self._check_launch()  # before any worker process starts
        if self.restart is not None:  # the newest sound checkpoint (broken ones already set aside), or none
            assert not (resume or overwrite), "a restart neither resumes by hand nor overwrites"
            self.start_iteration, checkpoint = latest_checkpoint(self.run_dir) or (0, None)
            # recorded before any worker starts: a restart whose start-up fails still counts, and the status
            # says where the run stands (the next restart's iterations lost count from there)
            early = RunRecorder(self.run_dir)
            early.restarts.append(self.restart.record())
            early.write_status("running", self.start_iteration)
        else:
            self.start_iteration, checkpoint = start_checkpoint(
                self.run_dir, resume=resume, overwrite=overwrite
            )
        self._seed_everything(self.spec_run.seed)
        # One process for the trivial plan; worker processes (per-node meshes and layouts) otherwise.
        self.executor: Executor[Any] = make_executor(graph, checkpoint_dir=checkpoint, **self.executor_config)
        train_rows, eval_rows = fitted_splits(graph, self.executor.data_tokenizer)
        self.stream = PromptStream(
            train_rows,
            seed=self.spec_run.seed,
            shuffle=graph.spec.data.shuffle,
            tokenizer=self.executor.data_tokenizer,
            tokenize=graph.spec.data.tokenize,
            max_prompt_tokens=truncation(graph),
        )
        self.eval_rows = eval_rows
        self.eval = EvalConfig.from_graph(graph)
        # the graph validator guarantees one prompt count per iteration for every node
        self.prompts_per_iteration = graph.prompts(self.order[0])
        if self.prompts_per_iteration > len(self.stream):
            raise DataError(
                f"data: {self.prompts_per_iteration} prompts per iteration but the training split has only "
                f"{len(self.stream)} rows"
            )
        inflight = None
        if checkpoint is not None:
            inflight = load_checkpoint(checkpoint, graph, self.executor, self.stream)
        if overwrite:
            try:
                remove_run_dir(self.run_dir)
            except ValueError as e:
                raise GraphError(f"--overwrite: {e}") from None
        self.recorder = RunRecorder(self.run_dir)
        if graph.spec.run.trackers:  # started and closed with the run's status, sent its metrics
            self.recorder.sink = Trackers(graph.spec, self.recorder)
        if checkpoint is not None or self.restart is not None:
            self.recorder.drop_after(self.start_iteration)
        # what the first iteration's metrics say of the restart this run is (none: empty)
        self._restart_metrics: dict[str, float] = {}
        if self.restart is not None:  # already in the status's restarts (recorded above)
            self._restart_metrics = {
                "faults/restarts": float(len(self.recorder.restarts)),
                "faults/iterations_lost": float(self.restart.iterations_lost),
            }
        self.recorder.write_text("graph.yaml", graph.to_yaml())
        # η >= 1 on a generate node (or batches generated ahead in the checkpoint, which must match it):
        # the asynchronous schedule; else run_iteration, as always
        self.loop: AsyncLoop | None = None
        # a filter's rounds (with staleness the asynchronous loop runs them as each iteration's stage)
        self.rounds = Rounds(self) if graph.filter is not None else None
        if staleness_of(graph) or (inflight and inflight.get("iterations")):
            self.loop = AsyncLoop(self, self.start_iteration, inflight)
        self._stop_signal: int | None = None  # the first stop signal received
        self._abandoned: RunAbandoned | None = None  # raised by a stop signal's handler
        self._finishing = False  # the iteration in flight is done; its records are being written

    # -- setup ----------------------------------------------------------------------------------------
    def _check_launch(self) -> None:
        """Run every node function's pre-launch check and the run-level checks before any worker starts or
        anything is written (:func:`rlflow.nodes.checks.launch_mistakes`: rewards, tools, environments).

        Raises:
            GraphError: the first mistake (file, key and a "did you mean").
        """
        mistakes = launch_mistakes(self.graph)
        if mistakes:
            raise GraphError(mistakes[0])

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    # -- one iteration --------------------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> dict[str, float]:
        """Run every node once on the next batch; returns the iteration's metrics.

        A node is submitted as soon as every node it depends on within the iteration has finished, so
        nodes on disjoint meshes run at the same time; nodes sharing devices run in submission order
        (:func:`~rlflow.schedulers.runtime.walk.walk`). A graph with a filter node runs rounds of generation
        first (:class:`~rlflow.schedulers.runtime.refill.Rounds`).
        """
        if self.rounds is not None:
            return self.rounds.run(iteration)
        t0 = self.recorder.now()
        # key -> its rows: tensors and lists here, or references to rows the workers hold (DistExecutor)
        store: dict[str, Any] = self.executor.source(
            self.stream.next_batch(self.prompts_per_iteration), iteration
        )
        producers = self.graph.keys()  # key -> its producer (Graph is not a dict)
        pending = {key: len(self.graph.consumers(key)) for key in producers}
        tally = Tally()
        # One trace file per iteration, written after its nodes (not between them); a failed iteration
        # still records the nodes that finished.
        drawn = self.stream.drawn
        try:
            walk(self, self.order, store, pending, iteration, tally)
        finally:
            self.recorder.log_trace(tally.trace)
        self.recorder.log_prompts(iteration, *drawn)
        return close_iteration(self, iteration, t0, tally)

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out split (:func:`~rlflow.schedulers.runtime.evaluation.evaluate`):
        ``val/score/mean``, ``val/accuracy``, ``val/response_length/mean``; ``{}`` without evaluation."""
        return evaluate(self.executor, self.eval, self.eval_rows)

    # -- the loop -------------------------------------------------------------------------------------
    @contextmanager
    def _graceful_stop(self) -> Iterator[None]:
        """Handle :data:`STOP_SIGNALS` while the run loop runs (main thread only).

        The first signal finishes the iteration in flight, then the loop saves a checkpoint and stops.
        SIGTERM and SIGHUP come from a scheduler that sends SIGKILL after a grace period, so the iteration
        gets ``stop_timeout_s`` seconds (SIGALRM), then is abandoned (:class:`RunAbandoned`); Ctrl-C waits
        for it. A second signal stops at once: ``KeyboardInterrupt`` for Ctrl-C, else
        :class:`RunAbandoned`. Once the iteration's work is done (``self._finishing``: its records and
        checkpoint are being written) the timeout no longer applies: a first signal then only stops the
        loop after that checkpoint, so a regular save is never torn by the alarm.
        """
        if not _main_thread():
            yield
            return

        def on_stop(signum: int, frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            if self._stop_signal is not None:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                self._abandoned = RunAbandoned(signum, f"a second stop signal ({name})")
                raise self._abandoned
            self._stop_signal = signum
            if signum == signal.SIGINT:
                print("\nrlflow: stopping after this iteration (Ctrl-C again to abort)", file=sys.stderr)
                return
            if self._finishing:  # done: only its records and checkpoint are left to write
                bound = "it is done, its checkpoint is being written"
            else:
                bound = f"abandoned if it takes more than {self.stop_timeout_s:g} s"
                signal.setitimer(signal.ITIMER_REAL, self.stop_timeout_s)
            print(f"\nrlflow: {name}: stopping after this iteration ({bound}; {name} again to abort)",
                  file=sys.stderr)  # fmt: skip

        def on_alarm(signum: int, frame: FrameType | None) -> None:
            if self._finishing:  # the iteration finished as the alarm went off: its checkpoint is next
                return
            stopped_by = self._stop_signal or signal.SIGTERM
            reason = f"the iteration in flight ran past {self.stop_timeout_s:g} s"
            self._abandoned = RunAbandoned(stopped_by, reason)
            raise self._abandoned

        handlers = {s: on_stop for s in STOP_SIGNALS} | {signal.SIGALRM: on_alarm}
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, h in previous.items():
                signal.signal(s, signal.SIG_DFL if h is None else h)

    def run(self, iterations: int | None = None) -> RunResult:
        """Run until ``iterations`` (default ``run.iterations``) are done in total; returns the last metrics.

        Writes ``status.json`` (running → finished, interrupted, or failed with the error), metrics and
        trace per iteration, evaluation every ``run.eval_interval`` iterations (and before the first), and a
        checkpoint every ``run.checkpoint_interval`` iterations, at the end, and when stopped by a signal
        (:data:`STOP_SIGNALS`; :meth:`_graceful_stop`). Holds the run directory's lock until it returns.

        Raises:
            RunAbandoned: a stop signal abandoned the iteration in flight (status ``failed``; the previous
                checkpoint stays).
            HostError: a checkpoint could not be written (e.g. a full disk); the previous one stays.
            KeyboardInterrupt: a second Ctrl-C.
        """
        self.lock.acquire()  # again, for a second call
        try:
            return self._run(self.spec_run.iterations if iterations is None else iterations)
        finally:
            self.lock.release()

    def _run(self, total: int) -> RunResult:
        rec = self.recorder
        evals = recorded_evals(self.run_dir, self.start_iteration)
        metrics: dict[str, float] = {}
        iteration = self.start_iteration
        rec.write_status("running", iteration)
        bar = progress_bar(self.progress, self.start_iteration, total)
        self._stop_signal = None
        self._abandoned = None
        self._finishing = False
        try:
            with self._graceful_stop():
                if self.spec_run.eval_interval and iteration == 0:
                    evals[0] = self.evaluate()
                    if evals[0]:
                        self._report_eval(0, evals[0], bar)
                        rec.log_metrics(0, evals[0])
                while iteration < total:
                    iteration += 1
                    self._finishing = False
                    if self._stop_signal not in (None, signal.SIGINT):  # came after the last stop check
                        signal.setitimer(signal.ITIMER_REAL, self.stop_timeout_s)
                    if self.loop is None:
                        metrics = self.run_iteration(iteration)
                    else:  # asynchronous: later iterations may already be generating
                        metrics = self.loop.next(iteration, total)
                    last = iteration == total
                    # a scheduler's signal leaves no time for evaluation; Ctrl-C does
                    bounded = self._stop_signal not in (None, signal.SIGINT)
                    interval = self.spec_run.eval_interval
                    if interval and (iteration % interval == 0 or last) and not bounded:
                        if self.loop is not None:  # evaluate the weights after this iteration
                            self.loop.drain()
                        evals[iteration] = self.evaluate()
                        if evals[iteration]:
                            self._report_eval(iteration, evals[iteration], bar)
                        metrics.update(evals[iteration])
                    self._finishing = True  # the iteration is done: the stop timeout no longer applies
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    metrics.update(self._restart_metrics)
                    self._restart_metrics = {}  # the first iteration after the restart only
                    rec.log_metrics(iteration, metrics)
                    rec.write_status("running", iteration)
                    interval = self.spec_run.checkpoint_interval
                    saved = False
                    if (interval and (iteration % interval == 0 or last)) or self._stop_signal is not None:
                        self._save_checkpoint(iteration)
                        saved = True
                    stopping = self._stop_signal is not None
                    if stopping and not saved:  # a signal came while this iteration's records were written
                        self._save_checkpoint(iteration)
                    if bar is not None:
                        from rlflow.schedulers.records.telemetry import progress_fields

                        bar.update(1)
                        bar.set_postfix(progress_fields(metrics))
                    if stopping and not last:
                        break
        except RunAbandoned as e:
            # the abandoned iteration's partial trace (and metrics, if it got that far) are no record of a
            # finished iteration: drop them, as a resume drops what follows its checkpoint
            self._abort_loop()
            rec.drop_after(self._fail(iteration))
            raise RunAbandoned(
                e.signum, f"{e}: iteration {iteration} abandoned; {self._restart_hint()}"
            ) from None
        except BaseException as e:
            if self._abandoned is not None:  # a library turned the signal's exception into one of its own
                self._abort_loop()
                rec.drop_after(self._fail(iteration))
                raise RunAbandoned(
                    self._abandoned.signum,
                    f"{self._abandoned}: iteration {iteration} abandoned ({type(e).__name__} "
                    f"while stopping); {self._restart_hint()}",
                ) from e
            self._abort_loop()
            self._fail(iteration)
            raise
        finally:
            if bar is not None:
                bar.close()
        stopped = self._stop_signal if iteration < total else None
        # A run stopped by a signal has a checkpoint: `rlflow runs` lists it as resumable.
        rec.write_status("interrupted" if stopped is not None else "finished", iteration)
        return RunResult(iteration, metrics, evals, stopped is not None, stopped)

    def _report_eval(self, iteration: int, values: dict[str, float], bar: Any) -> None:
        """Hand an evaluation to ``on_eval``, the progress bar cleared meanwhile (tqdm redraws it after)."""
        if self.on_eval is None:
            return
        if hasattr(bar, "external_write_mode"):  # a tqdm bar on the terminal: keep the line off it
            with bar.external_write_mode():
                self.on_eval(iteration, values)
        else:
            self.on_eval(iteration, values)

    def _abort_loop(self) -> None:
        """After a failure, keep the trace rows of the nodes the asynchronous loop finished."""
        if self.loop is not None:
            with contextlib.suppress(Exception):  # the failure being reported matters more than its trace
                self.loop.abort()

    def _fail(self, iteration: int) -> int:
        """Mark the run failed at the last finished iteration and stop every worker at once; that
        iteration."""
        done = iteration - 1 if iteration > self.start_iteration else iteration
        self.recorder.write_status("failed", done)
        self.executor.close(force=True)
        return done

    def _restart_hint(self) -> str:
        """How to go on after a failure (:func:`resume_hint`)."""
        return resume_hint(self.run_dir)

    def _save_checkpoint(self, iteration: int) -> None:
        """Write the checkpoint after ``iteration``.

        Raises:
            HostError: the OS refused a write (a full disk, a quota, permissions; torch reports a failed
                write as ``RuntimeError``, safetensors as its own ``SafetensorError``); the temporary
                checkpoint is removed and the previous one stays.
        """
        # safetensors (the models' weights) wraps an OS failure in an exception of its own, not an OSError
        from safetensors import SafetensorError

        inflight = None
        if self.loop is not None:  # the batches generated ahead go into the checkpoint, complete
            self.loop.drain()
            inflight = self.loop.state()
        try:
            save_checkpoint(self.recorder, iteration, self.graph, self.executor, self.stream, inflight)
        except (OSError, RuntimeError, SafetensorError) as e:
            reason = _write_failure(e)
            raise HostError(
                f"checkpoint after iteration {iteration} was not written ({reason.splitlines()[0]}); "
                f"{self._restart_hint()}"
            ) from e

    def close(self) -> None:
        """Stop the executor's workers (a no-op for the single-process executor) and release the run
        directory's lock."""
        try:
            self.executor.close()
        finally:
            self.lock.release()


def resume_hint(run_dir: str | Path) -> str:
    """How to go on after a run in ``run_dir`` stopped: ``--resume`` from its latest checkpoint, or, before
    the first one (``--resume`` refuses a directory without a checkpoint), ``--overwrite`` to start again."""
    found = latest_checkpoint(run_dir)
    if found is not None:
        return f"--resume continues from checkpoint {found[0]}"
    return "no checkpoint yet: start it again with --overwrite"


def _write_failure(err: BaseException) -> str:
    """One line saying why a checkpoint write failed: an OSError's reason and file; safetensors'
    ``IoError(Os { code: 28, ..., message: "No space left on device" })`` reduced to its OS message; else
    the first line."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    text = str(err)
    found = re.search(r'message: "([^"]+)"', text)
    return found.group(1) if found else (text.splitlines() or [type(err).__name__])[0]


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
