"""What a user sees on the console: the progress bar of a run and no known-harmless noise."""

from __future__ import annotations

import logging
import re
import warnings

from megatron_entropy.runtime.harmless import HARMLESS_LOG_LINES, silence_harmless_warnings
from megatron_entropy.config import LoggingConfig
from megatron_entropy.trainer.metrics import MetricsLogger

RERUN_LOGGER = "megatron.core.rerun_state_machine"


def test_progress_bar_counts_training_steps_not_the_validation_before_them(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, total_steps=3, enabled=True,
                           settings=LoggingConfig(progress_bar=True))
    logger.log(0, {"val/acc/mean": 0.25})  # validation before the first step
    for step in (1, 2, 3):
        logger.log(step, {"acc/mean": 0.5})
    logger.close()
    renders = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
               if line.startswith("RL steps")]
    assert "3/3" in renders[-1], renders
    assert "val=0.25" in renders[-1]  # the last validation stays on the bar
    # Every render counts at most the 3 training steps out of 3 (not "4/3", not an open-ended
    # "4it"; a rate such as "2486.74it/s" is no count).
    assert all(re.search(r"\| [0-3]/3 \[", line) for line in renders), renders


def test_known_harmless_warnings_are_silenced_and_real_ones_kept(caplog):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_harmless_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch "
                      "optimizers.", UserWarning)
        warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning)
        warnings.warn("full scope is deprecated. Use empty cuda_graph_scope to capture the whole "
                      "layer.", UserWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("When using async grad allreduce it is recommended to set the environment "
                      "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning)
        warnings.warn("Apex is not installed, and this is a real problem", DeprecationWarning)
        warnings.warn("a real warning", UserWarning)
    assert [str(w.message) for w in seen] == ["Apex is not installed, and this is a real problem",
                                              "a real warning"]
    log = logging.getLogger(RERUN_LOGGER)
    with caplog.at_level(logging.WARNING):
        for line in HARMLESS_LOG_LINES:
            log.warning(line)
        log.warning("RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS")
    assert [r.getMessage() for r in caplog.records] == [
        "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS"]
