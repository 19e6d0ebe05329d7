"""Export a trained model of a run: a PEFT adapter directory, a merged Hugging Face model, or a copy.

`rlflow export RUN_DIR [--checkpoint latest|iter-N] [--model NAME] [--merge] --out DIR`: reads the run's
``graph.yaml`` and one of its checkpoints (default the newest) and writes model ``NAME`` (default: the only
model the checkpoint holds, else its only LoRA model, else its only trained model) into ``DIR``, which must
not exist or be empty:

- a LoRA model, without ``--merge``: a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``, the tokenizer) that ``peft.PeftModel.from_pretrained(base, DIR)`` loads on
  its base. ``base_model_name_or_path`` names the base: the model's ``path`` (absolute), or, for a base
  built from a ``config`` or copied from another model (``init_from``) and for a value/score model (whose
  trained head is no Hugging Face file), ``DIR/base``, where the base is written;
- a LoRA model with ``--merge``: the base with the adapters merged in (peft's merge of every LoRA layer,
  as ``merge_and_unload``) as a Hugging Face model that ``transformers.AutoModelForCausalLM.from_pretrained``
  loads; a value/score model as rlflow saves one (the merged backbone plus its head files);
- a full-weight model: a copy of its Hugging Face directory in the checkpoint (``--merge`` is refused: there
  is nothing to merge).

The model is rebuilt on the CPU the way a resume rebuilds it (:func:`~rlflow.schedulers.runtime.instances.
build_models`; ``dtype: auto`` is float32 there); paths in ``graph.yaml`` are read relative to the working
directory, as ``rlflow run`` read them (the tokenizer comes from the checkpoint). ``DIR`` is written under
a temporary name and renamed at the end: on an error nothing is left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from rlflow.dataflow.errors import GraphError, ModelError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.schedulers.records.rundir import latest_checkpoint, list_checkpoints, normal_mode

BASE_DIR = "base"  # where an adapter export that carries its own base writes it


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory (run.output_dir)")
    parser.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|iter-N",
        help="which checkpoint of RUN_DIR/checkpoints (default: the newest)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="the model to export (default: the checkpoint's only model, else its only LoRA model, else its "
        "only trained model)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="LoRA models only: merge the adapters into the base and write a plain Hugging Face model",
    )
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="output directory (absent or empty)"
    )


def find_checkpoint(run_dir: Path, which: str) -> Path:
    """The checkpoint directory of ``run_dir`` that ``which`` names (``latest``, ``iter-N`` or ``N``).

    Raises:
        GraphError: ``run_dir`` is no run directory, has no checkpoint, or none of that iteration.
    """
    if not run_dir.is_dir():
        raise GraphError(f"{run_dir}: no such run directory")
    if not (run_dir / "graph.yaml").is_file():
        raise GraphError(f"{run_dir}: not a run directory (no graph.yaml; `rlflow run` writes one)")
    if which == "latest":
        found = latest_checkpoint(run_dir)
        if found is None:
            raise GraphError(
                f"{run_dir}: has no checkpoint yet (a run writes one every run.checkpoint_interval "
                "iterations and at its end)"
            )
        return found[1]
    text = which.removeprefix("iter-")
    if not text.isdigit():
        raise GraphError(f"--checkpoint: expected 'latest', 'iter-N' or N, got {which!r}")
    saved = dict(list_checkpoints(run_dir))
    if int(text) not in saved:
        have = ", ".join(p.name for p in saved.values()) or "none"
        raise GraphError(f"{run_dir}: no checkpoint of iteration {int(text)} (it has: {have})")
    return saved[int(text)]


def run_graph(run_dir: Path, checkpoint: Path) -> Graph:
    """The run's resolved graph (``graph.yaml``), each model's tokenizer read from the checkpoint when the
    checkpoint holds it (a relative tokenizer path of the run may not resolve from here)."""
    from rlflow.dataflow.loader import load_graph, load_spec

    path = run_dir / "graph.yaml"
    with warnings.catch_warnings():  # the resolved record names keys its ${...} once read: not the user's
        warnings.simplefilter("ignore", GraphWarning)
        names = load_spec(path).models
        overrides = [
            f"models.{name}.tokenizer={(checkpoint / 'models' / name).resolve()}"
            for name in names
            if (checkpoint / "models" / name / "tokenizer_config.json").is_file()
        ]
        return load_graph(path, overrides)


def choose_model(graph: Graph, checkpoint: Path, name: str | None, merge: bool) -> str:
    """The model to export (``name``, else the default of ``--model``'s help).

    Raises:
        ModelError: an unknown model, a base view, one the checkpoint lacks, an ambiguous default, or
            ``merge`` of a full-weight model.
    """
    models = graph.spec.models
    held = checkpoint / "models"
    saved = sorted(p.name for p in held.iterdir() if p.is_dir() and p.name in models) if held.is_dir() else []
    if not saved:
        raise ModelError(f"checkpoint '{checkpoint}' holds no model (no {held}/<model>)")
    if name is None:
        trained = {n.model for n in graph.nodes.values() if n.kind == "train"}
        for pick in (saved, [s for s in saved if models[s].lora], [s for s in saved if s in trained]):
            if len(pick) == 1:
                name = pick[0]
                break
        else:
            raise ModelError(f"--model: the checkpoint holds {', '.join(saved)}; name one")
    if name not in models:
        raise ModelError(f"--model: the run has no model '{name}' (it has {', '.join(models)})")
    base_of = models[name].base_of
    if base_of is not None:
        raise ModelError(
            f"--model: '{name}' is the base of LoRA model '{base_of}' (its weights, adapters off) and "
            f"has no weights of its own; export '{base_of}' (without --merge its base is named or written)"
        )
    if name not in saved:
        raise ModelError(
            f"--model: checkpoint '{checkpoint}' holds no model '{name}' (it has {', '.join(saved)})"
        )
    if merge and models[name].lora is None:
        raise ModelError(
            f"--merge: model '{name}' trains its full weights (no lora section): there are no adapters to "
            "merge; export it without --merge (a copy of its Hugging Face directory)"
        )
    return name


def _out_dir(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        raise GraphError(f"--out: '{out}' is a file; name a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        raise GraphError(f"--out: '{out}' is not empty; name a new or empty directory")
    return out


def write_lora(graph: Graph, name: str, checkpoint: Path, merge: bool, tmp: Path, out: Path) -> str:
    """Write LoRA model ``name`` of ``checkpoint`` into ``tmp`` (renamed to ``out`` afterwards): merged, or
    a PEFT adapter directory plus, where the base is no Hugging Face directory of its own, the base in
    ``base/``; returns what was written, in words."""
    import torch

    from rlflow.nodes.lora import save_adapter, unload_adapters
    from rlflow.nodes.models import save_pretrained
    from rlflow.schedulers.runtime.instances import build_models

    mspec = graph.spec.models[name]
    assert mspec.lora is not None
    modules, tokenizers = build_models(graph, torch.device("cpu"), checkpoint, [name], move=False)
    module, tokenizer = modules[name], tokenizers[name]
    if merge:
        unload_adapters(module, merge=True, where=f"model '{name}'")
        save_pretrained(module, tokenizer, tmp)
        return "the base with the adapters merged in (a Hugging Face model)"
    if mspec.path is not None and mspec.head == "lm":
        save_adapter(module, mspec.lora, tmp, base=str(Path(mspec.path).resolve()), tokenizer=tokenizer)
        return f"a PEFT adapter directory on base {Path(mspec.path).resolve()}"
    base = out.resolve() / BASE_DIR
    save_adapter(module, mspec.lora, tmp, base=str(base), tokenizer=tokenizer)
    unload_adapters(module, merge=False, where=f"model '{name}'")
    save_pretrained(module, tokenizer, tmp / BASE_DIR)
    return f"a PEFT adapter directory, its base in {base}"


def run(args: argparse.Namespace) -> int:
    out = _out_dir(args.out)
    checkpoint = find_checkpoint(args.run_dir, args.checkpoint)
    graph = run_graph(args.run_dir, checkpoint)
    name = choose_model(graph, checkpoint, args.model, args.merge)
    made = [d for d in out.absolute().parents if not d.exists()]  # removed again on an error
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-export-{out.name}-", dir=out.parent))
    try:
        if graph.spec.models[name].lora is None:
            shutil.copytree(checkpoint / "models" / name, tmp, dirs_exist_ok=True)
            what = "a copy of its Hugging Face directory (full weights)"
        else:
            what = write_lora(graph, name, checkpoint, args.merge, tmp, out)
        for folder, _, files in os.walk(tmp):  # mkdtemp made it private (0700): give it a plain mkdir's mode
            normal_mode(folder, directory=True)
            for f in files:
                normal_mode(Path(folder) / f)
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    print(f"exported model '{name}' of {checkpoint} to {out}: {what}")
    return 0
