"""The docs site's reference pages, generated from the code at build time (an MkDocs hook).

``mkdocs.yml`` names this file under ``hooks:``; on every build (``make docs``, ``mkdocs serve``) its
:func:`on_files` adds these pages, which are never written by hand nor committed:

- ``reference/node-functions.md``: every registered node function (``rlflow functions``: kind, model head,
  inputs, outputs, argument schema) and the rewards, data generators, tools and environments a graph file
  may name, from the registries with their entry-point plug-ins loaded;
- ``reference/graph-file.md``: every key of a graph file, from the spec dataclasses (type and default of
  each field, the class's docstring);
- ``reference/cli.md``: ``rlflow --help`` and each subcommand's ``--help``, from the argument parser;
- ``reference/metrics.md``: the per-iteration metric names a run of each example graph writes (one
  iteration of each, run here in a temporary directory), the other names the source writes, and the live
  Prometheus metrics;
- ``index.md``, ``design.md``, ``reference/rl-maths.md``: the README, DESIGN.md and nodes/README.md, their
  links led to where they point in the site (:data:`REPOSITORY_PAGES`).

Run it alone to print one page: ``python3 scripts/docs_reference.py reference/cli.md``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import os
import re
import shutil
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("dataflow", "nodes", "schedulers")
# The families (first part of a name) the metric tables list, and the code's names for a name's variable
# part, shown as the runs' tables show them.
METRIC_FAMILIES = ("actor", "critic", "reward", "rollout", "async", "perf", "timing_s", "memory_bytes",
                   "response_length", "val", "env", "num_turns", "tool_call_counts", "realloc",
                   "moe", "overlong", "filter", "faults")  # fmt: skip
VARIABLE_PARTS = {"node": "<node>", "name": "<node>", "node_name": "<node>", "ctx.node.name": "<node>",
                  "w": "<worker>", "worker": "<worker>", "rank": "<worker>"}  # fmt: skip

# The example graphs whose one-iteration runs give the metric table: (label, graph file, extra overrides).
# Graph files that read another run's checkpoint start from their twins' random weights instead; vLLM's
# examples are left out (an engine start takes tens of seconds; their metrics are the built-in twins' plus
# the weight sync's, listed under "Other names").
METRIC_RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ppo", "examples/ppo.yaml", ()),
    ("grpo", "examples/grpo.yaml", ()),
    ("grpo_decoupled", "examples/grpo_decoupled.yaml", ()),
    ("rloo", "examples/rloo.yaml", ()),
    ("remax", "examples/remax.yaml", ()),
    ("reinforce_pp", "examples/reinforce_pp.yaml", ()),
    ("sapo", "examples/sapo.yaml", ()),
    ("dapo_overlong", "examples/dapo_overlong.yaml", ()),
    ("dpo", "examples/dpo.yaml", ()),
    ("sft", "examples/sft.yaml", ()),
    ("reward_model", "examples/reward_model.yaml", ()),
    ("dapo", "examples/dapo.yaml", ()),
    ("ppo-async", "examples/ppo.yaml", ("nodes.actor_gen.staleness=1",)),
    ("search-sft", "examples/search/sft.yaml", ("run.eval_interval=1", "run.eval.size=2")),
)


# -- text helpers -------------------------------------------------------------------------------------------
def rst_to_md(text: str) -> str:
    """A docstring's reST inline markup as Markdown: ``x`` -> `x`, :func:`a.b` -> `b`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    return text.replace("``", "`")


def docstring(obj: Any) -> str:
    """``obj``'s docstring, dedented, as Markdown paragraphs."""
    import inspect

    return rst_to_md(inspect.cleandoc(obj.__doc__ or ""))


def first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first paragraph, on one line ("et al." and "e.g." do not end it)."""
    paragraph = " ".join(text.split("\n\n", 1)[0].split())
    return (
        re.split(r"(?<!\bal)(?<!\beq)(?<!e\.g)(?<!i\.e)\.(?:\s|$)", paragraph, maxsplit=1)[0].rstrip(".")
        + "."
    )


def cell(text: str) -> str:
    """``text`` fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def type_text(tp: Any) -> str:
    """A field's annotation in a few words (``int``, ``str | None``, ``OptimizerSpec``)."""
    if isinstance(tp, type):
        return tp.__name__
    text = str(tp).replace("typing.", "").replace("NoneType", "None")
    return re.sub(r"\b[\w.]+\.(\w+)", r"\1", text)


def default_text(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if dataclasses.is_dataclass(value):
        return "its defaults"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`" if value not in ({}, []) else f"`{value!r}`"


# -- node functions ---------------------------------------------------------------------------------------
def node_functions_page() -> str:
    from rlflow.dataflow.data import DATA_GENERATORS
    from rlflow.dataflow.registry import NODE_FUNCTIONS
    from rlflow.nodes.agent.env import ENVIRONMENTS, TOOLS
    from rlflow.nodes.rewards import REWARD_FUNCTIONS

    out = [
        "# Node functions (reference)",
        "",
        "Generated from the registry when the site is built: what `rlflow functions` prints, and what graph",
        "validation checks a node against. Plug-ins installed through entry points appear here too. How a",
        "node binds these inputs and outputs to batch keys: [Node functions](../node-functions.md).",
        "",
    ]
    kinds: dict[str, list[str]] = {}
    for name in NODE_FUNCTIONS.names():
        kinds.setdefault(NODE_FUNCTIONS.get(name).kind, []).append(name)
    out.append("| function | kind | does |")
    out.append("|---|---|---|")
    for kind in ("generate", "inference", "train"):
        for name in kinds.get(kind, []):
            fn = NODE_FUNCTIONS.get(name)
            summary = first_sentence(docstring(fn.fn))
            out.append(f"| [`{name}`](#{name}) | {kind} | {cell(summary)} |")
    out.append("")
    for kind in ("generate", "inference", "train"):
        for name in kinds.get(kind, []):
            out.extend(function_section(NODE_FUNCTIONS.get(name)))
    dotted = "; a dotted path `pkg.mod:name` names one outside the registry"
    for title, registry, what in (
        ("Rule rewards", REWARD_FUNCTIONS, "`rule_reward`'s `fn:` and `run.eval.reward:` name one" + dotted),
        ("Data generators", DATA_GENERATORS, "`data.generator.name:` names one"),
        ("Agent tools", TOOLS, "`agent_generate`'s `tools:` names them" + dotted),
        ("Agent environments", ENVIRONMENTS, "`agent_generate`'s `env:` names one" + dotted),
    ):
        out += ["", f"## {title}", "", f"Registered names ({what}):", ""]
        names = registry.names()
        if not names:
            out.append("(none registered by rlflow itself)")
        for name in names:
            obj = registry.get(name)
            first = first_sentence(docstring(obj))
            out.append(f"- `{name}`: {first}" if first else f"- `{name}`")
    return "\n".join(out) + "\n"


def function_section(fn: Any) -> list[str]:
    from rlflow.dataflow.args import Arg

    def params(names: tuple[str, ...], optional: tuple[str, ...]) -> str:
        required = names[: len(names) - len(optional)]
        text = ", ".join(f"`{n}`" for n in required) or "(none)"
        return text + (f"; optional: {', '.join(f'`{n}`' for n in optional)}" if optional else "")

    if fn.heads:
        model = f"a model with head {' or '.join(f'`{h}`' for h in fn.heads)}"
    else:
        model = "any model" if fn.needs_model else "no model"
    lines = ["", f"## `{fn.name}`", "", f"*{fn.kind}* node, {model}.", "", docstring(fn.fn), ""]
    lines.append(f"- **inputs:** {params(fn.inputs, fn.optional_inputs)}")
    for extra in fn.arg_inputs:
        when = " or ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in extra.values)
        lines.append(f"    - `{extra.name}` when `{extra.arg}` is `{when}`: {rst_to_md(extra.doc)}")
    lines.append(f"- **outputs:** {params(fn.outputs, fn.optional_outputs)}")
    if fn.group_wise:
        lines.append(f"- **group-wise:** {rst_to_md(fn.group_wise)}")
    lines.append("")
    if fn.args is None:
        lines.append("Arguments: not declared (checked by name against the function's keyword parameters).")
        return lines
    if not fn.args:
        lines.append("Arguments: none.")
    else:
        lines += ["| argument | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for a in fn.args:
            assert isinstance(a, Arg)
            default = (
                "null"
                if a.default is None
                else str(a.default).lower()
                if isinstance(a.default, bool)
                else a.default
            )
            meaning = rst_to_md(a.doc)
            if a.needs:
                meaning += f"; read only when `{a.needs[0]}` is {' or '.join(map(str, a.needs[1]))}"
            if a.excludes:
                meaning += f"; not with `{a.excludes[0]}` {' or '.join(map(str, a.excludes[1]))}"
            if a.source:
                meaning += f" ({a.source})"
            row = [f"`{a.name}`", cell(a.type_text()), f"`{default}`", cell(a.range_text()), cell(meaning)]
            lines.append(f"| {' | '.join(row)} |")
    if fn.extra_args:
        lines += ["", f"Other names under `args:`: {rst_to_md(fn.extra_args)}."]
    return lines


# -- graph-file keys --------------------------------------------------------------------------------------
def graph_file_page() -> str:
    from rlflow.dataflow import data_spec, model_spec, node_spec, plan_spec, run_spec, spec

    sections: tuple[tuple[str, type, str], ...] = (
        ("Top level", spec.GraphSpec, ""),
        ("`models.<name>`", model_spec.ModelSpec, "name"),
        ("`models.<name>.optimizer`", model_spec.OptimizerSpec, ""),
        ("`models.<name>.ema`", model_spec.EmaSpec, ""),
        ("`data`", data_spec.DataSpec, ""),
        ("`data.generator`", data_spec.GeneratorSpec, ""),
        ("`data.dataset`", data_spec.DatasetSpec, ""),
        ("`nodes.<name>`", node_spec.NodeSpec, "name"),
        ("`nodes.<name>.deepspeed`", node_spec.DeepSpeedSpec, ""),
        ("`plan.<node>`", plan_spec.NodePlacement, ""),
        ("`plan.<node>.layout`", plan_spec.Layout, ""),
        ("`run`", run_spec.RunSpec, ""),
    )
    out = [
        "# Graph-file keys (reference)",
        "",
        "Generated from the `rlflow.dataflow.*_spec` dataclasses when the site is built: every key a graph",
        "file may hold, its type and its default. A node's `args:` are its function's, listed in",
        "[Node functions (reference)](node-functions.md). What the sections mean:",
        "[Graph files](../graph-files.md).",
        "",
    ]
    for title, cls, skip in sections:
        hints = typing.get_type_hints(cls)
        out += [f"## {title}", "", f"`{cls.__name__}`: {docstring(cls)}", "", "| key | type | default |"]
        out.append("|---|---|---|")
        for f in dataclasses.fields(cls):
            if f.name in (skip, "source"):
                continue
            out.append(f"| `{f.name}` | {cell(type_text(hints[f.name]))} | {cell(default_text(f))} |")
        if cls is run_spec.RunSpec:
            keys = ", ".join(f"`{k}`" for k in run_spec.EVAL_KEYS)
            out += ["", f"`run.eval` takes the keys {keys}."]
        if cls is plan_spec.Layout:
            out += ["", "Written as one string: `d2t2p1m4` (data, tensor, pipeline parallel, micro-batches)."]
        out.append("")
    return "\n".join(out)


# -- the command line -------------------------------------------------------------------------------------
def help_text(argv: list[str]) -> str:
    from rlflow.schedulers.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        main(argv)
    return buffer.getvalue().rstrip()


def cli_page() -> str:
    from rlflow.schedulers.cli import COMMANDS

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: the same page everywhere
    out = [
        "# Command line (reference)",
        "",
        "Generated from the argument parser when the site is built. How the commands fit together:",
        "[The command line](../cli.md).",
        "",
        "## `rlflow`",
        "",
        "```text",
        help_text(["--help"]),
        "```",
    ]
    for name in COMMANDS:
        out += ["", f"## `rlflow {name}`", "", "```text", help_text([name, "--help"]), "```"]
    return "\n".join(out) + "\n"


# -- metric names -----------------------------------------------------------------------------------------
def observed_metrics() -> dict[str, list[str]]:
    """Metric name -> the labels of the runs in :data:`METRIC_RUNS` that wrote it (one iteration each)."""
    import pyarrow.parquet as pq

    from rlflow.schedulers.cli import main

    seen: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-docs-") as tmp:
        shutil.copytree(ROOT / "examples", Path(tmp) / "examples")
        cwd = Path.cwd()
        os.chdir(tmp)
        try:
            for i, (label, graph, extra) in enumerate(METRIC_RUNS):
                out_dir = f"runs/m{i}"
                argv = ["run", graph, "run.iterations=1", "run.checkpoint_interval=0", "run.eval_interval=0"]
                argv += [*extra, f"run.output_dir={out_dir}"]
                if label == "search-sft":
                    argv.remove("run.eval_interval=0")
                buffer = io.StringIO()
                with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                    status = main(argv)
                if status != 0:
                    raise RuntimeError(f"docs: `rlflow {' '.join(argv)}` failed:\n{buffer.getvalue()}")
                for path in sorted(Path(out_dir, "metrics").glob("*.parquet")):
                    for name in pq.read_schema(path).names:
                        if name != "iteration" and label not in seen.setdefault(name, []):
                            seen[name].append(label)
        finally:
            os.chdir(cwd)
    return seen


def example_nodes() -> set[str]:
    """The node names of the graphs in :data:`METRIC_RUNS`."""
    import yaml

    return {
        n
        for _label, graph, _extra in METRIC_RUNS
        for n in yaml.safe_load((ROOT / graph).read_text())["nodes"]
    }


def generic(name: str, nodes: set[str]) -> str:
    """A per-node or per-worker metric name with its variable part as ``<node>``/``<worker>``."""
    parts = name.split("/")
    if parts[-1] in nodes:
        parts[-1] = "<node>"
    elif parts[-1].isdigit():
        parts[-1] = "<worker>"
    return "/".join(parts)


def source_metric_names() -> dict[str, set[str]]:
    """Metric-like names written as literals in the source -> the modules holding them (f-string parts as
    ``<expr>``); names under the prefixes the runs of :data:`METRIC_RUNS` use."""
    found: dict[str, set[str]] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = "rlflow." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                text = literal_text(node)
                if text and re.fullmatch(r"[a-z_]+(/[a-z_<>0-9{}.]+)+", text):
                    found.setdefault(text, set()).add(module.removesuffix(".__init__"))
    return found


def literal_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                expr = ast.unparse(value.value)
                parts.append(VARIABLE_PARTS.get(expr, f"<{expr}>"))
        return "".join(parts)
    return None


def metrics_page() -> str:
    from rlflow.schedulers.records import telemetry

    observed = observed_metrics()
    nodes = example_nodes()
    by_generic: dict[str, list[str]] = {}
    for name, labels in observed.items():
        for label in labels:
            if label not in by_generic.setdefault(generic(name, nodes), []):
                by_generic[generic(name, nodes)].append(label)
    labels = [label for label, _graph, _extra in METRIC_RUNS]
    out = [
        "# Metric names (reference)",
        "",
        "Generated when the site is built. What each family means: [Records and dashboards](../records.md).",
        "",
        "## Written by the example graphs",
        "",
        "Every metric a one-iteration run of each example graph wrote into its `metrics/*.parquet`",
        "(one process, evaluation off except for the search agent's SFT), per-node and per-worker names with",
        "`<node>` / `<worker>` in place of the name. Runs: "
        + ", ".join(
            f"**{label}** (`{graph}`{' ' + ' '.join(extra) if extra else ''})"
            for label, graph, extra in METRIC_RUNS
        )
        + ".",
        "",
        "| metric | written by |",
        "|---|---|",
    ]
    for name in sorted(by_generic):
        written = by_generic[name]
        who = "every run" if len(written) == len(labels) else ", ".join(written)
        out.append(f"| `{name}` | {who} |")
    others = {
        name: modules
        for name, modules in source_metric_names().items()
        if name.split("/", 1)[0] in METRIC_FAMILIES and name not in by_generic and not name.endswith("/")
    }
    out += [
        "",
        "## Other names in the source",
        "",
        "Metric names in the source's string literals that the runs above did not write: those of several",
        "workers, the vLLM engine, agents' rollouts and environment errors, reallocation, and a few that",
        "the dashboard or the Prometheus exporter read when a run has them. `<…>` is the code's own",
        "expression for a variable part (`actor/<k>`: a family of names under `actor/`).",
        "",
        "| name | module |",
        "|---|---|",
    ]
    for name in sorted(others):
        out.append(f"| `{name}` | {', '.join(f'`{m}`' for m in sorted(others[name]))} |")
    out += [
        "",
        "## Live Prometheus metrics",
        "",
        "`rlflow run --metrics-port PORT` serves these (from `rlflow.schedulers.records.telemetry`):",
        "",
        "```text",
        prometheus_table(telemetry.__doc__ or ""),
        "```",
        "",
        "Names: " + ", ".join(f"`{n}`" for n in telemetry.METRIC_NAMES) + ".",
    ]
    return "\n".join(out) + "\n"


def prometheus_table(doc: str) -> str:
    """The reST table of the telemetry module's docstring, as plain text."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("===="))
    end = max(i for i, line in enumerate(lines) if line.startswith("===="))
    return "\n".join(lines[start : end + 1]).replace("``", "")


# The repository's own documents that are pages of the site too: page -> file.
REPOSITORY_PAGES: dict[str, str] = {
    "index.md": "README.md",
    "design.md": "DESIGN.md",
    "reference/rl-maths.md": "nodes/README.md",
}


def repository_page(page: str) -> str:
    """The repository file of ``page`` with its relative links pointing where they lead in the site: a
    page of ``docs/`` or another document of :data:`REPOSITORY_PAGES`; a link to anything else becomes its
    path in code font (the site holds no copy of it)."""
    source = REPOSITORY_PAGES[page]
    site_of = {file: target for target, file in REPOSITORY_PAGES.items()}
    depth = page.count("/")

    def link(match: re.Match[str]) -> str:
        text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
        if re.match(r"[a-z]+:", target):
            return match.group(0)
        path = (ROOT / source).parent.joinpath(target).resolve().relative_to(ROOT).as_posix()
        if path.startswith("docs/"):
            return f"[{text}]({'../' * depth}{path.removeprefix('docs/')}{anchor})"
        if path in site_of:
            return f"[{text}]({'../' * depth}{site_of[path]}{anchor})"
        return text if text.startswith("`") else f"{text} (`{path}`)"

    return re.sub(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)]*)?\)", link, (ROOT / source).read_text())


PAGES: dict[str, Callable[[], str]] = {
    "reference/node-functions.md": node_functions_page,
    "reference/graph-file.md": graph_file_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
}


def generated() -> Iterator[tuple[str, str]]:
    """(page path under docs/, Markdown) for every generated page."""
    for path, make in PAGES.items():
        yield path, make()
    for path in REPOSITORY_PAGES:
        yield path, repository_page(path)


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for path, text in generated():
        files.append(File.generated(config, path, content=text))
    return files


if __name__ == "__main__":
    for wanted in sys.argv[1:] or [*PAGES, *REPOSITORY_PAGES]:
        print(PAGES[wanted]() if wanted in PAGES else repository_page(wanted))
