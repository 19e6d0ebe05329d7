"""Write ``tests/example_metrics.json``: the metric names a run of each example graph logs, for the dashboard
test (``tests/test_dashboard_examples.py`` draws every example's dashboard from synthetic records with
these columns, in a browser, without running the examples).

Each example runs one iteration with an evaluation of 4 held-out prompts (one process, in a temporary
copy of ``examples/``); a stage that starts from another's checkpoint (``examples/search/grpo.yaml``,
``examples/arith/{ppo,grpo}.yaml``, ``examples/distill/distill.yaml``) runs after that stage saved one.
vLLM's examples are left out (an engine start takes tens of seconds; they log their built-in twins' names).
About two minutes on two cores:

    python3 scripts/example_metrics.py          # rewrite tests/example_metrics.json
    python3 scripts/example_metrics.py --check  # exit 1 if the file is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "example_metrics.json"
# (label, graph file, extra overrides), in an order where a stage's checkpoint exists before it is read
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ppo", "examples/ppo.yaml", ()),
    ("ppo-async", "examples/ppo.yaml", ("nodes.actor_gen.staleness=1",)),
    ("grpo", "examples/grpo.yaml", ()),
    ("grpo_decoupled", "examples/grpo_decoupled.yaml", ()),
    ("rloo", "examples/rloo.yaml", ()),
    ("remax", "examples/remax.yaml", ()),
    ("reinforce_pp", "examples/reinforce_pp.yaml", ()),
    ("dapo", "examples/dapo.yaml", ()),
    ("dapo_overlong", "examples/dapo_overlong.yaml", ()),
    ("cispo", "examples/cispo.yaml", ()),
    ("sapo", "examples/sapo.yaml", ()),
    ("dpo", "examples/dpo.yaml", ()),
    ("sft", "examples/sft.yaml", ()),
    ("reward_model", "examples/reward_model.yaml", ()),
    ("search-sft", "examples/search/sft.yaml", ()),
    ("search-grpo", "examples/search/grpo.yaml", ()),
    ("arith-sft", "examples/arith/sft.yaml", ()),
    ("arith-ppo", "examples/arith/ppo.yaml", ()),
    ("arith-grpo", "examples/arith/grpo.yaml", ()),
    ("distill-teacher", "examples/distill/teacher.yaml", ()),
    ("distill", "examples/distill/distill.yaml", ()),  # reads arith-sft's and distill-teacher's checkpoints
)


def collect() -> dict[str, list[str]]:
    """Label -> the sorted metric names (``iteration`` left out) its one-iteration run wrote.

    Raises:
        RuntimeError: a run failed (its output attached).
    """
    import pyarrow.parquet as pq
    import yaml

    from rlflow.schedulers.cli import main

    found: dict[str, list[str]] = {}
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="rlflow-metrics-") as tmp:
        shutil.copytree(ROOT / "examples", Path(tmp) / "examples")
        os.chdir(tmp)
        try:
            for label, graph, extra in RUNS:
                # the graph's own run directory: the next stage reads the checkpoint saved there
                own = yaml.safe_load(Path(graph).read_text())["run"]["output_dir"]
                out_dir = own if label.endswith(("sft", "teacher")) else f"runs/{label}"
                argv = ["run", graph, "run.iterations=1", "run.checkpoint_interval=1", "run.eval_interval=1",
                        "run.eval.size=4", f"run.output_dir={out_dir}", "--no-progress", "--overwrite",
                        *extra]  # fmt: skip
                buffer = io.StringIO()
                with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                    status = main(argv)
                if status != 0:
                    raise RuntimeError(f"`rlflow {' '.join(argv)}` failed:\n{buffer.getvalue()[-3000:]}")
                names: set[str] = set()
                for path in Path(out_dir, "metrics").glob("*.parquet"):
                    names.update(pq.read_schema(path).names)
                found[label] = sorted(names - {"iteration"})
        finally:
            os.chdir(cwd)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args()
    text = json.dumps(collect(), indent=1) + "\n"
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python3 scripts/example_metrics.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
