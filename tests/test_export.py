"""`rlflow export` (issue 35): a LoRA run's checkpoint as a PEFT adapter directory that plain ``transformers``
+ ``peft`` load, as a merged Hugging Face model whose logits are the trained LoRA model's, a full-weight
model's copy, and the refusals (exit 2, nothing written).

The runs are the LoRA example (examples/lora/grpo.yaml) for two iterations, in this process, and the same
graph trained in full for one; the trained model's logits are taken from the live run before it closes.
"""

from __future__ import annotations

import filecmp
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlflow.dataflow.loader import load_graph
from rlflow.nodes.lora import adapters_disabled
from rlflow.nodes.models import build_model
from rlflow.schedulers.cli import main
from rlflow.schedulers.runtime.controller import Controller

EXAMPLE = "examples/lora/grpo.yaml"
FAST = ["run.eval_interval=0", "run.checkpoint_interval=1"]
FULL = [
    "models.actor.lora=null",
    "models.ref.base_of=null",
    "models.ref.init_from=actor",
    "models.ref.trainable=false",
]
IDS = torch.tensor([[1, 5, 7, 9, 11, 3, 4, 13, 2]])  # token ids of the example's 19-token vocabulary
CRITIC_LORA = "models.critic.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj], train_head: true}"

pytestmark = pytest.mark.xdist_group("test_export_runs")


@dataclass(frozen=True)
class Trained:
    run_dir: Path
    lora_logits: torch.Tensor  # [1, L, V] of the trained LoRA actor after the last iteration
    base_logits: torch.Tensor  # [1, L, V] of its base (adapters off)


def _train(run_dir: Path, iterations: int, *overrides: str) -> Trained:
    c = Controller(
        load_graph(EXAMPLE, [*FAST, f"run.iterations={iterations}", f"run.output_dir={run_dir}", *overrides])
    )
    try:
        c.run()
        module = c.executor.models["actor"].module  # type: ignore[attr-defined]
        module.eval()
        with torch.no_grad():
            lora = module(IDS).logits
            with adapters_disabled(module):
                base = module(IDS).logits
    finally:
        c.close()
    return Trained(run_dir, lora, base)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return _train(tmp_path_factory.mktemp("lora") / "run", 2)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("full") / "run", 1, *FULL).run_dir


def _values(model: torch.nn.Module) -> torch.Tensor:
    """``[1, L]`` values of a ``value`` :class:`~rlflow.nodes.models.HeadModel` on :data:`IDS`."""
    model.eval()
    with torch.no_grad():
        positions = torch.arange(IDS.shape[1])[None]
        return model(IDS, torch.ones_like(IDS), positions)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """examples/ppo.yaml for one iteration with a LoRA critic (a value head on a LoRA backbone); the trained
    critic's values."""
    run_dir = tmp_path_factory.mktemp("ppo") / "run"
    overrides = [*FAST, "run.iterations=1", f"run.output_dir={run_dir}", CRITIC_LORA]
    c = Controller(load_graph("examples/ppo.yaml", overrides))
    try:
        c.run()
        values = _values(c.executor.models["critic"].module)  # type: ignore[attr-defined]
    finally:
        c.close()
    return run_dir, values


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits  # type: ignore[no-any-return]


def test_merged_export_loads_in_plain_transformers_with_the_lora_models_logits(
    lora_run: Trained, tmp_path: Path
) -> None:
    out = tmp_path / "merged"
    assert main(["export", str(lora_run.run_dir), "--merge", "--out", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged), lora_run.lora_logits, rtol=0, atol=1e-5)
    # the adapters trained: the merged model is not its base
    assert (lora_run.lora_logits - lora_run.base_logits).abs().max() > 1e-4
    assert (out / "tokenizer.json").is_file()


def test_adapter_export_loads_with_peft_on_the_base_it_names(lora_run: Trained, tmp_path: Path) -> None:
    out = tmp_path / "adapter"
    assert main(["export", str(lora_run.run_dir), "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    # the example's base is built from a config: it is written beside the adapter, and named
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    torch.testing.assert_close(_logits(base), lora_run.base_logits, rtol=0, atol=1e-6)
    model = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(_logits(model), lora_run.lora_logits, rtol=0, atol=1e-5)


def test_an_earlier_checkpoint_exports_its_own_adapters(lora_run: Trained, tmp_path: Path) -> None:
    out = tmp_path / "it1"
    assert (
        main(
            ["export", str(lora_run.run_dir), "--checkpoint", "iter-1", "--model", "actor", "--out", str(out)]
        )
        == 0
    )
    saved = (
        lora_run.run_dir / "checkpoints" / "iter-000001" / "models" / "actor" / "adapter_model.safetensors"
    )
    want, got = load_file(str(saved)), load_file(str(out / "adapter_model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_a_full_weight_model_is_copied_and_not_merged(full_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "full"
    assert main(["export", str(full_run), "--model", "actor", "--out", str(out)]) == 0
    saved = full_run / "checkpoints" / "latest" / "models" / "actor"
    assert not filecmp.dircmp(saved, out).diff_files and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)


def test_a_lora_value_model_merges_into_rlflows_head_model_format(
    critic_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run_dir, values = critic_run
    out = tmp_path / "critic"
    assert main(["export", str(run_dir), "--model", "critic", "--merge", "--out", str(out)]) == 0
    assert (out / "value_head.safetensors").is_file() and (out / "config.json").is_file()
    torch.testing.assert_close(_values(build_model(path=out, head="value")), values, rtol=0, atol=1e-5)
    adapter = (
        tmp_path / "critic-adapter"
    )  # without --merge the base (with its trained head) is written beside
    assert main(["export", str(run_dir), "--model", "critic", "--out", str(adapter)]) == 0
    assert (adapter / "base" / "value_head.safetensors").is_file()


def _bad_cases(lora: Path, full: Path, tmp: Path) -> list[tuple[list[str], str]]:
    bare = tmp / "bare"
    bare.mkdir()
    unrun = tmp / "unrun"
    unrun.mkdir()
    (unrun / "graph.yaml").write_text((lora / "graph.yaml").read_text())
    full_dir = tmp / "notempty"
    full_dir.mkdir()
    (full_dir / "keep.txt").write_text("mine")
    a_file = tmp / "a_file"
    a_file.write_text("mine")
    return [
        ([str(tmp / "nowhere")], "no such run directory"),
        ([str(bare)], "not a run directory"),
        ([str(unrun)], "has no checkpoint"),
        ([str(lora), "--checkpoint", "iter-7"], "no checkpoint of iteration 7"),
        ([str(lora), "--checkpoint", "best"], "expected 'latest', 'iter-N' or N"),
        ([str(lora), "--model", "critic"], "no model 'critic'"),
        ([str(lora), "--model", "ref"], "is the base of LoRA model 'actor'"),
        ([str(full), "--merge"], "'actor' trains its full weights"),
        ([str(full), "--model", "actor", "--merge"], "no adapters to merge"),
        ([str(lora), "--out", str(full_dir)], "is not empty"),
        ([str(lora), "--out", str(a_file)], "is a file"),
    ]


def test_bad_input_exits_2_naming_the_mistake_and_writes_nothing(
    lora_run: Trained, full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, message in _bad_cases(lora_run.run_dir, full_run, tmp_path):
        out = tmp_path / "out" / "model"
        if "--out" not in argv:
            argv = [*argv, "--out", str(out)]
        assert main(["export", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "rlflow export: error: " in err and message in err, (argv, err)
        assert not (tmp_path / "out").exists(), argv
    assert (tmp_path / "notempty" / "keep.txt").read_text() == "mine"
    assert (tmp_path / "a_file").read_text() == "mine"
