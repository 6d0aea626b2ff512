"""The package as a user who builds an image gets it: `pip wheel` of the tree holds every module
of megatron_entropy/ and the shipped examples, and the wheel, installed (not editable) into a
fresh venv, runs `megatron-entropy train` on the quickstart from outside the checkout as the
checkout's code does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from harness import STABLE, metrics_rows, run_distributed, train_from_dict

import megatron_entropy

REPO = Path(__file__).resolve().parents[2]
# What the build reads (pyproject.toml, setup.py): copied, so that the build's build/ and
# *.egg-info never land in the checkout.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "megatron_entropy", "examples")
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
# A short quickstart: the shipped model and config, two small steps, no validation.
SHORT = ("trainer.steps=2", "trainer.val_before_train=false", "trainer.val_interval=0",
         "data.prompts_per_step=8", "rollout.max_new_tokens=40", "data.arithmetic.num_val=8",
         "trainer.micro_batch_tokens=2048", "logging.progress_bar=false")


def copy_build_inputs(tree: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in BUILD_INPUTS:
        path = tree / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=JUNK)
        else:
            shutil.copy2(path, dest / name)


def build_wheel(tree: Path, out: Path) -> Path:
    """``pip wheel --no-deps`` of a copy of ``tree``'s build inputs; the wheel's path."""
    src = out / "src"
    copy_build_inputs(tree, src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True,
                   capture_output=True)
    return next(out.glob("megatron_entropy-*.whl"))


def expected_files(tree: Path) -> set[str]:
    """Every file the wheel must hold, by its path inside the wheel: the package's modules and
    data, and examples/ as megatron_entropy/examples/."""
    def files(top: Path) -> list[Path]:
        return [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                and p.suffix != ".pyc"]
    package = {p.relative_to(tree).as_posix() for p in files(tree / "megatron_entropy")}
    examples = {"megatron_entropy/examples/" + p.relative_to(tree / "examples").as_posix()
                for p in files(tree / "examples")}
    return package | examples


def missing_from_wheel(wheel: Path, tree: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
    return sorted(expected_files(tree) - held)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(REPO, tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_examples(wheel):
    assert missing_from_wheel(wheel, REPO) == []
    assert wheel.name.startswith(f"megatron_entropy-{megatron_entropy.__version__}-")


@pytest.mark.slow
def test_a_package_folder_without_init_is_missing_from_the_wheel(tmp_path):
    """The check above on a tree whose trainer/ has lost its ``__init__.py``: the wheel then
    lacks trainer/ (what a wheel built from such a tree did), and the listing says so."""
    tree = tmp_path / "tree"
    copy_build_inputs(REPO, tree)
    (tree / "megatron_entropy" / "trainer" / "__init__.py").unlink()
    missing = missing_from_wheel(build_wheel(tree, tmp_path / "out"), tree)
    assert "megatron_entropy/trainer/loop.py" in missing
    assert all(m.startswith("megatron_entropy/trainer/") for m in missing), missing


def _user_env(venv: Path) -> dict[str, str]:
    """A shell with the venv first on PATH and nothing pointing at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # One thread, as the forked reference ranks run: the same kernels, the same numbers.
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}", "OMP_NUM_THREADS": "1"}


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


@pytest.mark.slow
def test_the_installed_wheel_trains_the_quickstart_outside_the_checkout(wheel, tmp_path):
    """A fresh venv (torch and megatron-core from the system's site-packages, as an image that
    has them) gets the wheel, not an editable install; from a folder outside the checkout,
    ``megatron-entropy examples`` and ``megatron-entropy train examples/quickstart.yaml`` run,
    and the two steps' metrics equal those of the checkout's code on the same config."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-index", "--no-deps", str(wheel)], check=True)
    work = tmp_path / "work"
    work.mkdir()
    env = _user_env(venv)
    where = _run(["python", "-c", "import megatron_entropy; print(megatron_entropy.__file__)"],
                 work, env)
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's code, not the checkout's
    assert _run(["megatron-entropy", "--version"], work, env).strip() == \
        f"megatron-entropy {megatron_entropy.__version__}"
    _run(["megatron-entropy", "examples"], work, env)
    out = _run(["megatron-entropy", "train", "examples/quickstart.yaml", *SHORT,
                "logging.name=installed", "logging.runs_dir=runs"], work, env)
    assert out.strip().splitlines()[-1].startswith("finished: 2 steps; last checkpoint runs/")

    cfg = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    cfg["model"]["hf_path"] = str(REPO / cfg["model"]["hf_path"])
    for override in (*SHORT, "logging.name=checkout", f"logging.runs_dir={tmp_path}"):
        key, value = override.split("=")
        *sections, last = key.split(".")
        node = cfg
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = yaml.safe_load(value)
    run_distributed(train_from_dict, 1, cfg, timeout=300)
    got = metrics_rows(work / "runs" / "installed")
    want = metrics_rows(tmp_path / "checkout")
    assert [r["step"] for r in got] == [1, 2]
    assert [{k: v for k, v in r.items() if not k.startswith(STABLE)} for r in got] == \
        [{k: v for k, v in r.items() if not k.startswith(STABLE)} for r in want]
