"""Packaging: the package list matches the source folders, and the built wheel works on its own.

``pyproject.toml`` maps the design's top-level folders to ``rlflow.*`` (``package-dir``) and lists every
package by hand (``packages``). A subpackage missing from that list would still import from the editable
install every other test uses, and only break in an installed wheel; these tests catch it:

- the list equals the folders under ``dataflow/``, ``nodes/``, ``schedulers/`` that hold an
  ``__init__.py`` (as ``rlflow.*`` names), and every folder holding ``.py`` files has an ``__init__.py``;
- (slow) the wheel, built from a copy of the sources and installed into a fresh virtual environment outside
  the checkout, validates the example graphs, plans on a cluster preset shipped as package data and runs
  two iterations of an example graph, while importing nothing from the checkout.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
FLOORS = ("dataflow", "nodes", "schedulers")


def _source_dirs(floor: str) -> list[Path]:
    """``floor`` and its subfolders, without caches."""
    top = ROOT / floor
    return [top, *sorted(d for d in top.rglob("*") if d.is_dir() and "__pycache__" not in d.parts)]


def test_package_dir_maps_the_three_floors() -> None:
    assert SETUPTOOLS["package-dir"] == {f"rlflow.{floor}": floor for floor in FLOORS}


def test_packages_list_equals_folders_with_init() -> None:
    folder_of = {folder: name for name, folder in SETUPTOOLS["package-dir"].items()}
    on_disk = set()
    for floor in FLOORS:
        for d in _source_dirs(floor):
            if (d / "__init__.py").is_file():
                rel = d.relative_to(ROOT / floor).parts
                on_disk.add(".".join((folder_of[floor], *rel)))
    listed = set(SETUPTOOLS["packages"])
    assert len(listed) == len(SETUPTOOLS["packages"]), "pyproject.toml lists a package twice"
    missing, extra = sorted(on_disk - listed), sorted(listed - on_disk)
    assert not missing and not extra, (
        f"[tool.setuptools] packages in pyproject.toml: missing {missing}, listed without a folder {extra}"
    )


def test_every_source_folder_is_a_package() -> None:
    no_init = [
        str(d.relative_to(ROOT))
        for floor in FLOORS
        for d in _source_dirs(floor)
        if any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    ]
    assert not no_init, f"folders holding .py files without an __init__.py (not packaged): {no_init}"


# --- the wheel, installed on its own ---------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run ``cmd``; its stdout+stderr, or a test failure naming the command, exit status and output."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} (in {cwd}) exited {proc.returncode}:\n{out}"
    return out


def _build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    """Build the wheel from a copy of what a build reads, so the checkout gets no build/ or egg-info."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for floor in FLOORS:
        shutil.copytree(ROOT / floor, src / floor, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp / "wheels"
    # No build isolation: the environment's setuptools (the dev extra asks for one that builds wheels).
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            ".",
        ],
        cwd=src,
        env=env,
    )
    (wheel,) = wheels.glob("rlflow-*.whl")
    return wheel


def _make_venv(venv: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A fresh venv that sees this environment's packages (torch, ...) but not the checkout.

    Not ``--system-site-packages``: run from inside a venv, that reaches only the base interpreter's
    packages, and where the editable install lies in a site directory its ``.pth`` finder would be
    activated. Instead a ``.pth`` file lists this environment's site directories as plain paths: their
    modules import, their ``.pth`` files (the editable install's finder among them) do not run, and the
    venv's own site-packages (the wheel) comes first. Returns (python, site-packages).
    """
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent, env=env)
    python = venv / "bin" / "python"
    venv_site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], venv, env).strip()
    )
    outer = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        outer.append(site.getusersitepackages())
    (venv_site / "_outer_environment.pth").write_text("".join(f"{p}\n" for p in outer))
    return python, venv_site


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONNOUSERSITE"] = "1"  # the user site, if any, is listed in the venv's .pth instead
    before = sorted(p.name for p in ROOT.iterdir())
    wheel = _build_wheel(tmp_path, env)
    assert sorted(p.name for p in ROOT.iterdir()) == before, "building the wheel wrote into the checkout"

    python, venv_site = _make_venv(tmp_path / "venv", env)
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        cwd=tmp_path,
        env=env,
    )
    ours = sorted(p.name for p in venv_site.iterdir() if p.name.startswith(("rlflow", *FLOORS)))
    assert ours == ["rlflow", "rlflow-0.1.0.dist-info"], f"the wheel installed {ours}"
    assert sorted(p.name for p in (venv_site / "rlflow").iterdir()) == sorted(FLOORS)

    work = tmp_path / "work"  # cwd outside the checkout: nothing of it on sys.path
    shutil.copytree(ROOT / "examples", work / "examples")  # graph files resolve paths against the cwd
    rlflow = str(python.parent / "rlflow")

    where = _run(
        [
            str(python),
            "-c",
            "import importlib.metadata as md, rlflow, rlflow.dataflow, rlflow.schedulers.cli; "
            "print(rlflow.dataflow.__file__); print(*rlflow.__path__, sep='|'); "
            "print(md.distribution('rlflow').locate_file(''))",
        ],
        cwd=tmp_path,
        env=env,
    ).splitlines()
    assert Path(where[0]).is_relative_to(venv_site), f"rlflow.dataflow imported from {where[0]}"
    assert where[1] == str(venv_site / "rlflow"), f"rlflow's namespace path is {where[1]}"
    assert Path(where[2]) == venv_site, f"rlflow's metadata read from {where[2]}"

    examples = sorted(str(p.relative_to(work)) for p in (work / "examples").glob("*.yaml"))
    out = _run([rlflow, "validate", *examples], cwd=work, env=env)
    for graph in examples:
        assert f"ok: {graph} (" in out, out
    assert "ok: examples/ppo.yaml (6 nodes, 11 keys)" in out, out

    out = _run([rlflow, "plan", "examples/ppo.yaml", "--cluster", "h100-8x"], cwd=work, env=env)
    assert "on h100-8x (8 devices)" in out and "wrote out/plan.yaml and out/plan.png" in out, out
    assert (work / "out" / "plan.yaml").is_file() and (work / "out" / "plan.png").is_file()

    out = _run(
        [rlflow, "run", "examples/grpo.yaml", "run.iterations=2", "run.output_dir=out/grpo"],
        cwd=work,
        env=env,
    )
    assert "iteration 2/2" in out, out
    status = (work / "out" / "grpo" / "status.json").read_text()
    assert '"state": "finished"' in status and '"iteration": 2' in status, status
