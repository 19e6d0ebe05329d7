"""Checkpoints of a run: writing them atomically, reading them back, and the graph fingerprint.

A checkpoint ``<run_dir>/checkpoints/iter-00000k`` holds the state after ``k`` iterations: ``models/<name>``
(Hugging Face format, from :meth:`Executor.save_models`) and ``state.pt`` (iteration, the graph's
:func:`fingerprint`, the executor's state, the data stream's position, the torch and Python random
states). ``checkpoints/latest`` points at the newest one.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from rlflow.dataflow.data import PromptStream
from rlflow.dataflow.errors import GraphError, HostError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.model_spec import resolve_dtype
from rlflow.schedulers.records.rundir import RunRecorder, list_checkpoints
from rlflow.schedulers.runtime.devices import default_device
from rlflow.schedulers.runtime.executor import Executor

__all__ = ["fingerprint", "load_checkpoint", "save_checkpoint"]


def fingerprint(graph: Graph) -> dict[str, Any]:
    """What a checkpoint records of its graph: ``structure`` must agree for a resume (every model's
    architecture and source, every node's kind, function and model: the saved weights and optimizer
    state are theirs); ``settings`` may change (the algorithm, node arguments, optimizers, data) and
    are reported when they do. The run section (iterations, intervals, devices) is not compared. A model's
    dtype is recorded as built on this host's devices (``dtype: auto`` as float32 on CPU, bfloat16 on
    CUDA: ``resolve_dtype``), so a run saved before ``auto`` was the default (its ``float32``) resumes."""
    spec = yaml.safe_load(graph.to_yaml())
    arch = ("path", "config", "init_from", "head", "dtype", "trainable", "ema")
    device_type = default_device().type
    structure = {
        "models": {
            name: {k: resolve_dtype(m.get(k), device_type) if k == "dtype" else m.get(k) for k in arch}
            for name, m in spec["models"].items()
        },
        "nodes": {name: [n["kind"], n["function"], n.get("model")] for name, n in spec["nodes"].items()},
    }
    settings = {
        "models": {n: {k: v for k, v in m.items() if k not in arch} for n, m in spec["models"].items()},
        "nodes": {
            n: {k: v for k, v in d.items() if k not in ("kind", "function", "model")}
            for n, d in spec["nodes"].items()
        },
        "data": spec["data"],
        "algorithm": spec["algorithm"],
    }
    return {"structure": structure, "settings": settings}


def save_checkpoint(
    recorder: RunRecorder,
    iteration: int,
    graph: Graph,
    executor: Executor[Any],
    stream: PromptStream,
    inflight: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint after ``iteration`` atomically, point ``latest`` at it and drop the oldest
    beyond ``run.keep_checkpoints``; its directory. ``inflight``: an asynchronous run's batches generated
    ahead (:meth:`rlflow.schedulers.runtime.asynchronous.AsyncLoop.state`), stored with the state."""
    with recorder.checkpoint(iteration) as tmp:
        executor.save_models(tmp / "models")
        state = {
            "iteration": iteration,
            "graph": fingerprint(graph),
            "executor": executor.state_dict(),
            "data": stream.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        if inflight is not None:
            state["inflight"] = inflight
        torch.save(state, tmp / "state.pt")
    _point_latest(recorder.checkpoints_dir, f"iter-{iteration:06d}")
    keep = graph.spec.run.keep_checkpoints
    if keep:
        for _, old in list_checkpoints(recorder.run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return recorder.checkpoints_dir / f"iter-{iteration:06d}"


def load_checkpoint(
    path: Path, graph: Graph, executor: Executor[Any], stream: PromptStream
) -> dict[str, Any] | None:
    """Restore the executor's state, the data stream and the random states from checkpoint ``path``
    (the executor already holds its weights); the asynchronous run's batches generated ahead that it
    holds (``None``: none, e.g. a synchronous run).

    Raises:
        HostError: ``state.pt`` cannot be read (naming it; ``--resume`` sets a broken newest checkpoint aside
            before: :mod:`~rlflow.schedulers.records.checkpoint_check`).
        GraphError: the checkpoint was written by a graph of another structure (its models or nodes).
        PlanError: the executor's state was written under another plan.

    Warns:
        GraphWarning: settings changed since the checkpoint (listed).
    """
    try:
        state = torch.load(path / "state.pt", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as err:  # what a damaged file raises
        raise HostError(f"--resume: {path / 'state.pt'}: unreadable ({type(err).__name__}: {err})") from None
    saved, now = state.get("graph"), fingerprint(graph)
    if saved is not None and "structure" not in saved:  # written before settings were recorded
        saved = {"structure": saved, "settings": now["settings"]}
        now = {**now, "structure": _old_fingerprint(graph)}
    if saved is not None and saved["structure"] != now["structure"]:
        raise GraphError(
            f"--resume: checkpoint '{path}' was written by a different graph (checkpoint -> this graph: "
            f"{_listed(_differences(saved['structure'], now['structure']))})"
        )
    changed = _differences(saved["settings"], now["settings"]) if saved is not None else []
    if changed:
        warnings.warn(
            GraphWarning(
                f"--resume: settings changed since '{path}' (checkpoint -> now): {_listed(changed)}"
            ),
            stacklevel=2,
        )
    executor.load_state_dict(state["executor"])
    stream.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    inflight: dict[str, Any] | None = state.get("inflight")
    return inflight


class _Absent:
    """The value of a key one side of :func:`_differences` lacks."""

    def __repr__(self) -> str:
        return "(none)"


_ABSENT = _Absent()


def _old_fingerprint(graph: Graph) -> dict[str, Any]:
    """The fingerprint checkpoints recorded before ``settings``: heads and (function, model) per node."""
    spec = graph.spec
    return {
        "models": {name: m.head for name, m in spec.models.items()},
        "nodes": {name: [n.function, n.model] for name, n in spec.nodes.items()},
    }


def _listed(diffs: list[str], most: int = 5) -> str:
    more = f" (and {len(diffs) - most} more)" if len(diffs) > most else ""
    return "; ".join(diffs[:most]) + more


def _differences(old: Any, new: Any, key: str = "") -> list[str]:
    """``key: old -> new`` for every dotted key whose value differs between two nested dicts (a key only
    one side has shows ``(none)`` on the other; a whole section only one side has is ``added`` or
    ``removed``)."""
    if old is _ABSENT and isinstance(new, dict):
        return [f"{key}: added"]
    if new is _ABSENT and isinstance(old, dict):
        return [f"{key}: removed"]
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [f"{key}: {old!r} -> {new!r}"]
    out: list[str] = []
    for k in [*old, *(k for k in new if k not in old)]:
        out += _differences(old.get(k, _ABSENT), new.get(k, _ABSENT), f"{key}.{k}" if key else str(k))
    return out


def _point_latest(directory: Path, name: str) -> None:
    """Atomically point ``directory/latest`` at checkpoint ``name`` (a relative symlink), so other graphs
    can load a run's newest weights as ``<run_dir>/checkpoints/latest/models/<model>``."""
    tmp = directory / f".tmp-latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, directory / "latest")
