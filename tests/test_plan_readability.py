"""`rlflow plan` reads plainly (issue 14, item 7): the table's device column is a list of device ids, the
plan YAML header records how the plan was made, and the Gantt chart has one integer tick per device.

Reproduce the old failures: ``rlflow plan examples/ppo.yaml --cluster h100-8x --hosts 2`` printed
``devices 4`` (an index that reads as a count), wrote a header without ``--hosts``, and drew a one-device
Gantt chart with ticks 3.6 … 4.4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.plans import format_devices, load_plan
from rlflow.schedulers.planner.simulator import Event, Timeline, gantt_figure


def test_plan_table_lists_device_ids_and_header_has_provenance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.yaml"
    argv = ["plan", "examples/sft.yaml", "run.seed=3", "--cluster", "cpu-local", "--hosts", "2"]
    assert main([*argv, "--out", str(out), "--steps", "20", "--restarts", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    header = printed[0].split()
    assert header[:3] == ["node", "device", "ids"], printed[0]
    row = printed[1].split()
    # "[0]", "[0-3]" or "[0,2]": brackets make an index list, never a bare number that reads as a count.
    assert row[1].startswith("[") and row[1].endswith("]"), printed[1]
    plan = load_plan(out)
    assert row[1] == f"[{format_devices(plan[row[0]].devices)}]"

    text = out.read_text()
    comments = [line.removeprefix("# ") for line in text.splitlines() if line.startswith("#")]
    assert comments[0].startswith("rlflow plan examples/sft.yaml run.seed=3 --cluster cpu-local --hosts 2")
    fields = dict(line.split(": ", 1) for line in comments[1:8])
    assert fields["graph"] == "examples/sft.yaml"
    assert fields["overrides"] == "run.seed=3"
    assert fields["cluster"].startswith("cpu-local (") and "2 hosts" in fields["cluster"]
    assert fields["hosts"] == "2"
    assert fields["profile"].startswith("none")
    assert fields["rlflow"][0].isdigit()
    assert fields["date"][:2] == "20" and "T" in fields["date"]
    assert isinstance(yaml.safe_load(text), dict)  # the header is comments only: still a plan file


@pytest.mark.parametrize(("devices", "used"), [(1, 0), (8, 4)])
def test_gantt_has_one_integer_tick_per_device(devices: int, used: int) -> None:
    events = tuple(
        Event(it, "actor_train", (used,), start, start + 1.0, "node") for it, start in ((0, 0.0), (1, 1.5))
    )
    fig = gantt_figure(Timeline(events, (1.0, 2.5)), devices)
    (ax,) = fig.axes
    assert list(ax.get_yticks()) == list(range(devices))
    assert [t.get_text() for t in ax.get_yticklabels()] == [str(d) for d in range(devices)]
    low, high = sorted(ax.get_ylim())
    assert (low, high) == (-0.5, devices - 0.5)


def test_show_lists_device_ids(capsys: pytest.CaptureFixture[str]) -> None:
    plan = (
        "plan={actor_gen: {devices: 1, layout: d1t1p1m1}, reward: {devices: 0, layout: d1t1p1m1}, "
        "ref: {devices: 0-1, layout: d2t1p1m1}, actor_train: {devices: 0-1, layout: d2t1p1m1}}"
    )
    assert main(["show", "examples/grpo.yaml", "run.devices=2", plan, "--no-draw"]) == 0
    out = capsys.readouterr().out
    assert "; device ids [1] d1t1p1m1" in out and "; device ids [0-1] d2t1p1m1" in out, out


def test_plan_async_warns_about_the_searched_plan_not_the_file_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlflow plan` replaces the file's plan: no warning about that plan's placements (examples/grpo.yaml
    puts generation and training on device 0), and the async line credits overlap only where the searched
    plan has generation and training on disjoint devices (the simulator's rule)."""
    out = tmp_path / "plan.yaml"
    argv = ["plan", "examples/grpo.yaml", "nodes.actor_gen.staleness=1", "--cluster", "cpu-local"]
    assert main([*argv, "--out", str(out), "--steps", "30", "--restarts", "1"]) == 0
    captured = capsys.readouterr()
    assert "share device [0]" not in captured.err
    line = next(x for x in captured.out.splitlines() if x.startswith("asynchronous"))
    plan = load_plan(out)
    shared = set(plan["actor_gen"].devices) & set(plan["actor_train"].devices)
    if shared:
        assert "no overlap in this plan" in line, line
        assert "the searched plan puts generate node 'actor_gen'" in captured.err
    else:
        assert "(1.00x)" not in line and "staleness up to 1" in line, line


def test_plan_table_shows_the_model_free_reward_where_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rule reward of examples/grpo.yaml (no model) has a row in the table, in execution order, with
    the device and layout it runs on under the written plan (which leaves it out) and no prediction."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan

    out = tmp_path / "plan.yaml"
    argv = ["plan", "examples/grpo.yaml", "--cluster", "cpu-local", "--out", str(out), "--restarts", "0"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in printed[1:5]]
    assert names == ["actor_gen", "reward", "ref", "actor_train"], printed
    assert printed[2].split() == ["reward", "[0]", "d1t1p1m1", "1", "no", "model", "-", "-", "-", "-"]
    note = next(line for line in printed if line.startswith("no model (reward): "))
    assert "not in the plan file and not priced" in note and "runs on device 0 (d1t1p1m1)" in note
    assert "reward" not in load_plan(out)
    planned = resolve_plan(load_graph("examples/grpo.yaml", ["run.devices=2"]), out)
    placed = planned.placement("reward")
    assert (placed.devices, str(placed.layout)) == ((0,), "d1t1p1m1")
