"""``megatron-entropy eval``: a checkpoint on a held-out split, pass@k and majority vote
(passk.py: the pure math; settings.py: the ``eval`` config section; command.py: the command)."""
