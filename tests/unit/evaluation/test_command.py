"""Where `megatron-entropy eval` writes without --out: the run folder a checkpoint belongs to,
else the config's run folder; never a model folder."""

from __future__ import annotations

from pathlib import Path

from megatron_entropy.evaluation.command import default_out


def test_default_out_is_a_run_folder(tmp_path):
    run, elsewhere = tmp_path / "runs" / "r", tmp_path / "runs" / "mine"
    step = run / "checkpoints" / "step_00000020"
    step.mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000020\n")
    model = tmp_path / "models" / "qwen"  # an HF folder, or a converted checkpoint
    model.mkdir(parents=True)
    for checkpoint in (run, run / "checkpoints", step):
        assert default_out(checkpoint, "test", elsewhere) == run / "eval_test_step_00000020.json"
    assert default_out(model, "val", elsewhere) == elsewhere / "eval_val_qwen.json"
