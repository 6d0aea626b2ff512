"""``megatron-entropy plot RUN_DIR``, ``megatron-entropy fit RUN_DIR`` and
``megatron-entropy study CONFIG``.

Kept free of torch: the CLI builds its parser from here before any command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from megatron_entropy.analysis.entropy_law import (ceiling_interval, fit_and_predict,
                                                   fit_entropy_law, law_warning)
from megatron_entropy.analysis.plots import law_points, plot_run, read_metrics
from megatron_entropy.config import ConfigError

# Deferred imports: the study's modules load torch (trainer/checkpoint.py), so they load when
# `study` runs and `megatron-entropy --help` stays without torch.


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (runs/<name>) or its metrics.jsonl")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots)")


def run_plot(args: argparse.Namespace) -> int:
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run folder (runs/<name>) or its metrics.jsonl")
    p.add_argument("--entropy-key", default=None,
                   help="x axis (default: entropy/seq_mean, else entropy/token_mean)")
    p.add_argument("--performance-key", default=None,
                   help="y axis (default: val/acc/mean, else acc/mean, else reward/mean)")
    p.add_argument("--fit-points", type=int, default=None,
                   help="also fit on only the first K points and report how well that predicts "
                        "the rest (default: half of the points, when there are at least 6)")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="resamples of the ceiling's bootstrap interval (0: none)")
    p.add_argument("--confidence", type=float, default=0.95, help="of the interval")
    p.add_argument("--seed", type=int, default=0, help="of the bootstrap (reproducible)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_fit(args: argparse.Namespace) -> int:
    h, r, hk, rk = law_points(read_metrics(args.run_dir), args.entropy_key, args.performance_key)
    try:
        fit = fit_entropy_law(h, r)
    except ValueError as e:
        print(f"megatron-entropy fit: error: {args.run_dir}: {e} (steps with both an entropy and "
              f"a performance value: {len(h)})", file=sys.stderr)
        return 2
    out: dict = {"entropy_key": hk, "performance_key": rk, **fit.to_dict()}
    if args.bootstrap and len(h) >= 3:
        try:
            out["ceiling_interval"] = ceiling_interval(h, r, args.bootstrap, args.confidence,
                                                       args.seed).to_dict()
        except ValueError as e:
            print(f"megatron-entropy fit: error: {e}", file=sys.stderr)
            return 2
    warning = law_warning(fit, r)
    if warning:
        out["warning"] = warning
        print(f"megatron-entropy fit: warning: {args.run_dir}: {warning}", file=sys.stderr)
    k = args.fit_points if args.fit_points is not None else (len(h) // 2 if len(h) >= 6 else None)
    if k is not None:
        out["extrapolation"] = fit_and_predict(h, r, k).to_dict()
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{rk} = -a * exp({hk}) + b over {fit.n} steps")
    print(f"  a = {fit.a:.6g}   b = {fit.b:.6g}   R^2 = {fit.r2:.4f}")
    print(f"  ceiling at entropy 0 (b - a) = {fit.ceiling:.4f}")
    if "ceiling_interval" in out:
        ci = out["ceiling_interval"]
        print(f"  {ci['confidence']:.0%} bootstrap interval of the ceiling: [{ci['low']:.4f}, "
              f"{ci['high']:.4f}] ({ci['resamples']} resamples of the {fit.n} steps, "
              f"seed {ci['seed']})")
    if "extrapolation" in out:
        e = out["extrapolation"]
        print(f"  fit on the first {e['k']} steps (a = {e['fit/a']:.4g}, b = {e['fit/b']:.4g}) "
              f"predicts the other {fit.n - e['k']}: mean |error| {e['mae']:.4f}, "
              f"max {e['max_abs_error']:.4f}, at the last step {e['final_error']:+.4f}")
    return 0


PLOT = ("write PNG plots of a run: entropy, reward, covariance, reward vs entropy",
        add_plot_args, run_plot)
FIT = ("fit the entropy law R = -a*exp(H) + b to a run and report its ceiling b - a",
       add_fit_args, run_fit)


def add_study_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config with a study section "
                                  "(examples/study_quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run and the study "
                                                "section, before the options: trainer.lr=1e-4 "
                                                "study.sweep_seeds=2")
    p.add_argument("--losses", default=None,
                   help="comma-separated study.losses names to compare (default: all)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: study.seeds)")
    p.add_argument("--out", default=None, help="study folder (default: "
                                               "<logging.runs_dir>/<logging.name>_study[_quick])")
    p.add_argument("--quick", action="store_true",
                   help="the same matrix at toy length (the study.quick overrides first)")
    p.add_argument("--jobs", type=int, default=None,
                   help="runs trained at once, each with its share of the cores as threads "
                        "(default: study.jobs)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the runs and what sets each apart; run nothing")


def _comma_list(text: Optional[str], flag: str, integers: bool = False) -> Optional[list]:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        values = [int(t) for t in items] if integers else items
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values:
        raise ConfigError(f"{flag}: empty list")
    return values


def run_study(args: argparse.Namespace) -> int:
    from megatron_entropy.analysis.study import StudyError, plan_study
    from megatron_entropy.analysis.study_runner import execute

    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs: {args.jobs} must be at least 1")
    plan = plan_study(args.config, args.overrides, args.out, args.quick,
                      _comma_list(args.losses, "--losses"),
                      _comma_list(args.seeds, "--seeds", integers=True))
    if args.dry_run:
        print(f"{len(plan.runs)} runs into {plan.out}:")
        for run in plan.runs:
            roles = ", ".join(f"{role}={value}" for role, value in run.roles)
            print(f"  {run.name} [{roles}]: {' '.join(run.own)}")
        if plan.pending:
            print(f"then {len(plan.pending) * len(plan.seeds)} runs of {', '.join(plan.pending)} "
                  "at the values their tuning runs choose")
        return 0
    try:
        return execute(plan, jobs=plan.study.jobs if args.jobs is None else args.jobs)
    except StudyError as e:
        print(f"megatron-entropy study: error: {e}", file=sys.stderr)
        return 1


STUDY = ("run a config's study matrix (losses x seeds, entropy bonus, threshold sweep) and write "
         "OUT/report.md with the paper's figures at toy scale", add_study_args, run_study)
