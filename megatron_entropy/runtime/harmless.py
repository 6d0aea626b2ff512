"""megatron-core's known-harmless lines, hidden in the processes of `train` and `convert` (this
process only; every other warning and log line stays)."""

from __future__ import annotations

import logging
import warnings

# megatron-core's start-up notes that are known to be harmless, matched by the start of their
# message: fallbacks on machines without Transformer Engine/Apex, deprecations inside
# megatron-core and torch that a user cannot act on. Every other warning stays.
HARMLESS_WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated"),
    # On every resume, from torch.distributed.checkpoint as megatron-core calls it.
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # `convert` saves a checkpoint in one process, on purpose (`train` always has a group).
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
                  r"intent is to save in a single process"),
)
# A GPU hint (CUDA_DEVICE_MAX_CONNECTIONS), only noise where there is no GPU.
CPU_ONLY_HARMLESS_WARNINGS = (
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment "
                  r"variable CUDA_DEVICE_MAX_CONNECTIONS"),
)
# Printed through megatron-core's logger at WARNING on every start.
HARMLESS_LOG_LINES = ("Implicit initialization of Rerun State Machine!",
                      "RerunStateMachine initialized in mode RerunMode.DISABLED")


# A failed checkpoint write, logged by dist_checkpointing's parent of the writer processes
# ("Local process 0 encountered an error: ..."), which the trainer reports itself as one line
# (or, for a failure that is no disk error, raises with that same text).
WRITER_FAILURE_PREFIX = "Local process "
_LOGGERS = {"megatron.core.rerun_state_machine":
            lambda message: message in HARMLESS_LOG_LINES,
            "megatron.core.dist_checkpointing.strategies.filesystem_async":
            lambda message: message.startswith(WRITER_FAILURE_PREFIX)
            and " encountered an error" in message}


def silence_harmless_warnings() -> None:
    """Hide the known-harmless lines of megatron-core (this process only)."""
    import torch

    cpu_only = () if torch.cuda.is_available() else CPU_ONLY_HARMLESS_WARNINGS
    for category, message in HARMLESS_WARNINGS + cpu_only:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, hidden in _LOGGERS.items():
        logging.getLogger(name).addFilter(
            lambda record, hidden=hidden: not hidden(record.getMessage()))
