"""`megatron-entropy eval` as a user runs it (a fresh process): it checks its config before it
loads anything (a split the data does not have is one line at once, whatever the checkpoint),
and writes its result into the run folder, never into the model folder it reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _eval(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "eval",
                           str(REPO / "examples" / "quickstart.yaml"), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def test_a_split_the_data_lacks_is_refused_before_anything_loads(tmp_path):
    """The day-one command on the quickstart (arithmetic: no test split). A checkpoint that
    does not exist, or one whose weights are damaged, would fail on loading: the split's line
    comes first."""
    damaged = tmp_path / "damaged"
    shutil.copytree(REPO / "examples" / "quickstart_model", damaged)
    (damaged / "model.safetensors").write_bytes(b"not weights")
    for checkpoint in (damaged, tmp_path / "missing"):
        done = _eval("--checkpoint", str(checkpoint), cwd=tmp_path)
        assert (done.returncode, done.stderr.strip().splitlines()) == (2, [
            "megatron-entropy eval: error: data.task='arithmetic' has no test split: give test "
            "files (eval.files) or eval.split=val"]), done.stderr[-3000:]
    done = _eval("--checkpoint", str(tmp_path / "missing"), "eval.split=val", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"megatron-entropy eval: error: --checkpoint: " \
                                  f"{tmp_path / 'missing'} does not exist"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]


def test_the_result_goes_to_the_run_folder_not_the_model_folder(tmp_path):
    """An HF folder is read, nothing is written into it: the result lands in the config's run
    folder (runs/quickstart under the working directory), named after the split and the
    model."""
    model = tmp_path / "my_model"
    shutil.copytree(REPO / "examples" / "quickstart_model", model)
    before = sorted(p.name for p in model.iterdir())
    done = _eval("--checkpoint", str(model), "eval.split=val", "eval.num_problems=2",
                 "eval.n_samples=1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "runs" / "quickstart" / "eval_val_my_model.json"
    assert done.stdout.strip().splitlines()[-1] == f"wrote {Path('runs/quickstart') / out.name}"
    assert json.loads(out.read_text())["overall"]["problems"] == 2
    assert sorted(p.name for p in model.iterdir()) == before
