"""The pre-launch memory check counts every model on every device (issue 14, item 3): the actor's weights,
gradients and optimizer state, the frozen reference copy and generation's KV cache, priced by the planner's
memory model, against the machine's memory (injected here, so the tests do not depend on this machine).

Reproduce: ``python -m pytest -q tests/test_resource_check.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner import resources
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.cluster_files import local_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory, device_consumers

GRPO = "examples/grpo.yaml"
GIB = 2**30
# A bigger actor (head_dim stays 16): 8 layers × (4·1024² attention + 3·1024·4096 MLP) ≈ 134 M parameters,
# 0.50 GiB of float32 weights. Alone it fits in 1.5 GiB; with its gradients (2 B/param), Adam state
# (12 B/param) and the reference copy (0.50 GiB) it needs about 2.8 GiB.
BIG = [
    "models.actor.config.hidden_size=1024",
    "models.actor.config.intermediate_size=4096",
    "models.actor.config.num_hidden_layers=8",
    "models.actor.config.num_attention_heads=64",
    "models.actor.config.num_key_value_heads=64",
]


def _host(gib: float) -> MachineMemory:
    return MachineMemory(gib * GIB)


def test_every_model_is_counted() -> None:
    graph = load_graph(GRPO, BIG)
    cost = CostModel(problem_from_graph(graph), local_cluster(1))
    plan = {n.name: graph.placement(n.name) for n in cost.problem.nodes}
    usage = device_consumers(cost, plan)
    assert set(usage) == {0}
    got = {(c.model, c.what.split(" (")[0]): c.nbytes for c in usage[0]}
    ref = got[("ref", "weights")]
    assert 0.45 * GIB < ref < 0.55 * GIB  # the frozen reference: a copy of the actor's initial weights
    params = ref / 4  # float32
    # the actor's generate and train nodes share one instance (same layout): its train state counts once,
    # weights plus the two gathered layers the cost model keeps for the train step
    assert ref < got[("actor", "weights")] < 1.3 * ref
    assert got[("actor", "gradients")] == pytest.approx(2 * params)  # bf16 gradients
    assert got[("actor", "optimizer state")] == pytest.approx(12 * params)  # fp32 master + Adam m, v
    assert sum(c.nbytes for c in usage[0]) > 2.5 * GIB


def test_check_names_device_and_biggest_consumers() -> None:
    graph = load_graph(GRPO, BIG)
    with pytest.raises(PlanError) as err:
        check_plan_memory(graph, _host(1.5))
    first, *rest = str(err.value).splitlines()
    assert first.startswith("examples/grpo.yaml: the plan needs ")
    assert "on this host (devices 0), more than its 1.50 GiB of available host memory" in first
    assert rest[0].startswith("  device 0 (")
    assert "actor optimizer state 1.5" in rest[0] and "ref weights 0.5" in rest[0]
    check_plan_memory(graph, _host(4))  # fits: no error


def test_cuda_devices_are_checked_one_by_one() -> None:
    """Per-GPU capacity: a plan that puts the reference on device 1 fits 2.7 GiB GPUs, all on device 0 not."""
    over = ["run.devices=2", *BIG]
    graph = load_graph(GRPO, over)
    gpus = MachineMemory(None, {0: 2.7 * GIB, 1: 2.7 * GIB}, "GPU memory")
    with pytest.raises(PlanError, match=r"on device 0, more than its 2\.70 GiB of GPU memory"):
        check_plan_memory(graph, gpus)
    split = {
        "actor_gen": NodePlacement((0,), Layout()),
        "actor_train": NodePlacement((0,), Layout()),
        "ref": NodePlacement((1,), Layout()),
    }
    check_plan_memory(with_placements(graph, split), gpus)


@pytest.fixture
def small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine, as the commands see it, has 1.5 GiB of available memory."""
    monkeypatch.setattr(resources, "local_memory", lambda: _host(1.5))


def test_validate_rejects_what_does_not_fit(small_machine: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", GRPO, *BIG]) == 2
    err = capsys.readouterr().err
    assert "error: examples/grpo.yaml: the plan needs" in err
    assert "actor optimizer state" in err and "ref weights" in err
    assert main(["validate", GRPO]) == 0  # the example's tiny models fit


def test_run_stops_before_any_process_starts(
    small_machine: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(["run", GRPO, *BIG, f"run.output_dir={out}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "rlflow run: error: examples/grpo.yaml: the plan needs" in err and "device 0" in err
    assert not out.exists()  # no run directory, no worker


def _validate_on(gib: float, monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> int:
    monkeypatch.setattr(resources, "local_memory", lambda: _host(gib))
    return main(["validate", GRPO, *overrides])


def test_explicit_head_dim_is_priced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An explicit ``head_dim`` sizes q/o (issue 14 follow-up, bug 1). head_dim 4096 on hidden 1024 is a
    3.23 B-parameter actor (13 GiB of float32 weights alone): refused on a 22.5 GiB host, where hidden / heads
    (128) would have priced 0.3 B parameters and accepted it."""
    wide = [
        "models.actor.config.hidden_size=1024",
        "models.actor.config.num_attention_heads=8",
        "models.actor.config.num_key_value_heads=8",
        "models.actor.config.head_dim=4096",
        "models.actor.config.num_hidden_layers=24",
    ]
    assert _validate_on(22.5, monkeypatch, wide) == 2
    assert "actor weights 13.04 GiB" in capsys.readouterr().err


def test_head_dim_kept_when_hidden_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """hidden 8192 with the example's head_dim 16 (4 heads): q/k/v/o are 8192 × 64, 252.8 M parameters,
    about 7.5 GiB with training state; hidden / heads (2048) would price 50.59 GiB of actor weights."""
    big = ["models.actor.config.hidden_size=8192", "models.actor.config.num_hidden_layers=48"]
    assert _validate_on(22.5, monkeypatch, big) == 0
