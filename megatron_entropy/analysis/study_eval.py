"""The study's final numbers from ``megatron-entropy eval`` (``study.eval_runs``): each run's
test-split result (``runs/NAME/eval.json``), each arm's mean and spread over seeds, the targets
that compare the Cov arms with the baseline on them, and the report's section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_entropy.analysis.study import RUN_EVAL_FILE

MIN_GAIN = 0.05  # a Cov arm's test pass@1 must beat the baseline's by 5 points


def run_test_numbers(run_dir: Path) -> Optional[dict[str, float]]:
    """A run's eval result flattened: pass@1_greedy, pass@k, avg@k, maj@k (all problems) and
    ``modes/<mode>_frac`` (and with tools ``tools/call_frac``); None when it has none."""
    path = run_dir / RUN_EVAL_FILE
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    out = {k: v for k, v in result["overall"].items() if k != "problems"}
    out["k_max"] = float(result["ks"][-1])
    for mode, v in result.get("modes", {}).items():
        out[f"modes/{mode}_frac"] = v["share"]
    if "tools" in result:  # with tools: the share of samples that called one
        out["tools/call_frac"] = result["tools"]["call_frac"]
    return out


def arm_test(numbers: Sequence[Optional[dict]], spread: Callable) -> Optional[dict]:
    """Each test metric's spread over the arm's runs that have one."""
    have = [n for n in numbers if n is not None]
    if not have:
        return None
    return {key: spread([n.get(key) for n in have]) for key in have[0]}


def eval_targets(arms: dict, base_name: str, add: Callable, min_seeds: int) -> None:
    """Per Cov arm: test pass@1 >= the baseline's + 5 points, the difference larger than twice
    the larger seed spread; pass@k_max above the baseline's."""
    base = arms.get(base_name, {}).get("test")
    if base is None:
        return
    for name, arm in arms.items():
        test = arm.get("test")
        if name == base_name or test is None or arm["loss"] not in ("clip_cov", "kl_cov"):
            continue
        n = min(test["pass@1"]["n"], base["pass@1"]["n"])
        few = f"not judged: {n} seed(s), the target needs >= {min_seeds}" \
            if n < min_seeds else ""
        a, b = test["pass@1"], base["pass@1"]
        gain = a["mean"] - b["mean"]
        noise = 2 * max(a["std"], b["std"])
        add(f"{name}: test pass@1 >= {base_name}'s + {MIN_GAIN * 100:.0f} points, the "
            "difference > 2x the seed spread",
            f"{a['mean']:.3f} (sd {a['std']:.3f}) vs {b['mean']:.3f} (sd {b['std']:.3f}): "
            f"{gain * 100:+.1f} points", None if few else gain >= MIN_GAIN and gain > noise, few)
        k = int(base["k_max"]["mean"])
        a, b = test.get(f"pass@{k}"), base.get(f"pass@{k}")
        if a and b:
            add(f"{name}: test pass@{k} above {base_name}'s",
                f"{a['mean']:.3f} vs {b['mean']:.3f}", None if few else a["mean"] > b["mean"],
                few)


def _cell(d: Optional[dict]) -> str:
    if d is None:
        return "n/a"
    return f"{d['mean']:.3f} ± {d['std']:.3f}" if d["n"] > 1 else f"{d['mean']:.3f}"


def render_test_section(arms: dict) -> list[str]:
    """The report's table of test-split numbers per arm (nothing when no run was evaluated)."""
    tested = {name: arm["test"] for name, arm in arms.items() if arm.get("test")}
    if not tested:
        return []
    first = next(iter(tested.values()))
    k = int(first["k_max"]["mean"])
    cols = [c for c in ("pass@1_greedy", "pass@1", f"pass@{k}", f"maj@{k}",
                        "modes/direct_frac", "modes/worked_frac", "tools/call_frac") if c in first]
    lines = ["", "## Test split (`megatron-entropy eval` of each run's last checkpoint)", "",
             "| arm | seeds | " + " | ".join(cols) + " |", "|" + " --- |" * (len(cols) + 2)]
    for name, test in tested.items():
        lines.append(f"| {name} | {test['pass@1']['n']} | "
                     + " | ".join(_cell(test.get(c)) for c in cols) + " |")
    return lines


def render_comparison(arms: dict) -> list[str]:
    """The comparison in one table: per arm, test pass@1, pass@16, pass@64 and the direct mode's
    share (when evaluated), entropy start -> end and the wall time of one run."""
    lines = ["", "## Comparison", "",
             "| arm | seeds | test pass@1 | test pass@16 | test pass@64 | entropy start -> end | "
             "direct share (test) | minutes a run |", "|" + " --- |" * 8]
    for name, arm in arms.items():
        test = arm.get("test") or {}
        entropy = f"{_cell(arm['entropy_start'])} -> {_cell(arm['entropy_end'])}"
        wall = arm.get("wall_s")
        minutes = "n/a" if wall is None else f"{wall['mean'] / 60:.1f}"
        cells = [_cell(test.get(k)) for k in ("pass@1", "pass@16", "pass@64",
                                              "modes/direct_frac")]
        lines.append(f"| {name} | {len(arm['seeds'])} | {' | '.join(cells[:3])} | {entropy} | "
                     f"{cells[3]} | {minutes} |")
    return lines
