"""``code_reward``: scores ``[B]`` from running each response's code against its sample's tests in a sandbox.

The tests format, extraction, reasons and scores are :mod:`rlflow.nodes.services.code_exec`'s; the sandbox
and its mechanisms :mod:`rlflow.nodes.services.sandbox`'s. A failure of the code is a score and a counted
reason, never a failed run; a sandbox that cannot start stops the run with one line (a ``NodeError``) after
``start_retries`` retries. The pre-launch check (:func:`sandbox_mistakes`) probes the isolation, so
``rlflow validate`` and ``rlflow run`` refuse a host without it before anything runs.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.data import load_splits
from rlflow.dataflow.errors import DataError, NodeError, RlflowError
from rlflow.dataflow.registry import node_function
from rlflow.nodes.checks import RUN_CHECKS
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions.inference import score_metrics
from rlflow.nodes.generation import decode_responses
from rlflow.nodes.services.code_exec import (
    EXTRACT_MODES,
    SCORE_MODES,
    extract_code,
    parse_tests,
    reason_ratios,
    run_tests,
    sample_score,
)
from rlflow.nodes.services.sandbox import (
    ISOLATIONS,
    Limits,
    Sandbox,
    SandboxStartError,
    SandboxUnavailable,
    UnsafeSandboxWarning,
)

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "CODE_REWARD_ARGS",
    "code_reward_node",
    "limits_of",
    "sandbox_for",
    "sandbox_mistakes",
    "tests_field_mistakes",
]

CODE_REWARD_ARGS = (
    Arg(
        "extract",
        str,
        "fenced",
        "the code of a response: the last ```python (or bare ```) block, none without one (fenced); "
        "the whole response (whole)",
        choices=EXTRACT_MODES,
    ),
    Arg(
        "score",
        str,
        "pass_fraction",
        "a sample's score: (passed + failure_score·failed) / tests (pass_fraction); 1 if all pass, "
        "else failure_score (all_pass)",
        choices=SCORE_MODES,
    ),
    Arg("failure_score", float, 0.0, "the score of a failed test (pass_fraction) or sample (all_pass)"),
    # upper bounds: an hour, 1 TiB, 4096 processes, 64 GiB, 1 GiB -- far above any test, and each fits
    # setrlimit's and the tmpfs's integers (a larger value failed the probe as if the host lacked isolation)
    Arg("cpu_seconds", int, 4, "CPU seconds per process (RLIMIT_CPU; then a timeout)", low=1, high=3600),
    Arg(
        "wall_seconds",
        float,
        8.0,
        "wall seconds per execution, start-up included (then a timeout); at least 0.5: the sandbox's own "
        "start takes tens of milliseconds, more on a loaded host",
        low=0.5,
        high=3600,
    ),
    Arg(
        "memory_mb",
        int,
        512,
        "address space per process, MiB (RLIMIT_AS; over it: oom)",
        low=32,
        high=1 << 20,
    ),
    Arg(
        "max_processes",
        int,
        16,
        "processes and threads of a program, itself included (pids cgroup or RLIMIT_NPROC)",
        low=1,
        high=4096,
    ),
    Arg(
        "max_output_bytes",
        int,
        1 << 20,
        "stdout + stderr bytes per execution (over it: killed)",
        low=1,
        high=1 << 30,
    ),
    Arg(
        "tmp_mb",
        int,
        16,
        "size of the execution's private /tmp (the only writable place), MiB",
        low=1,
        high=1 << 16,
    ),
    Arg("concurrency", int, 4, "executions run at once (the pool's size)", low=1, high=256),
    Arg(
        "isolation",
        str,
        "bubblewrap",
        "bubblewrap (namespaces: no network, no host files); none_unsafe: no isolation at all, "
        "rlimits only (warned; for hosts without user namespaces)",
        choices=ISOLATIONS,
    ),
    Arg(
        "start_retries",
        int,
        2,
        "retries of a sandbox that fails to start, then the run stops",
        low=0,
        high=10,
    ),
)
"""``code_reward``'s arguments."""

_SANDBOXES: dict[tuple[str, Limits], Sandbox] = {}
_LOCK = threading.Lock()


def limits_of(args: dict[str, Any]) -> Limits:
    """The sandbox limits a node's bound arguments name (``Arg`` defaults filled)."""
    return Limits(
        cpu_seconds=int(args["cpu_seconds"]),
        wall_seconds=float(args["wall_seconds"]),
        memory_mb=int(args["memory_mb"]),
        max_processes=int(args["max_processes"]),
        max_output_bytes=int(args["max_output_bytes"]),
        tmp_mb=int(args["tmp_mb"]),
    )


def sandbox_for(isolation: str, limits: Limits) -> Sandbox:
    """This process's sandbox of ``isolation`` and ``limits``: probed once, its mechanisms printed to stderr
    once (the start-up line).

    Raises:
        SandboxUnavailable: the isolation cannot be had on this host.
    """
    with _LOCK:
        if (isolation, limits) not in _SANDBOXES:
            sandbox = Sandbox(isolation, limits)
            print(f"code_reward sandbox: {sandbox.mechanisms()}", file=sys.stderr, flush=True)
            _SANDBOXES[isolation, limits] = sandbox
        return _SANDBOXES[isolation, limits]


def sandbox_mistakes(args: dict[str, Any], where: str) -> list[str]:
    """``code_reward``'s pre-launch check of its bound ``args`` (a node's, or the held-out evaluation's
    ``run.eval.reward_args``): its sandbox can be had on this host (the probe runs one trivial program
    through it); one message naming ``where`` (file and key prefix) and ``isolation`` when not."""
    try:
        sandbox_for(str(args["isolation"]), limits_of(args))
    except SandboxUnavailable as e:
        return [f"{where}.isolation: {args['isolation']} isolation is not available on this host: {e}"]
    except SandboxStartError as e:
        return [f"{where}.isolation: {e}"]
    return []


def _uses_code_reward(graph: Graph) -> bool:
    nodes = any(graph.function(n).name == "code_reward" for n in graph.spec.nodes)
    return nodes or str(graph.spec.run.eval.get("reward") or "") == "code_reward"


@RUN_CHECKS.register("data.fields.tests")
def tests_field_mistakes(graph: Graph) -> list[str]:
    """The run-level check of the data's ``tests`` field where ``code_reward`` scores (a node, or
    ``run.eval.reward``): every row of each split parses (:func:`parse_tests`); one message per split naming
    the file (or generator) and split, how many rows are bad, the first one's index and its problem. Data
    that does not load is the data check's to report (``rlflow validate``), not this one's."""
    if graph.spec.data is None or not _uses_code_reward(graph):
        return []
    try:
        splits = load_splits(graph.spec.data, base_dir=None)
    except (RlflowError, OSError):
        return []
    out = []
    for split, rows in zip(("train", "eval"), splits, strict=True):
        if rows is None or "tests" not in rows.columns:
            continue
        bad: list[tuple[int, str]] = []
        for i, value in enumerate(rows.columns["tests"]):
            try:
                parse_tests(value)
            except DataError as e:
                bad.append((i, str(e)))
        if bad:
            out.append(
                f"{graph.spec.source or '<graph>'}: data '{rows.source}' ({split} split): field 'tests' is "
                f"unreadable for code_reward in {len(bad)} row(s), first at row {bad[0][0]}: {bad[0][1]}"
            )
    return out


@node_function(
    "code_reward",
    "inference",
    inputs=("response_ids", "response_mask", "tests"),
    outputs=("scores",),
    needs_model=False,
    args=CODE_REWARD_ARGS,
    args_check=sandbox_mistakes,
)
def code_reward_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    extract: str,
    score: str,
    failure_score: float,
    cpu_seconds: int,
    wall_seconds: float,
    memory_mb: int,
    max_processes: int,
    max_output_bytes: int,
    tmp_mb: int,
    concurrency: int,
    isolation: str,
    start_retries: int,
) -> NodeResult:
    """Scores ``[B]`` from each response's code run against its sample's ``tests`` in a sandbox.

    Metrics: ``reward/code_{pass,fail,timeout,oom,killed,error}_ratio`` (shares of the call's executions,
    one per sample and test; sum 1) and the scores' mean, max and min.

    Raises:
        NodeError: no tokenizer, a sample's tests unreadable, the isolation unavailable, or a sandbox that
            failed to start ``start_retries + 1`` times (one line naming the node).
    """
    name = ctx.node.name
    if ctx.tokenizer is None:
        raise NodeError(f"node '{name}': code_reward needs a tokenizer to decode responses")
    texts = decode_responses(ctx.tokenizer, batch.tensor("response_ids"), batch.tensor("response_mask"))
    tests = []
    for i, value in enumerate(batch.list_of("tests")):
        try:
            tests.append(parse_tests(value))
        except DataError as e:
            raise NodeError(f"node '{name}': code_reward: input 'tests' of sample {i}: {e}") from None
    if isolation == "none_unsafe":
        warnings.warn(
            UnsafeSandboxWarning(f"node '{name}': code_reward runs untrusted code unisolated (none_unsafe)"),
            stacklevel=2,
        )
    try:
        sandbox = sandbox_for(
            isolation,
            Limits(
                cpu_seconds=cpu_seconds,
                wall_seconds=wall_seconds,
                memory_mb=memory_mb,
                max_processes=max_processes,
                max_output_bytes=max_output_bytes,
                tmp_mb=tmp_mb,
            ),
        )
        codes = [extract_code(t, extract) for t in texts]
        outcomes = run_tests(sandbox, codes, tests, concurrency=concurrency, start_retries=start_retries)
    except (SandboxUnavailable, SandboxStartError) as e:
        raise NodeError(f"node '{name}': code_reward: {e}") from None
    scores = torch.tensor([sample_score(o, score, failure_score) for o in outcomes], dtype=torch.float32)
    metrics = reason_ratios(outcomes) | score_metrics("scores", scores)
    return NodeResult({"scores": scores}, metrics, int(batch.tensor("response_mask").sum()))
