"""Which settings let the step's first update score its own samples (trainer/actor.py): all that
read no old log-prob or entropy of its samples before its forward."""

from __future__ import annotations

import pytest

from megatron_entropy.algorithms.rollout_correction import RolloutCorrectionSettings
from megatron_entropy.algorithms.token_rules import TokenRuleSettings
from megatron_entropy.config import AlgorithmConfig
from megatron_entropy.trainer.actor import first_update_scores_itself


@pytest.mark.parametrize("settings,moe,scores", [
    ({}, False, True),  # the defaults: KL-Cov at micro-batch scope, no rules, no correction
    (dict(loss="ppo_clip"), False, True),
    (dict(loss="clip_cov"), False, True),
    (dict(loss="ppo_clip", token_rules=TokenRuleSettings(high_entropy_minority=True)), False,
     True),  # chooses with its own forward's entropies
    (dict(old_logprobs="engine"), False, True),  # the engine's exist for everything before
    ({}, True, False),  # the recompute records the routing the update replays
    (dict(loss="kl_cov", cov_scope="global"), False, False),  # chooses over the whole step
    (dict(loss="ppo_clip", token_rules=TokenRuleSettings(high_entropy_minority=True,
                                                         high_entropy_scope="global")),
     False, False),
    (dict(loss="ppo_clip", token_rules=TokenRuleSettings(entropy_clip=True,
                                                         entropy_clip_scope="global")),
     False, False),
    (dict(token_rules=TokenRuleSettings(entropy_advantage=True)), False, False),
    (dict(rollout_correction=RolloutCorrectionSettings(mode="tis")), False, False),
    (dict(rollout_correction=RolloutCorrectionSettings(mode="mis")), False, False),
])
def test_what_reads_the_old_policy_before_the_first_forward_keeps_the_recompute(settings, moe,
                                                                                scores):
    assert first_update_scores_itself(AlgorithmConfig(**settings), moe) is scores
