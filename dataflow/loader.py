"""Loading graph files (YAML, omegaconf) into :class:`~rlflow.dataflow.spec.GraphSpec` and :class:`Graph`.

Steps: parse YAML -> merge dotted overrides (``models.actor.optimizer.lr=1e-6``) -> report ``algorithm``
keys nothing reads (an error for an override, a warning otherwise) -> resolve ``${...}``
interpolations -> check every field name (unknown ones get a "did you mean") and type -> build the spec
dataclasses -> (graphs) resolve Hub ids of models and tokenizers to their local snapshots
(:func:`~rlflow.dataflow.hub.resolve_hub_models`) -> :meth:`Graph.from_spec`. Every mistake raises
:class:`GraphError` or :class:`PlanError` (a Hub id that does not resolve: :class:`ModelError`) whose message
starts with the file name and the key path; no library exception escapes.
"""

from __future__ import annotations

import dataclasses
import io
import re
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rlflow.dataflow.data_spec import DatasetSpec, DataSpec, GeneratorSpec
from rlflow.dataflow.errors import GraphError, PlanError, RlflowError, did_you_mean
from rlflow.dataflow.fields import plural
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.hub import resolve_hub_models
from rlflow.dataflow.model_spec import EmaSpec, LoraSpec, ModelSpec, OptimizerSpec
from rlflow.dataflow.node_spec import DeepSpeedSpec, NodeSpec
from rlflow.dataflow.plan_spec import (
    MAX_DEVICES,
    Layout,
    NodePlacement,
    Plan,
    check_decision_list,
    check_plan_engine,
    check_plan_flag,
    check_plan_share,
    parse_devices,
)
from rlflow.dataflow.registry import NodeFunction, Registry
from rlflow.dataflow.run_spec import RunSpec
from rlflow.dataflow.spec import GraphSpec

__all__ = ["load_graph", "load_spec", "loads_graph", "loads_spec", "plan_placements", "spec_from_dict"]

# Largest graph file read; guards against pointing the loader at a data set by mistake.
_MAX_BYTES = 16 * 1024 * 1024


def _fields(cls: type, drop: tuple[str, ...] = ("name",)) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in drop)


TOP_FIELDS = ("models", "data", "algorithm", "nodes", "plan", "run")
MODEL_FIELDS = _fields(ModelSpec)
OPTIMIZER_FIELDS = _fields(OptimizerSpec)
EMA_FIELDS = _fields(EmaSpec, ())
LORA_FIELDS = _fields(LoraSpec, ())
DEEPSPEED_FIELDS = _fields(DeepSpeedSpec, ())
DATA_FIELDS = _fields(DataSpec)
GENERATOR_FIELDS = _fields(GeneratorSpec, ())
DATASET_FIELDS = _fields(DatasetSpec, ())
NODE_FIELDS = _fields(NodeSpec)
RUN_FIELDS = _fields(RunSpec)
PLACEMENT_FIELDS = (
    "devices", "layout", "engine", "recompute", "reshard", "gpu_memory_utilization", "searched", "pinned"
)  # fmt: skip


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@contextmanager
def _at(source: str, prefix: str = "") -> Iterator[None]:
    """Re-raise rlflow errors from spec constructors with the file name and key-path prefix."""
    try:
        yield
    except RlflowError as e:
        raise type(e)(f"{source}: {prefix}{e}") from None


def _mapping(source: str, path: str, value: object, allowed: Sequence[str] | None = None) -> dict[str, Any]:
    """``value`` as a dict with string keys; with ``allowed``, unknown keys raise with a suggestion."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise GraphError(f"{source}: {path}: expected a mapping, got {_show(value)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise GraphError(f"{source}: {path}: keys must be strings, got {_show(key)}")
        if allowed is not None and key not in allowed:
            where = f"{path}." if path else ""
            raise GraphError(
                f"{source}: {where}{key}: unknown field '{key}'{did_you_mean(key, allowed)}; "
                f"fields{f' of {path}' if path else ''}: {', '.join(allowed)}"
            )
        out[key] = item
    return out


def _require(source: str, path: str, d: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in d or d[key] is None:
            raise GraphError(f"{source}: {path}: missing required field '{key}'")


def _build(source: str, prefix: str, ctor: Callable[..., Any], /, **kwargs: Any) -> Any:
    with _at(source, prefix):
        return ctor(**kwargs)


# -- YAML and omegaconf ---------------------------------------------------------------------------------
def _yaml_loader() -> Any:
    """omegaconf's YAML loader (same number parsing as omegaconf, e.g. ``1e-6`` is a float; limits alias
    expansion). It moved between omegaconf releases."""
    try:
        from omegaconf._yaml import get_yaml_loader  # type: ignore[import-not-found]  # omegaconf >= 2.4
    except ImportError:
        from omegaconf._utils import get_yaml_loader  # type: ignore[attr-defined,no-redef]  # omegaconf 2.3
    return get_yaml_loader()


def _parse(text: str, source: str) -> DictConfig:
    stream = io.StringIO(text)
    stream.name = source  # PyYAML's marks name the stream: the file, not "<unicode string>"
    try:
        raw = yaml.load(stream, Loader=_yaml_loader())
    except yaml.YAMLError as e:
        raise GraphError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise GraphError(f"{source}: not valid YAML: nested too deeply") from None
    if raw is None:
        raise GraphError(f"{source}: the file is empty; a graph file needs models, data and nodes")
    if not isinstance(raw, dict):
        raise GraphError(
            f"{source}: the top level must be a mapping with models, data, nodes, ...; got {_show(raw)}"
        )
    try:
        cfg = OmegaConf.create(raw)
    except Exception as e:  # omegaconf rejects some YAML values (e.g. non-string keys of odd types)
        raise GraphError(f"{source}: cannot read the graph: {str(e).splitlines()[0]}") from None
    assert isinstance(cfg, DictConfig)
    return cfg


def _check_override_targets(cfg: DictConfig, overrides: Sequence[str], source: str) -> None:
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise GraphError(f"{source}: override {_show(item)}: expected key.path=value")
        path = item.split("=", 1)[0].strip().split(".")
        if len(path) >= 2 and path[0] in ("models", "nodes", "plan"):
            section = cfg.get(path[0]) if path[0] in cfg else None
            if isinstance(section, DictConfig) and path[1] not in section:
                what = {"models": "model", "nodes": "node", "plan": "plan entry"}[path[0]]
                raise GraphError(
                    f"{source}: override '{item}': no {what} '{path[1]}'"
                    f"{did_you_mean(path[1], list(section.keys()))}"
                )


def _merge_overrides(cfg: DictConfig, overrides: Sequence[str], source: str) -> DictConfig:
    if not overrides:
        return cfg
    _check_override_targets(cfg, overrides, source)
    try:
        merged = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except Exception as e:
        raise GraphError(_override_mistake(cfg, overrides, source, e)) from None
    assert isinstance(merged, DictConfig)
    return merged


def _override_mistake(cfg: DictConfig, overrides: Sequence[str], source: str, error: Exception) -> str:
    """The message of overrides omegaconf could not merge: the first override that fails on its own (merged
    over the file and the overrides before it), and why: a list where the file has a mapping or the
    reverse (a dotted key below a list: omegaconf merges a mapping there), else omegaconf's reason."""
    done: Any = cfg
    for item in overrides:
        try:
            done = OmegaConf.merge(done, OmegaConf.from_dotlist([item]))
        except Exception as e:
            key = item.split("=", 1)[0].strip()
            why = _container_clash(done, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key))
            return f"{source}: override '{item}': {why or str(e).splitlines()[0]}"
    return f"{source}: cannot apply overrides {list(overrides)}: {str(error).splitlines()[0]}"


def _container_clash(cfg: Any, key: str, value: Any) -> str | None:
    """Why ``key=value`` cannot merge over ``cfg``: a list on the way to ``key`` (a dotted key below it, or
    ``key`` itself given a mapping), or a mapping at ``key`` given a list; None if neither."""
    parts = key.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        if isinstance(node, ListConfig):
            at = ".".join(parts[:i])
            return (
                f"{at} is a list in the file (of {plural(len(node), 'item')}), and an override sets a list "
                f"whole, not an item or a key below it: give the whole list, {at}=[...]"
            )
        if not isinstance(node, DictConfig) or part not in node:
            return None
        try:
            node = node[part]
        except Exception:  # an interpolation that does not resolve yet: no container to name
            return None
    if isinstance(node, ListConfig) and isinstance(value, DictConfig):
        return f"{key} is a list in the file and the override gives a mapping: give a list, {key}=[...]"
    if isinstance(node, DictConfig) and isinstance(value, ListConfig):
        return (
            f"{key} is a mapping in the file and the override gives a list: a list cannot be merged over a "
            f"mapping; set its keys ({key}.NAME=value), or write the list in the file"
        )
    return None


_ALGORITHM_REF = re.compile(r"\$\{[^}]*?\balgorithm\.([A-Za-z0-9_]+)")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _check_algorithm_keys(cfg: DictConfig, source: str, overrides: Sequence[str]) -> None:
    """Report keys of the free-form ``algorithm:`` section that nothing reads (no ``${algorithm.KEY}`` in
    the file): they do nothing.

    One set on the command line (``algorithm.kl_cof=0.5``) is an error: it was meant to change the run and
    would not (a typo, most likely). One written in the file is a :class:`GraphWarning`: the file runs as
    written, and a key may be kept for the reader or for later; the warning still says it does nothing.
    """
    raw = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(raw, dict)
    algorithm = raw.get("algorithm")
    if not isinstance(algorithm, Mapping):
        return  # absent, or not a mapping: spec construction reports the latter
    read = {m for text in _strings(raw) for m in _ALGORITHM_REF.findall(text)}
    overridden = {str(o).split("=", 1)[0].strip() for o in overrides}
    for key in algorithm:
        if key in read:
            continue
        msg = (
            f"{source}: algorithm.{key}: no node reads it (nothing in the file refers to "
            f"${{algorithm.{key}}}){did_you_mean(str(key), sorted(read))}; refer to it from a node's args or "
            "remove it"
            f"{'; keys read: ' + ', '.join(sorted(read)) if read else ''}"
        )
        if f"algorithm.{key}" in overridden:
            raise GraphError(msg.replace(f"algorithm.{key}:", f"override 'algorithm.{key}':", 1))
        warnings.warn(GraphWarning(msg), stacklevel=4)


def _resolve(node: Any, path: str, source: str) -> Any:
    """Plain containers from ``node``, resolving interpolations; a failure names the key path."""
    if isinstance(node, DictConfig):
        out: dict[Any, Any] = {}
        for key in list(node.keys()):
            sub = f"{path}.{key!s}" if path else str(key)
            try:
                value = node[key]
            except Exception as e:
                raise GraphError(f"{source}: {sub}: {_interp_message(node, key, e)}") from None
            out[key] = _resolve(value, sub, source)
        return out
    if isinstance(node, ListConfig):
        items = []
        for i in range(len(node)):
            sub = f"{path}[{i}]"
            try:
                value = node[i]
            except Exception as e:
                raise GraphError(f"{source}: {sub}: {_interp_message(node, i, e)}") from None
            items.append(_resolve(value, sub, source))
        return items
    return node


def _interp_message(node: DictConfig | ListConfig, key: Any, e: Exception) -> str:
    try:
        raw = node._get_node(key)._value()  # type: ignore[union-attr]  # the text as written: '${a.n}'
    except Exception:
        raw = None
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, RecursionError):
        first = "interpolation refers to itself"
    return f"cannot resolve {raw!r}: {first}" if isinstance(raw, str) else first


# -- spec construction ----------------------------------------------------------------------------------
def _model(source: str, name: str, raw: object) -> ModelSpec:
    p = f"models.{name}"
    d = _mapping(source, p, raw, MODEL_FIELDS)
    if "optimizer" in d:
        opt = _mapping(source, f"{p}.optimizer", d["optimizer"], OPTIMIZER_FIELDS)
        if "betas" in opt and isinstance(opt["betas"], list):
            opt["betas"] = tuple(opt["betas"])
        d["optimizer"] = _build(source, f"{p}.", OptimizerSpec, **opt)
    if d.get("ema") is not None:
        ema = _mapping(source, f"{p}.ema", d["ema"], EMA_FIELDS)
        d["ema"] = _build(source, f"{p}.", EmaSpec, **ema)
    if d.get("lora") is not None:
        lora = _mapping(source, f"{p}.lora", d["lora"], LORA_FIELDS)
        if isinstance(lora.get("target_modules"), list):
            lora["target_modules"] = tuple(lora["target_modules"])
        d["lora"] = _build(source, f"{p}.", LoraSpec, **lora)
    if d.get("config") is not None:
        d["config"] = _mapping(source, f"{p}.config", d["config"])
    return _build(source, "", ModelSpec, name=name, **{k: v for k, v in d.items() if v is not None})


def _data(source: str, raw: object) -> DataSpec:
    d = _mapping(source, "data", raw, DATA_FIELDS)
    if d.get("generator") is not None:
        g = _mapping(source, "data.generator", d["generator"], GENERATOR_FIELDS)
        _require(source, "data.generator", g, "name")
        g["args"] = _mapping(source, "data.generator.args", g.get("args"))
        d["generator"] = _build(source, "", GeneratorSpec, **g)
    if d.get("dataset") is not None:
        s = _mapping(source, "data.dataset", d["dataset"], DATASET_FIELDS)
        _require(source, "data.dataset", s, "path")
        s["filter"] = _mapping(source, "data.dataset.filter", s.get("filter"))
        d["dataset"] = _build(source, "", DatasetSpec, **{k: v for k, v in s.items() if v is not None})
    d["fields"] = _mapping(source, "data.fields", d.get("fields"))
    if isinstance(d.get("tokenize"), list):
        d["tokenize"] = tuple(d["tokenize"])
    return _build(source, "", DataSpec, **{k: v for k, v in d.items() if v is not None})


def _node(source: str, name: str, raw: object) -> NodeSpec:
    p = f"nodes.{name}"
    d = _mapping(source, p, raw, NODE_FIELDS)
    _require(source, p, d, "kind", "function")
    for what in ("inputs", "outputs"):
        value = d.get(what)
        if isinstance(value, list):
            d[what] = tuple(value)
        elif isinstance(value, Mapping):
            d[what] = _mapping(source, f"{p}.{what}", value)
    d["args"] = _mapping(source, f"{p}.args", d.get("args"))
    if d.get("deepspeed") is not None:
        ds = _mapping(source, f"{p}.deepspeed", d["deepspeed"], DEEPSPEED_FIELDS)
        d["deepspeed"] = _build(source, f"{p}.", DeepSpeedSpec, **ds)
    return _build(source, "", NodeSpec, name=name, **{k: v for k, v in d.items() if v is not None})


def _run(source: str, raw: object, default_output: str) -> RunSpec:
    d = _mapping(source, "run", raw, RUN_FIELDS)
    if "output_dir" in d and d["output_dir"] is None:
        # an empty override (`run.output_dir=`) or `output_dir:` parses as null; the default directory
        # in its place would mix this run's records with another's
        raise GraphError(
            f"{source}: run.output_dir: expected a non-empty string, got null (an empty value); name a "
            f"directory, or leave the key out for the default {default_output!r}"
        )
    d.setdefault("output_dir", default_output)
    return _build(source, "", RunSpec, **{k: v for k, v in d.items() if v is not None})


def _plan(source: str, raw: object, run: RunSpec) -> Plan:
    if raw is None:
        return {}
    if raw == "auto":
        return "auto"
    if not isinstance(raw, Mapping):
        raise PlanError(
            f"{source}: plan: expected 'auto' or a mapping node -> {{devices, layout}}, got {_show(raw)}"
        )
    return plan_placements(source, raw, run.devices)


def plan_placements(
    source: str, raw: Mapping[Any, Any], limit: int = MAX_DEVICES
) -> dict[str, NodePlacement]:
    """Node -> placement from a plan mapping ``{node: {devices, layout[, engine, recompute, reshard]}}`` (and
    the record ``rlflow plan`` writes beside them, ``searched`` / ``pinned``: lists of decision names,
    ``plan_spec.DECISIONS``, checked and not acted on; a plan file without them loads the same):
    a graph file's ``plan:`` section, and plan files (``rlflow run --plan``,
    ``rlflow.schedulers.planner.plans.load_plan``), so both name their mistakes alike. Whether each node
    exists and each device is in ``run.devices`` is the graph's check (``Graph``); ``limit``: the number of
    devices an id must stay under (a graph file's ``run.devices``).

    Raises:
        GraphError: an entry that is not a mapping, an unknown or missing field;
        PlanError: bad devices, layout, engine or flag. Each message starts ``<source>: plan.<node>``
            and names the key (``plan.<node>.layout ...``).
    """
    plan: dict[str, NodePlacement] = {}
    for name, entry in _mapping(source, "plan", raw).items():
        p = f"plan.{name}"
        e = _mapping(source, p, entry, PLACEMENT_FIELDS)
        _require(source, p, e, "devices", "layout")
        with _at(source, f"{p}."):
            devices = parse_devices(e["devices"], limit=limit)
        with _at(source, f"{p}."):
            layout = Layout.parse(e["layout"])
        with _at(source, f"{p}."):
            engine = check_plan_engine(e.get("engine"))
        with _at(source, f"{p}."):
            recompute = check_plan_flag("recompute", e.get("recompute"))
        with _at(source, f"{p}."):
            reshard = check_plan_flag("reshard", e.get("reshard"))
        for record in ("searched", "pinned"):  # what `rlflow plan` decided: a record, checked, not acted on
            with _at(source, f"{p}."):
                check_decision_list(record, e.get(record))
        with _at(source, f"{p}."):
            share = check_plan_share(e.get("gpu_memory_utilization"))
        with _at(source, f"{p}: "):
            plan[name] = NodePlacement(devices, layout, engine, recompute, reshard, share)
    return plan


def spec_from_dict(raw: Mapping[str, Any], source: str = "") -> GraphSpec:
    """Build a :class:`GraphSpec` from plain containers in graph-file form (interpolations resolved).

    Raises:
        GraphError / PlanError: naming ``source`` and the key path of the first mistake.
    """
    src = source or "<graph>"
    top = _mapping(src, "", raw, TOP_FIELDS)
    _require(src, "graph", top, "models", "data", "nodes")
    models = {name: _model(src, name, m) for name, m in _mapping(src, "models", top["models"]).items()}
    if not models:
        raise GraphError(f"{src}: models: the graph names no models")
    data = _data(src, top["data"])
    nodes = {name: _node(src, name, n) for name, n in _mapping(src, "nodes", top["nodes"]).items()}
    algorithm = _mapping(src, "algorithm", top.get("algorithm"))
    stem = Path(source).stem if source and not source.startswith("<") else "rlflow"
    run = _run(src, top.get("run"), f"runs/{stem}")
    plan = _plan(src, top.get("plan"), run)
    with _at(src):
        return GraphSpec(
            models=models, nodes=nodes, data=data, algorithm=algorithm, plan=plan, run=run, source=source
        )


def loads_spec(text: str, source: str = "<string>", overrides: Sequence[str] = ()) -> GraphSpec:
    """Parse graph-file text, apply ``overrides`` (``key.path=value``), resolve, and build the spec."""
    cfg = _merge_overrides(_parse(text, source), overrides, source)
    _check_algorithm_keys(cfg, source, overrides)
    raw = _resolve(cfg, "", source)
    return spec_from_dict(raw, source)


def _read(path: str | Path) -> str:
    p = Path(path)
    try:
        # a FIFO, a device or a socket would block the read (or never end): only a regular file is read
        if not stat.S_ISREG(p.stat().st_mode):
            kind = "a directory" if p.is_dir() else "not a regular file"
            raise GraphError(f"{p}: is {kind}; a graph file is a small YAML file")
        if p.stat().st_size > _MAX_BYTES:
            raise GraphError(f"{p}: is {p.stat().st_size} bytes; a graph file is a small YAML file")
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphError(f"{p}: no such graph file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GraphError(f"{p}: cannot read the graph file: {e}") from None


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> GraphSpec:
    """Read the graph file at ``path`` into a :class:`GraphSpec` (no graph-level validation)."""
    return loads_spec(_read(path), str(path), overrides)


def loads_graph(
    text: str,
    source: str = "<string>",
    overrides: Sequence[str] = (),
    registry: Registry[NodeFunction] | None = None,
) -> Graph:
    """Parse and validate graph-file text; see :func:`load_graph`."""
    return Graph.from_spec(resolve_hub_models(loads_spec(text, source, overrides)), registry)


def load_graph(
    path: str | Path,
    overrides: Sequence[str] = (),
    registry: Registry[NodeFunction] | None = None,
) -> Graph:
    """Load, override, resolve and validate the graph file at ``path``.

    Args:
        path: a YAML graph file.
        overrides: dotted ``key.path=value`` items merged over the file (``models.actor.optimizer.lr=1e-6``).
        registry: node functions to validate against (default: the builtins in ``NODE_FUNCTIONS``).

    Model and tokenizer Hub ids are resolved to their snapshots' directories once, here
    (:func:`~rlflow.dataflow.hub.resolve_hub_models`): the graph names local directories only.

    Raises:
        GraphError: for graph mistakes; PlanError: for plan mistakes; ModelError: a Hub id that does not
            resolve (not cached while offline, unknown on the Hub). Messages name the file and key path.
    """
    return Graph.from_spec(resolve_hub_models(load_spec(path, overrides)), registry)
