"""tests/run.sh's promise: under MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1 no test is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from require_all import REQUIRE_ALL

TESTS = Path(__file__).resolve().parents[2]


def test_a_skip_fails_with_its_reason_when_every_test_is_required(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "@pytest.mark.skipif(True, reason='needs the moon')\n"
        "def test_marked():\n    pass\n\n"
        "def test_skips_itself():\n    pytest.skip('no cheese')\n\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_known_failure():\n    assert False\n")

    def run(required: bool) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(TESTS / "helpers")}
        env.pop(REQUIRE_ALL, None)
        if required:
            env[REQUIRE_ALL] = "1"
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "require_all", "-q", "-rA",
                               "-p", "no:cacheprovider", str(tmp_path)], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    plain = run(required=False)
    assert plain.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in plain.stdout, plain.stdout
    strict = run(required=True)
    assert strict.returncode == 1, strict.stdout
    # A skip at setup (a skipif mark) reports as an error, one in the test as a failure.
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in strict.stdout, strict.stdout
    assert "may not be skipped, but it was: Skipped: needs the moon" in strict.stdout
    assert "may not be skipped, but it was: Skipped: no cheese" in strict.stdout


# The three pytest runs of tests/run.sh, told apart by their arguments (first match wins).
RUNS = {"slurm": "tests/slurm/test_slurm_jobs.py tests/integration/analysis/test_study.py -m not vllm", "vllm": "-m vllm",
        "main": "-m not vllm --ignore=tests/slurm/test_slurm_jobs.py --ignore=tests/integration/analysis/test_study.py"}


def _stub_checkout(tmp: Path, pytest_exit: dict[str, int], setup_exit: int = 0) -> Path:
    """tests/run.sh in a copy of the checkout whose installers and python are stubs: pip and the
    setup scripts succeed (or the Slurm setup exits ``setup_exit``); pytest exits
    ``pytest_exit[run]`` for each of `RUNS` (0 if not given) and says which run it was."""
    (tmp / "tests").mkdir()
    (tmp / "tests" / "run.sh").write_text((TESTS / "run.sh").read_text())
    (tmp / ".ci").mkdir()
    for name in ("setup-vllm.sh", "setup-slurm.sh", "setup-smollm2.sh"):
        (tmp / ".ci" / name).write_text(f"exit {setup_exit if name == 'setup-slurm.sh' else 0}\n")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    cases = "".join(f'    *"{args} "*) echo "ran {run}"; exit {pytest_exit.get(run, 0)} ;;\n'
                    for run, args in RUNS.items())
    python = bin_dir / "python"
    python.write_text('#!/bin/bash\nargs="$* "\ncase "$args" in\n'
                      '    *"-m pip "*) exit 0 ;;\n' + cases + "esac\nexit 0\n")
    python.chmod(0o755)
    return bin_dir


def _run_sh(tmp: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(tmp / "tests" / "run.sh")], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.mark.parametrize("failing", ["main", "slurm", "vllm"])
def test_run_sh_exits_with_the_failing_pytest_runs_code(tmp_path, failing):
    done = _run_sh(tmp_path, _stub_checkout(tmp_path, {failing: 3}))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "exit code 3" in done.stdout.splitlines()[-1], done.stdout
    # Every run still ran, whichever failed; the two streams' logs are both there.
    assert all(f"ran {run}" in done.stdout for run in RUNS), done.stdout


def test_run_sh_passes_when_every_pytest_run_passes_and_stops_on_a_failed_install(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    done = _run_sh(ok, _stub_checkout(ok, {"vllm": 5}))  # 5: no test selected, no failure
    assert done.returncode == 0 and "exit code 0" in done.stdout, done.stdout + done.stderr
    assert all(f"ran {run}" in done.stdout for run in RUNS), done.stdout
    broken = tmp_path / "broken"
    broken.mkdir()
    done = _run_sh(broken, _stub_checkout(broken, {}, setup_exit=3))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "python -m pytest" not in done.stdout  # no test run after a failed install
