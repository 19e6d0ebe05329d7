"""Models and tokenizers given by Hugging Face Hub id (``rlflow.dataflow.hub``), offline.

This machine has no Hub: a module fixture lays out a Hugging Face cache as ``huggingface_hub`` writes one
(``models--org--tiny/refs/<ref>`` holding a commit, ``snapshots/<commit>/<file>`` links into ``blobs/``),
with two commits of a tiny Llama and its tokenizer: ``main`` (seed 0) and the tag ``v1`` (seed 1). Each
test points ``HF_HUB_CACHE`` at it with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from examples.hub.make_local_hub import write_snapshot
from rlflow.dataflow.errors import GraphError, ModelError
from rlflow.dataflow.hub import hub_ref, resolve_hub_dir
from rlflow.dataflow.loader import load_graph
from rlflow.nodes.models import build_model, save_pretrained
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "examples/grpo.yaml"
REPO = "org/tiny"
MAIN = "a" * 40  # the commit refs/main names
V1 = "b" * 40  # the commit refs/v1 names (huggingface_hub writes a tag's commit under refs/<tag> too)


def _snapshot(cache: Path, commit: str, ref: str, seed: int) -> Path:
    """Write the tiny actor of examples/grpo.yaml (weights from ``seed``) and the arithmetic tokenizer as
    commit ``commit`` of ``REPO``, which ``refs/<ref>`` names (laid out by examples/hub/make_local_hub.py's
    ``write_snapshot``); the snapshot's directory."""
    config = yaml.safe_load(GRPO.read_text())["models"]["actor"]["config"]
    staged = cache / "staged" / commit
    save_pretrained(
        build_model(config=config, seed=seed), load_tokenizer(ROOT / "examples/arith/tokenizer"), staged
    )
    return write_snapshot(cache, REPO, staged, ref, commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    snapshots = {"main": _snapshot(cache, MAIN, "main", 0), "v1": _snapshot(cache, V1, "v1", 1)}
    return {"cache": cache, **snapshots}


@pytest.fixture
def offline(hub_cache: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache["cache"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _graph_file(tmp: Path, **actor: object) -> str:
    """examples/grpo.yaml with its actor given by ``actor`` (a Hub id's ``path``, ...) instead of a config
    and tokenizer directory, one iteration long."""
    raw = yaml.safe_load(GRPO.read_text())
    raw["models"]["actor"] = {**actor, "optimizer": raw["models"]["actor"]["optimizer"]}
    raw["run"] = {**raw["run"], "iterations": 1, "eval_interval": 0, "checkpoint_interval": 0}
    raw["run"]["output_dir"] = str(tmp / "run")
    out = tmp / "hub.yaml"
    out.write_text(yaml.safe_dump(raw))
    return str(out)


def test_hub_id_validates_and_runs_with_the_snapshots_weights(
    offline: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A graph whose actor is ``org/tiny``: validate passes, and one iteration runs through the controller
    with the ``main`` snapshot's weights (the reference, ``init_from: actor``, too) and its tokenizer; the
    run's record of the graph names the snapshot's directory."""
    graph_file = _graph_file(tmp_path, path=REPO)
    assert main(["validate", graph_file]) == 0
    assert f"ok: {graph_file}" in capsys.readouterr().out
    graph = load_graph(graph_file)
    actor = graph.spec.models["actor"]
    assert (actor.path, actor.tokenizer_dir, actor.revision) == (str(offline["main"]),) * 2 + (None,)
    snapshot = build_model(path=offline["main"]).state_dict()
    controller = Controller(resolve_plan(graph, None))
    try:
        for name in ("actor", "ref"):
            built = controller.executor.models[name].module.state_dict()
            assert built.keys() == snapshot.keys()
            assert all(torch.equal(built[k], snapshot[k]) for k in snapshot)
        result = controller.run()
    finally:
        controller.close()
    assert result.iteration == 1
    recorded = yaml.safe_load((tmp_path / "run" / "graph.yaml").read_text())["models"]["actor"]
    assert recorded["path"] == str(offline["main"]) and "revision" not in recorded


def test_revision_resolves_to_its_snapshot(offline: dict[str, Path], tmp_path: Path) -> None:
    """``models.actor.revision: v1`` and ``org/tiny@v1`` pick the tag's snapshot; a commit hash its own;
    the tokenizer follows ``path`` unless given, and may carry its own ``@<revision>``."""
    graph = load_graph(_graph_file(tmp_path, path=REPO, revision="v1"))
    actor = graph.spec.models["actor"]
    assert (actor.path, actor.tokenizer_dir, actor.revision) == (str(offline["v1"]),) * 2 + (None,)
    graph = load_graph(_graph_file(tmp_path, path=f"{REPO}@v1", tokenizer=f"{REPO}@{MAIN}"))
    actor = graph.spec.models["actor"]
    assert (actor.path, actor.tokenizer) == (str(offline["v1"]), str(offline["main"]))
    assert not torch.equal(
        build_model(path=actor.path).lm_head.weight, build_model(path=actor.tokenizer).lm_head.weight
    )


def test_missing_hub_id_is_one_line_before_anything_starts(
    offline: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An id (or a revision) the cache lacks, offline: validate and run stop with one line naming the
    file, the key, the id, the revision and how to get it; the run directory is never made."""
    cache = offline["cache"]
    for actor, shown in (({"path": "org/absent"}, "main"), ({"path": REPO, "revision": "v9"}, "v9")):
        graph_file = _graph_file(tmp_path, **actor)
        repo = str(actor["path"])
        for argv in (["validate", graph_file], ["run", graph_file, "--no-progress"]):
            assert main(argv) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1, err
            key = "models.actor.path/revision" if "revision" in actor else "models.actor.path"
            assert f"{graph_file}: {key}: '{repo}' is not a local directory" in err
            assert f"Hub model '{repo}' (revision {shown}) is not in the Hugging Face cache {cache}" in err
            assert "HF_HUB_OFFLINE=1" in err and f"`hf download {repo} --revision {shown}`" in err
            assert "HF_HUB_CACHE" in err
        assert not (tmp_path / "run").exists()


def test_neither_directory_nor_hub_id_is_a_missing_directory(
    offline: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A string that is no directory and no Hub id (``no/such/dir``) stays a directory name: validate reports
    it missing by key, as for any directory."""
    graph_file = _graph_file(tmp_path, path="no/such/dir")
    assert main(["validate", graph_file]) == 2
    err = capsys.readouterr().err
    assert f"{graph_file}: models.actor.path: directory 'no/such/dir' does not exist" in err


def test_revision_mistakes_are_refused_naming_the_key(offline: dict[str, Path], tmp_path: Path) -> None:
    """A revision beside a local directory, a string that is no Hub id, a second revision in ``@``, or no
    ``path`` at all picks nothing: each is refused, naming file and key."""
    local = str(offline["main"])
    cases = (
        ({"path": local, "revision": "v1"}, r"models\.actor\.path/revision: '.*' is a local directory, so a"),
        ({"path": "no/such/dir", "revision": "v1"}, r"models\.actor\.path/revision: .*neither a local"),
        (
            {"path": f"{REPO}@v1", "revision": "v1"},
            r"models\.actor\.path/revision: .*names revision 'v1' and the model",
        ),
        (
            {"config": {"model_type": "llama"}, "tokenizer": local, "revision": "v1"},
            r"models\.actor\.revision: picks a revision of a Hub id 'path'",
        ),
    )
    for actor, message in cases:
        graph_file = _graph_file(tmp_path, **actor)
        with pytest.raises(GraphError, match=rf"^{graph_file}: .*{message}"):
            load_graph(graph_file)


def test_hub_ref_and_local_directories_first(
    offline: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What reads as a Hub id; an existing directory of a Hub id's shape is that directory, not the Hub's."""
    assert hub_ref("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert hub_ref("gpt2@v2") == ("gpt2", "v2")
    assert [hub_ref(t) for t in ("a/b/c", "/abs/x", "./x", "org/name@", "a--b/c")] == [None] * 5
    assert resolve_hub_dir("x" * 5000, "g.yaml: models.actor.path") == "x" * 5000  # too long for a name
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        assert resolve_hub_dir(REPO, "g.yaml: models.actor.path") == REPO
    assert resolve_hub_dir(REPO, "g.yaml: models.actor.path") == str(offline["main"])
    with pytest.raises(ModelError, match=r"^g\.yaml: models\.actor\.tokenizer: 'org/other'"):
        resolve_hub_dir("org/other", "g.yaml: models.actor.tokenizer")
