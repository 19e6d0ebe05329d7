"""No run takes the host down (issue 39): on CPU only the devices a plan uses start as worker processes, more
workers than the host's cores can run are refused before any process starts, a SIGTERM while the workers
start ends the run with one line, and a worker exits when its controller dies before it serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rlflow.schedulers.planner.host_limits as host_limits
from rlflow.dataflow.errors import HostError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.host_limits import MAX_WORKERS_PER_CORE, compact_devices, fit_to_host

# examples/grpo.yaml over 19 devices: generation d8 on 0-7, the reference d8 on 8-15, training d2 on 16-17,
# the rule reward on 18
WIDE = (
    "plan={actor_gen: {devices: [0, 1, 2, 3, 4, 5, 6, 7], layout: d8t1p1m1}, "
    "ref: {devices: [8, 9, 10, 11, 12, 13, 14, 15], layout: d8t1p1m1}, "
    "actor_train: {devices: [16, 17], layout: d2t1p1m1}, reward: {devices: [18], layout: d1t1p1m1}}"
)


def test_only_the_devices_the_plan_uses_start() -> None:
    plan = (
        "plan={actor_gen: {devices: [126, 127], layout: d2t1p1m1}, ref: {devices: [126, 127], layout: "
        "d2t1p1m1}, actor_train: {devices: [126, 127], layout: d2t1p1m1}, reward: {devices: [0], layout: "
        "d1t1p1m1}}"
    )
    graph = load_graph("examples/grpo.yaml", ["run.devices=1000", plan])
    compacted, line = compact_devices(graph)
    # used devices 0, 126, 127 in order -> 0, 1, 2
    assert compacted.spec.run.devices == 3
    assert {n: compacted.placement(n).devices for n in graph.spec.nodes} == {
        "actor_gen": (1, 2),
        "reward": (0,),
        "ref": (1, 2),
        "actor_train": (1, 2),
    }
    assert {n: compacted.placement(n).layout for n in graph.spec.nodes} == {
        n: graph.placement(n).layout for n in graph.spec.nodes
    }
    assert line == (
        "rlflow: the plan uses 3 of run.devices=1000 devices (0,126-127): starting 3 worker processes, as "
        "devices 0-2"
    )
    # no plan: every node on device 0, one device, in this process
    alone, line = compact_devices(load_graph("examples/grpo.yaml", ["run.devices=1000"]))
    assert alone.spec.run.devices == 1
    assert line is not None and line.endswith("(0): running in this process, as device 0")
    # a plan that uses every device stays as it is
    same = load_graph("examples/grpo.yaml", ["run.devices=19", WIDE])
    assert compact_devices(same) == (same, None)


def test_more_workers_than_cores_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = load_graph("examples/grpo.yaml", ["run.devices=19", WIDE])
    assert fit_to_host(graph, cores=3)[0] is graph  # 19 workers <= 3 cores x 8
    with pytest.raises(HostError) as err:
        fit_to_host(graph, cores=2)
    assert str(err.value) == (
        "examples/grpo.yaml: run.devices: the plan needs 19 worker processes (on CPU a device is a "
        f"process), more than this host can run: 2 cores × {MAX_WORKERS_PER_CORE} workers per core = 16; "
        "use fewer devices (run.devices) or a plan over fewer of them"
    )
    # from the CLI: validate and run refuse it, and run starts no process (tests/conftest.py would see one)
    monkeypatch.setattr(host_limits, "host_cores", lambda: 2)
    assert main(["validate", "examples/grpo.yaml", "run.devices=19", WIDE]) == 2
    assert "19 worker processes" in capsys.readouterr().err
    # plan: auto chooses its devices at launch (run.devices=1000 used 3): nothing to refuse before
    assert main(["validate", "examples/grpo.yaml", "run.devices=1000", "plan=auto"]) == 0
    out = f"run.output_dir={tmp_path / 'run'}"
    assert main(["run", "examples/grpo.yaml", "run.devices=19", WIDE, out, "--no-progress"]) == 2
    err_text = capsys.readouterr().err
    assert "run.devices: the plan needs 19 worker processes" in err_text
    assert "rlflow: threads" not in err_text  # the line printed as workers start


def test_sigterm_while_starting_is_one_line() -> None:
    from rlflow.schedulers.runtime.controller import RunAbandoned
    from rlflow.schedulers.runtime.restarts import stop_signals_raise

    why = "while the run was starting (nothing trained, no checkpoint written, no worker left running)"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunAbandoned) as err, stop_signals_raise(RunAbandoned, why):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert err.value.signum == signal.SIGTERM
    assert str(err.value) == why
    assert signal.getsignal(signal.SIGTERM) == before


# A controller that starts two workers of a group of three: they block in the rendezvous, waiting for a
# third rank that never comes, as workers did while their controller was swapped out or killed.
RENDEZVOUS = """
import sys
from rlflow.schedulers.runtime.distributed.launch import free_port, spawn_group
from rlflow.schedulers.runtime.distributed.protocol import DistConfig
from rlflow.schedulers.runtime.distributed.worker import spawned_main
import os, dataclasses
procs = []
init = f"tcp://127.0.0.1:{free_port()}"
cfg = DistConfig(collective_timeout_s=600)
spawn_group(2, spawned_main, lambda r, n: (r, 3, init, ("127.0.0.1", 1), b"k" * 16,
            dataclasses.replace(cfg, threads=n), os.getpid()), procs)
print(" ".join(str(p.pid) for p in procs), flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
def test_controller_killed_in_rendezvous_leaves_no_worker() -> None:
    ctl = subprocess.Popen(
        [sys.executable, "-c", RENDEZVOUS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert ctl.stdout is not None
        workers = [int(p) for p in ctl.stdout.readline().split()]
        assert len(workers) == 2
        time.sleep(3)  # into the rendezvous
        assert all(_alive(p) for p in workers), "the workers should wait for their third rank"
        ctl.kill()
        ctl.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in workers)
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
