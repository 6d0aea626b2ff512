"""The trainer: the Megatron actor, the RL loop, rollouts and their share per rank,
checkpoints and the step's metrics. Nothing is imported here: each module loads what it needs
(the CLI loads the loop only once a run starts)."""
