"""Progress lines and `rlflow runs` name their times and agree (issue 14, item 7).

Reproduce the old failure: a run with evaluation printed ``rlflow: iteration 2/2 (9.5 s/it)`` (wall clock,
evaluation included) while ``rlflow runs`` showed ``s/iter 2.5`` (the last iteration alone), with nothing
saying which was which.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlflow.schedulers.commands.runs import SECONDS_NOTE, describe, format_table
from rlflow.schedulers.records.rundir import RunRecorder
from rlflow.schedulers.records.telemetry import progress_fields
from rlflow.schedulers.runtime import progress
from rlflow.schedulers.runtime.progress import LineProgress, progress_bar


def test_progress_line_and_runs_show_the_same_iteration_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = {"timing_s/iteration": 2.5, "critic/score/mean": 0.25}
    clock = iter([100.0, 119.0])  # start; after two iterations and an evaluation: 19 s of wall clock
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    bar = LineProgress(0, 2)
    bar.update(2)
    bar.set_postfix(progress_fields(metrics))
    line = capsys.readouterr().err.strip()
    assert line == (
        "rlflow: iteration 2/2 (9.5 s/it wall, eval and checkpoints included) s/iter=2.5 reward=0.25"
    )

    rec = RunRecorder(tmp_path / "run")
    rec.log_metrics(2, metrics)
    rec.write_status("finished", 2)
    table = format_table([describe(tmp_path / "run")]).splitlines()
    column = table[0].index("s/iter")  # columns are padded: read the row under the header
    assert table[1][column:].split()[0] == "2.5"  # the progress line's s/iter=, by the same name
    assert table[-1] == SECONDS_NOTE and "evaluation and checkpoints excluded" in SECONDS_NOTE


def test_terminal_bar_labels_its_rate_as_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", stream)
    monkeypatch.setattr(stream, "isatty", lambda: True, raising=False)
    bar = progress_bar(True, 0, 2)
    bar.update(1)
    bar.set_postfix(progress_fields({"timing_s/iteration": 2.5}))
    bar.close()
    text = stream.getvalue()
    assert "s/it wall incl. eval]" in text and "s/iter=2.5" in text, text


def test_progress_shows_the_staleness_of_an_asynchronous_run() -> None:
    fields = progress_fields({"timing_s/iteration": 1.0, "async/staleness_mean": 1.0, "async/at_bound": 1.0})
    assert fields["stale"] == "1@bound"  # training paces the run: generation waits for the weights
    assert progress_fields({"async/staleness_mean": 0.5, "async/at_bound": 0.5})["stale"] == "0.5"
    assert "stale" not in progress_fields({"timing_s/iteration": 1.0})  # synchronous: not shown
