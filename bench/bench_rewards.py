"""Reward scoring time, in this process against reward.workers processes.

    PYTHONPATH=. python bench/bench_rewards.py

Three rewards over one round of responses: the math reward on integer answers (no checker) and on
LaTeX answers (every one goes to math-verify's checker process), and a reward that waits 20 ms per
response (a stand-in for code execution or a remote call). Each is timed with workers = 1 (in
this process) and 2, 4 (the pool, started and warmed before the clock runs), best of 3; the rewards
must be the same at every setting. Prints a markdown table.
"""

from __future__ import annotations

import time

from megatron_entropy.config import RewardConfig
from megatron_entropy.data import generate_problems
from megatron_entropy.rewards import RewardScorer

WAIT_REWARD = "bench/bench_rewards.py:wait_reward"


def wait_reward(response: str, ground_truth: str) -> float:
    time.sleep(0.02)
    return float(len(response) % 2)


def _cases() -> dict[str, tuple[str, list[str], list[str]]]:
    problems = generate_problems(2048, 1, 3, 20, seed=0)
    latex = [("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{\\dfrac{1}{2}}", "1/2"),
             ("\\boxed{(1, 2)}", "(1,2)"), ("\\boxed{\\pi}", "3.14159")] * 32
    return {"math, 2048 integer answers": ("math", [p.solution for p in problems],
                                           [p.answer for p in problems]),
            "math, 128 LaTeX answers": ("math", [r for r, _ in latex], [t for _, t in latex]),
            "20 ms a response, 128": (WAIT_REWARD, [str(i) for i in range(128)], [""] * 128)}


def main() -> None:
    print("| rewards | workers=1 | workers=2 | workers=4 |\n|---|---|---|---|")
    for name, (function, responses, truths) in _cases().items():
        cells, reference = [], None
        for workers in (1, 2, 4):
            scorer = RewardScorer(RewardConfig(function=function, workers=workers))
            try:
                scorer(responses[:8], truths[:8])  # start the workers and their checkers
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    rewards = scorer(responses, truths)
                    best = min(best, time.perf_counter() - start)
            finally:
                scorer.close()
            assert reference is None or rewards == reference, f"{name}: workers={workers} differ"
            reference = rewards
            cells.append(f"{best:.3f} s")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
