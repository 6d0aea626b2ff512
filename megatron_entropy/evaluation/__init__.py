"""``megatron-entropy eval``: a checkpoint on a held-out split, pass@k and majority vote
(passk.py: the pure math; command.py: the command; the ``eval`` config section is
config/evaluation.py)."""
