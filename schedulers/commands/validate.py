"""Validate graph files: load, apply overrides, resolve, check, and report.

Prints ``ok: FILE (N nodes, M keys)`` per valid file and each warning to stderr (``rlflow: warning: ...``);
a file with mistakes prints each to stderr as every ``rlflow`` command prints an error (``rlflow validate:
error: FILE: KEY: ...``) and the command exits with status 2 after checking every file. Besides the
graph itself, the local files it names must exist (model and tokenizer directories, data files; paths
relative to the working directory, as ``rlflow run`` reads them; model contents are checked by ``run``),
model configs must be valid Hugging Face configs, a data generator must be registered, the data must load
(a file's or a ``data.dataset``'s splits and the columns ``data.fields`` maps), every prompt must
fit the context (``data.max_prompt_tokens``, the model's positions less ``max_new_tokens``), and the plan must
fit this machine's memory (every model's weights, gradients, optimizer state, frozen copies and KV cache).

Examples (an override: a model's learning rate is models.<model>.optimizer.lr, a node's arguments are
nodes.<node>.args.<name>)::

    rlflow validate examples/*.yaml
    rlflow validate examples/ppo.yaml models.actor.optimizer.lr=1e-6
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from rlflow.dataflow.errors import GraphMistakes, RlflowError
from rlflow.dataflow.graph import Graph, GraphWarning, warn_unplanned_devices


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    """Separate graph files from dotted ``key=value`` overrides (an existing file is always a file)."""
    files: list[str] = []
    overrides: list[str] = []
    for item in items:
        (overrides if "=" in item and not Path(item).exists() else files).append(item)
    return files, overrides


def runtime_mistakes(graph: Graph) -> list[str]:
    """What ``rlflow run`` would reject before training besides the graph itself: missing local files,
    what node functions' own checks and the run-level checks find (rule rewards, agent tools/environments that
    do not resolve: :func:`rlflow.nodes.checks.launch_mistakes`), model configs
    transformers rejects, experiment trackers unknown or not installed (``run.trackers``), an unknown data
    generator, a generate node's engine that cannot serve it
    (``engine: vllm``: vLLM missing, model shape, context). One message per mistake, naming the key."""
    from rlflow.dataflow.data import DATA_GENERATORS, load_builtin_generators
    from rlflow.dataflow.errors import RegistryError
    from rlflow.nodes.checks import launch_mistakes
    from rlflow.nodes.models import hf_config_from_dict
    from rlflow.schedulers.records.trackers import tracker_mistakes

    source = graph.spec.source or "<graph>"
    out = missing_files(graph) + launch_mistakes(graph) + tracker_mistakes(graph.spec)
    for name, m in graph.spec.models.items():
        if m.config is not None:
            try:
                hf_config_from_dict(m.config, f"models.{name}")
            except RlflowError as e:
                out.append(f"{source}: {e}")
    from rlflow.nodes.engines.validation import check_engines

    try:
        check_engines(graph, "cuda" if _cuda() else "cpu")
    except RlflowError as e:
        out.append(str(e) if str(e).startswith(source) else f"{source}: {e}")
    generator = graph.spec.data.generator
    if generator is not None:
        load_builtin_generators()
        try:
            DATA_GENERATORS.get(generator.name)
        except RegistryError as e:
            out.append(f"{source}: data.generator.name: {e}")
    return out


def all_mistakes(graph: Graph) -> list[str]:
    """Every mistake ``rlflow validate`` reports of a loaded graph: :func:`runtime_mistakes`, and where there
    are none the data's (:func:`data_mistakes`: it reads the data) or else the plan's on this machine
    (:func:`memory_mistakes`). ``rlflow run`` reports :func:`runtime_mistakes` the same way, all of them,
    before it plans, and the other two before any process starts."""
    return runtime_mistakes(graph) or data_mistakes(graph) or memory_mistakes(graph)


def data_mistakes(graph: Graph) -> list[str]:
    """The data's own mistakes, as ``rlflow run`` checks them before starting anything, reading the data
    once: a data file or ``data.dataset`` that does not load, a split, mapped or filtered column that does
    not exist, a filter that keeps no row, a failing generator (``rlflow.dataflow.data.load_splits``); with
    tokenized fields, message lists that are malformed or meet a tokenizer without a chat template
    (``rlflow.dataflow.chat``) and prompts longer than ``data.max_prompt_tokens`` or than what generation
    leaves of the model's positions (``rlflow.dataflow.context.fitted_splits``, under ``data.overlong:
    error``). One message, or none."""
    from rlflow.dataflow.context import fitted_splits
    from rlflow.dataflow.data import load_splits
    from rlflow.nodes.tokenizers import data_tokenizer

    try:
        if graph.spec.data.tokenize:
            fitted_splits(graph, data_tokenizer(graph, {}))
        else:
            load_splits(graph.spec.data, base_dir=None)
    except RlflowError as e:
        return [f"{graph.spec.source or '<graph>'}: {e}"]
    return []


def memory_mistakes(graph: Graph) -> list[str]:
    """The plan's worker processes and memory on this machine, as ``rlflow run`` checks them before starting
    anything (:func:`rlflow.schedulers.planner.host_limits.fit_to_host`: on CPU the devices the plan uses,
    against this host's cores; :func:`rlflow.schedulers.planner.resources.check_plan_memory`): one message,
    or none."""
    from rlflow.schedulers.planner.host_limits import fit_to_host
    from rlflow.schedulers.planner.resources import check_plan_memory

    try:
        check_plan_memory(fit_to_host(graph)[0])
    except RlflowError as e:
        return [str(e)]
    return []


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def missing_files(graph: Graph) -> list[str]:
    """One message per local path the graph names that does not exist, naming its key."""
    source = graph.spec.source or "<graph>"
    wanted: list[tuple[str, str, bool]] = []  # (key, path, is a directory)
    for name, m in graph.spec.models.items():
        if m.path is not None:
            wanted.append((f"models.{name}.path", m.path, True))
        if m.tokenizer is not None:
            wanted.append((f"models.{name}.tokenizer", m.tokenizer, True))
    data = graph.spec.data
    for key in ("train", "eval"):
        value = getattr(data, key)
        if value is not None:
            wanted.append((f"data.{key}", value, False))
    if data.tokenizer is not None and data.tokenizer not in graph.spec.models:
        wanted.append(("data.tokenizer", data.tokenizer, True))
    out = []
    for key, path, is_dir in wanted:
        p = Path(path)
        if not (p.is_dir() if is_dir else p.is_file()):
            kind = "directory" if is_dir else "file"
            out.append(
                f"{source}: {key}: {kind} '{path}' does not exist (relative to {Path.cwd()})"
                + checkpoint_hint(p, graph.spec.source)
            )
    return out


def checkpoint_hint(path: Path, source: str | None) -> str:
    """For a missing ``path`` inside a run directory's checkpoints (``RUN_DIR/checkpoints/...``, e.g. the SFT
    stage's model that a PPO graph starts from): ``"; it is a checkpoint of run directory ..."``, naming the
    graph files beside ``source`` whose ``run.output_dir`` is that directory (the stage that writes it) and
    the command that runs them in order; ``""`` for any other path."""
    from rlflow.schedulers.records.rundir import CHECKPOINTS_DIR

    parts = path.parts
    if CHECKPOINTS_DIR not in parts[1:]:
        return ""
    run_dir = Path(*parts[: len(parts) - 1 - parts[::-1].index(CHECKPOINTS_DIR)])
    if run_dir.is_dir():
        return (
            f"; it is a checkpoint of run directory '{run_dir}', which holds no such checkpoint yet (did "
            f"that run stop before writing it? `rlflow runs {run_dir}` shows how far it got)"
        )
    writers = writers_of(run_dir, Path(source).parent if source else Path())
    this = source or "THIS.yaml"
    if not writers:
        return (
            f"; it is a checkpoint of run directory '{run_dir}', which a run with run.output_dir: {run_dir} "
            f"writes: run that graph first (`rlflow run THAT.yaml {this}` runs the two in order)"
        )
    return (
        f"; it is a checkpoint of run directory '{run_dir}', which {' or '.join(map(str, writers))} writes "
        f"(its run.output_dir): run that stage first, or the two in order: `rlflow run {writers[0]} {this}`"
    )


def writers_of(run_dir: Path, folder: Path) -> list[Path]:
    """The graph files in ``folder`` (``*.yaml``, ``*.yml``) whose ``run.output_dir`` is ``run_dir``, as
    each file writes it (no overrides); files that do not parse are skipped."""
    import yaml

    found = []
    for file in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            run = (yaml.safe_load(file.read_text()) or {}).get("run") or {}
            out = run.get("output_dir") if isinstance(run, dict) else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(out, str) and Path(out) == run_dir:
            found.append(file)
    return found


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "items",
        nargs="+",
        metavar="FILE|KEY=VALUE",
        help="graph files, and dotted overrides (key.path=value) applied to every file",
    )


def run(args: argparse.Namespace) -> int:
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.cli import error_line

    command = getattr(args, "command", None) or "validate"
    files, overrides = split_items(args.items)
    if not files:
        raise RlflowError("no graph file given (only overrides: " + " ".join(overrides) + ")")
    status = 0
    for file in files:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", GraphWarning)
                graph = load_graph(file, overrides)
                warn_unplanned_devices(graph.spec)  # as `rlflow run` warns
        except RlflowError as e:
            for message in e.messages if isinstance(e, GraphMistakes) else [str(e)]:
                print(error_line(command, message), file=sys.stderr)
            status = 2
            continue
        for w in caught:
            if issubclass(w.category, GraphWarning):
                print(f"rlflow: warning: {w.message}", file=sys.stderr)  # as the CLI shows a GraphWarning
        mistakes = all_mistakes(graph)
        if mistakes:
            for message in mistakes:
                print(error_line(command, message), file=sys.stderr)
            status = 2
            continue
        n, k = len(graph.nodes), len(graph.keys())
        print(f"ok: {file} ({n} node{'s' if n != 1 else ''}, {k} key{'s' if k != 1 else ''})")
    return status
