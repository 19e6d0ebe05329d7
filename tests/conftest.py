"""Shared test fixtures.

``catalogue_registry``: a node-function registry declaring the catalogue of the shared contract (names,
kinds, canonical inputs/outputs, heads, needs_model) with a trivial ``fn``. Graph tests validate against it
so they do not depend on ``rlflow.nodes.functions``; ``tests/test_graph_examples.py`` checks that the real
builtins, once registered, declare the same signatures.
"""

from __future__ import annotations

import multiprocessing.process
import os
import shlex
import shutil
import subprocess
import sys
from typing import Any

import pytest

from rlflow.dataflow.registry import ArgInput, NodeFunction, Registry

_SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_TRUNC = ("truncated", "bootstrap_values")  # optional: bootstrapping truncated responses
_PAIR = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")

# generate's optional outputs: truncation, weight versions, the experts a MoE model routed each token to
_GEN_OPTIONAL = (
    "truncated", "weight_version", "token_weight_version", "routed_experts", "prompt_routed_experts",
)  # fmt: skip
# name -> (kind, inputs, outputs, heads, needs_model), as in the contract's node-function catalogue.
CATALOGUE: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], bool]] = {
    "generate": (
        "generate",
        ("prompt_ids", "prompt_mask"),
        ("response_ids", "response_mask", "logprobs", *_GEN_OPTIONAL),
        ("lm",),
        True,
    ),
    "logprobs": ("inference", _SEQ, ("logprobs",), ("lm",), True),
    "values": ("inference", _SEQ, ("values", "bootstrap_values"), ("value",), True),
    "rm_score": ("inference", _SEQ, ("scores",), ("score",), True),
    "sequence_logps": ("inference", _SEQ, ("logps",), ("lm",), True),
    "rule_reward": ("inference", ("response_ids", "response_mask", "answer"), ("scores",), (), False),
    "filter_groups": ("inference", ("metric",), (), (), False),
    "overlong_penalty": ("inference", ("response_mask", "task_scores"), ("scores",), (), False),
    "ppo_actor": (
        "train",
        (*_SEQ, "logprobs", "ref_logprobs", "values", "scores", *_TRUNC),
        (),
        ("lm",),
        True,
    ),
    "ppo_critic": (
        "train",
        (*_SEQ, "logprobs", "ref_logprobs", "values", "scores", *_TRUNC),
        (),
        ("value",),
        True,
    ),
    "grpo_actor": ("train", (*_SEQ, "logprobs", "ref_logprobs", "scores"), (), ("lm",), True),
    "rloo_actor": ("train", (*_SEQ, "logprobs", "ref_logprobs", "scores"), (), ("lm",), True),
    "reinforce_pp_actor": ("train", (*_SEQ, "logprobs", "ref_logprobs", "scores"), (), ("lm",), True),
    "remax_actor": (
        "train",
        (*_SEQ, "logprobs", "ref_logprobs", "scores", "greedy_scores"),
        (),
        ("lm",),
        True,
    ),
    "dpo": ("train", (*_PAIR, "ref_chosen_logps", "ref_rejected_logps"), (), ("lm",), True),
    "sft": ("train", _SEQ, (), ("lm",), True),
    "reward_model": ("train", _PAIR, (), ("score",), True),
}


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("catalogue fixture functions are for validation only")


# Optional trailing inputs and outputs (a node may leave them unbound), as they register.
OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"ppo_actor": _TRUNC, "ppo_critic": _TRUNC}
OPTIONAL_OUTPUTS: dict[str, tuple[str, ...]] = {
    "generate": _GEN_OPTIONAL,
    "values": ("bootstrap_values",),
}

# Inputs an argument asks for (the decoupled loss's proximal log-probs), as they register.
_PROX = ArgInput(
    "prox_logprobs",
    "decoupled_loss",
    (True,),
    "the proximal policy's log-probs [B,R]: an inference node (function: logprobs) on this node's model, "
    "upstream of it, with this node's temperature/top_k/top_p",
    own_forward=True,
)
# ... and the experts a generate node recorded per token, which route replay forces (MoE models)
_ROUTES = tuple(
    ArgInput(name, "route_replay", (True,),
             f"the {what} tokens' experts [B,{axis},Y,K] int (-1: none), a generate node's (record_routes)")
    for name, what, axis in (("prompt_routed_experts", "prompt", "S"), ("routed_experts", "response", "R"))
)  # fmt: skip
# ... and the truncation flags DAPO's over-long filtering reads (ppo_actor has `truncated` as an input)
_TRUNCATED = ArgInput(
    "truncated",
    "overlong_filter",
    (True,),
    "1 for a response cut at max_new_tokens without a stop token [B] (the generate node's output truncated)",
)
ARG_INPUTS: dict[str, tuple[ArgInput, ...]] = {
    "logprobs": _ROUTES,  # route replay in a π_prox / reference log-prob node
    "ppo_actor": (_PROX, *_ROUTES),
    **{
        name: (_PROX, *_ROUTES, _TRUNCATED)
        for name in ("grpo_actor", "rloo_actor", "remax_actor", "reinforce_pp_actor")
    },
}

# Group-wise functions (statistics within each prompt's group of samples) and why, as they register.
GROUP_WISE: dict[str, str] = {
    "grpo_actor": "GRPO normalises each reward by the mean and std of its prompt's group (Shao et al., 2024)",
    "rloo_actor": "RLOO's baseline is the mean reward of the other samples of the same prompt "
    "(Ahmadian et al., 2024)",
}


def make_catalogue_registry() -> Registry[NodeFunction]:
    """A fresh registry holding the contract's catalogue signatures, the pre-launch checks of the
    functions that register one (``rule_reward``: its reward must resolve) and the rule of the filter
    (``filter_groups``, with its argument schema)."""
    from rlflow.nodes.functions.filters import FILTER_ARGS, filter_rule
    from rlflow.nodes.functions.inference import rule_reward_mistakes

    checks = {"rule_reward": rule_reward_mistakes}
    # a filter's rule (dynamic sampling) splits the graph: its trait and the arguments the trait reads
    filters = {"filter_groups": (FILTER_ARGS, filter_rule)}
    reg: Registry[NodeFunction] = Registry("node function")
    for name, (kind, inputs, outputs, heads, needs_model) in CATALOGUE.items():
        reg.add(
            name,
            NodeFunction(
                name,
                kind,
                _unused,
                f"catalogue {name}",
                inputs,
                outputs,
                needs_model,
                heads,
                group_wise=GROUP_WISE.get(name),
                optional_inputs=OPTIONAL_INPUTS.get(name, ()),
                optional_outputs=OPTIONAL_OUTPUTS.get(name, ()),
                arg_inputs=ARG_INPUTS.get(name, ()),
                check=checks.get(name),
                args=filters[name][0] if name in filters else None,
                filters=filters[name][1] if name in filters else None,
            ),
        )
    return reg


@pytest.fixture
def catalogue_registry() -> Registry[NodeFunction]:
    """The contract's node-function catalogue as a registry (signatures only)."""
    return make_catalogue_registry()


# -- the two tiers and the parallel run (Makefile: `make test`, `make test-fast`) ------------------------
# `make test` runs every test on two pytest-xdist workers (`-n 2 --dist loadgroup`): tests go one by one to
# whichever worker is free, except those marked with the same `xdist_group` (tests sharing an engine, a
# process group or a Ray instance through a module fixture), which go to one worker together, so that the
# fixture starts once. `make test-fast` leaves out the tests marked `slow`; a test that starts a Python
# process must be one.

_STARTED: list[str] = []  # the Python processes the running test started


def _is_python(argv0: str) -> bool:
    """Whether ``argv0`` runs Python: this interpreter, or a console script installed beside it."""
    path = shutil.which(argv0) or argv0
    return os.path.basename(path).startswith("python") or os.path.dirname(path) == _BIN


_BIN = os.path.dirname(sys.executable)


def _watch_process_starts() -> None:
    """Record each Python process a test starts: ``multiprocessing`` processes, and ``subprocess`` runs of
    this interpreter or of a console script beside it (``rlflow``, ``mkdocs``)."""
    start, init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def watched_start(self: multiprocessing.process.BaseProcess) -> None:
        _STARTED.append(f"a multiprocessing process ({self.name})")
        start(self)

    def watched_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = shlex.split(args) if isinstance(args, str) else [os.fsdecode(a) for a in args]
        if argv and not kwargs.get("shell") and _is_python(kwargs.get("executable") or argv[0]):
            _STARTED.append(shlex.join(argv)[:200])
        init(self, args, *rest, **kwargs)

    multiprocessing.process.BaseProcess.start = watched_start  # type: ignore[method-assign]
    subprocess.Popen.__init__ = watched_init  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    # `rlflow run` draws each stage's dashboard at its end (seconds of matplotlib per run); the tests that
    # check dashboards ask for it (--dashboard), the hundreds of other runs skip it
    os.environ.setdefault("RLFLOW_DASHBOARD", "0")
    # a graph's string shaped like a Hub id (`no/tok`) is looked up in the Hugging Face cache only, never on
    # the Hub: the tests are the same with and without network (rlflow.dataflow.hub)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of two workers on two cores: one intra-op thread each,
        import torch  # for the processes a test starts too (CLI runs; workers set their own)

        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    _watch_process_starts()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _STARTED.clear()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A test that started a Python process (in its fixtures too) and is not marked ``slow`` fails at
    teardown: ``make test-fast`` runs the single-process tests only."""
    report: pytest.TestReport = yield
    if call.when == "teardown" and _STARTED and report.passed and not item.get_closest_marker("slow"):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a Python process but is not marked slow (make test-fast runs the "
            "single-process tests only): mark it @pytest.mark.slow. It started: " + "; ".join(_STARTED[:3])
        )
    return report


# The modules whose tests take longest, longest first (a serial run's durations, refreshed by hand from `make
# test`'s slowest-tests list when they change much): collected first, so that on two workers the longest
# tests start first and the quick ones fill the gaps at the end.
LONGEST_FIRST = (
    "test_vllm_tp.py",  # the suite's longest test (a tp-2 run killed, resumed, and its tp-1 control: 115 s)
    "test_engine_release.py",
    "test_engine_restart.py",
    "test_vllm_runs.py",
    "test_partial_rollouts.py",
    "test_lint.py",  # mypy: a minute and more in one process
    "test_ray_nodes.py",
    "test_dist_vllm_lora.py",  # one group: a 2-worker run and a single-process run, each with an engine
    "test_ray.py",
    "test_reshard.py",
    "test_restarts.py",
    "test_packaging.py",
    "test_reward_services.py",  # a vLLM server judging through both endpoints
    "test_async_resume.py",
    "test_readme_commands.py",
    "test_dist_pipeline.py",
    "test_dist_realloc.py",
    "test_zero.py",
    "test_signals.py",
    "test_vllm_engine.py",
    "test_dist_executor.py",
    "test_dist_layouts.py",
    "test_vllm_memory.py",
    "test_docs.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a ``--dist loadgroup`` worker, a test with an ``xdist_group`` mark must carry its group in its id
    (``…@group``: pytest-xdist's grouping); where the marks are ignored (pytest 9.2 with pytest-xdist 3.8)
    it fails before its fixtures start, rather than starting its group's engine or workers once per test."""
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
    if grouped and "@" not in item.nodeid:
        pytest.fail(
            f"pytest-xdist ignored this test's xdist_group mark under pytest {pytest.__version__}: install"
            " the versions pyproject.toml's dev extra pins",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules in ``LONGEST_FIRST`` order, then the other modules holding a ``slow`` test, then the rest; a
    module's tests stay together and in their order (a module fixture is built once; some modules' tests
    run in the order they are written)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.path not in slow))
