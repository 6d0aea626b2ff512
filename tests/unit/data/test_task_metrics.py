"""The task hook for per-response metrics: the hinted task's solution modes, the same numbers
in a training step's metrics and in ``eval``'s result; nothing for a task without modes."""

from __future__ import annotations

import pytest

from megatron_entropy.data import PromptItem
from megatron_entropy.data.task_metrics import mode_shares, response_modes
from megatron_entropy.evaluation.command import mode_summary
from megatron_entropy.rollout.base import Completion
from megatron_entropy.trainer.rollouts import Group, GroupStats, mode_metrics

TEXTS = {"hinted_3terms": ["\\boxed{38}", "13+7=20\n20+18=\\boxed{38}", "\\boxed{48}", "x"],
         "hinted_4terms": ["\\boxed{5}", "1+2=3\n3+2=\\boxed{5}"],
         "sums_3terms": ["\\boxed{38}", "\\boxed{1}"]}
REWARDS = {"hinted_3terms": [1.0, 1.0, 0.0, 0.0], "hinted_4terms": [0.0, 1.0],
           "sums_3terms": [1.0, 0.0]}


def _group(source: str) -> Group:
    return Group(PromptItem([1, 2], "38", source, ""),
                 [Completion([3], [-0.1], t, "stop") for t in TEXTS[source]], REWARDS[source])


def test_training_and_eval_report_the_same_modes():
    sources = sorted(TEXTS)
    train = mode_metrics([GroupStats.of(_group(s)) for s in sources], prefix="val/")
    evaluated = mode_summary(sources, [TEXTS[s] for s in sources], [REWARDS[s] for s in sources])
    # 6 hinted responses: direct 3 (1 right), worked 2 (2 right), no tool call, other 1 (0 right).
    assert evaluated == {
        "direct": {"share": pytest.approx(3 / 6), "accuracy": pytest.approx(1 / 3)},
        "worked": {"share": pytest.approx(2 / 6), "accuracy": 1.0},
        "tool": {"share": 0.0, "accuracy": None},
        "other": {"share": pytest.approx(1 / 6), "accuracy": 0.0}}
    assert train == {f"val/modes/{m}_{k}": v[name] for m, v in evaluated.items()
                     for k, name in (("frac", "share"), ("acc", "accuracy"))
                     if v[name] is not None}  # no accuracy of a mode no response is in


def test_a_task_without_modes_gets_nothing():
    assert response_modes("sums_3terms", TEXTS["sums_3terms"]) == ()
    assert GroupStats.of(_group("sums_3terms")).modes == ()
    assert mode_metrics([GroupStats.of(_group("sums_3terms"))]) == {}
    assert mode_summary(["sums_3terms"], [TEXTS["sums_3terms"]], [REWARDS["sums_3terms"]]) == {}
    assert mode_shares([], []) == {}


def test_a_mode_no_response_is_in_has_a_share_but_no_accuracy():
    assert mode_shares(["direct", "direct"], [1.0, 0.0]) == {
        "direct": (1.0, 0.5), "worked": (0.0, None), "tool": (0.0, None), "other": (0.0, None)}
