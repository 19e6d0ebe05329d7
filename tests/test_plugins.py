"""Third-party plug-ins: a separately installed distribution registers a reward and a node function
through entry points (README, "Plug-ins"), and ``rlflow validate`` accepts graphs naming them.

The test builds a throwaway distribution (its own ``pyproject.toml`` declaring the ``rlflow.rewards`` and
``rlflow.node_functions`` groups, and one module), installs it with pip into a temporary target folder and
validates two graphs in a fresh process with that folder on ``PYTHONPATH``: one whose ``rule_reward``
node names the plug-in's reward, one whose reward node runs the plug-in's node function. Without the
folder, the same graphs are rejected naming the unknown reward and function, so the plug-in (not a
built-in) is what makes them valid.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

PYPROJECT = """\
[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "rlflow-plugin-example"
version = "0.0.1"

[project.entry-points."rlflow.rewards"]
example = "rlflow_plugin_example"

[project.entry-points."rlflow.node_functions"]
example = "rlflow_plugin_example"

[tool.setuptools]
py-modules = ["rlflow_plugin_example"]
"""

MODULE = '''\
"""A reward and a node function registered from outside rlflow."""
import torch

from rlflow.dataflow.registry import node_function
from rlflow.nodes.context import NodeResult
from rlflow.nodes.rewards import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("plugin_nonempty")
def plugin_nonempty(response_text, answer):
    """1.0 for a non-empty response."""
    return 1.0 if response_text.strip() else 0.0


@node_function(
    "plugin_length_score",
    "inference",
    inputs=("response_ids", "response_mask", "answer"),
    outputs=("scores",),
    needs_model=False,
)
def plugin_length_score(ctx, batch, **args):
    """Scores [B]: the response's length in tokens."""
    mask = batch.tensor("response_mask")
    return NodeResult({"scores": mask.sum(-1).float()}, {}, int(mask.sum()))
'''


def _validate(graphs: list[Path], pythonpath: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-m", "rlflow.schedulers.cli", "validate", *map(str, graphs)],
        cwd=ROOT,  # the graphs' relative paths (tokenizer) resolve against the repository root
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_entry_point_plugins_register_reward_and_node_function(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "rlflow_plugin_example.py").write_text(MODULE)
    site = tmp_path / "site"
    install = ["install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)]
    pip = subprocess.run(
        [sys.executable, "-m", "pip", *install],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pip.returncode == 0, f"pip install of the plug-in failed:\n{pip.stdout}{pip.stderr}"
    assert list(site.glob("rlflow_plugin_example-0.0.1.dist-info/entry_points.txt"))

    base = yaml.safe_load((ROOT / "examples" / "grpo.yaml").read_text())
    assert base["nodes"]["reward"]["function"] == "rule_reward"
    by_reward = yaml.safe_load(yaml.safe_dump(base))
    by_reward["nodes"]["reward"]["args"] = {"fn": "plugin_nonempty"}
    by_function = yaml.safe_load(yaml.safe_dump(base))
    by_function["nodes"]["reward"]["function"] = "plugin_length_score"
    by_function["nodes"]["reward"]["args"] = {}
    graphs = [tmp_path / "by_reward.yaml", tmp_path / "by_function.yaml"]
    for path, graph in zip(graphs, (by_reward, by_function), strict=True):
        path.write_text(yaml.safe_dump(graph, sort_keys=False))

    without = _validate(graphs, None)
    out = without.stdout + without.stderr
    assert without.returncode != 0, out
    assert "plugin_nonempty" in out and "plugin_length_score" in out, out

    with_plugin = _validate(graphs, str(site))
    out = with_plugin.stdout + with_plugin.stderr
    assert with_plugin.returncode == 0, out
    for path in graphs:
        assert f"ok: {path} (4 nodes, 8 keys)" in out, out
