"""What the tests of resumed optimizers share: an optimizer that resumes where a checkpoint
left it, inside a forked rank."""

from __future__ import annotations


def resumed_optimizer(chunks: list, run_dir: str, dtype: str, distributed: bool, first: int):
    """Inside a rank: the optimizer of ``chunks`` (lr 1e-2, no weight decay) and the run's
    CheckpointManager (keeping one checkpoint), loaded from its latest checkpoint when the run
    goes on at step ``first`` > 1."""
    from megatron_entropy.config import TrainerConfig
    from megatron_entropy.trainer.checkpoint import CheckpointManager
    from megatron_entropy.trainer.model_setup import build_optimizer

    # No clipping: the two optimizers sum the grad norm in other orders (per shard, then over
    # DP), so a clipped update would differ by the rounding of the clip coefficient.
    optimizer, _ = build_optimizer(chunks, TrainerConfig(lr=1e-2, grad_clip=0, weight_decay=0.0,
                                                         steps=1), dtype,
                                   distributed_optimizer=distributed)
    manager = CheckpointManager(run_dir, keep_last=1)
    if first > 1:
        assert manager.load(manager.latest(), chunks, optimizer)["step"] == first - 1
    return optimizer, manager
