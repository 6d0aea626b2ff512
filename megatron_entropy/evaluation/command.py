"""``megatron-entropy eval CONFIG --checkpoint PATH``: a checkpoint on a held-out split.

PATH is an HF model folder, a dist checkpoint (a step folder, or a run's ``checkpoints/`` folder
whose ``latest`` is used, or the run folder itself), converted to HF in a temporary folder first
(a LoRA run's adapters merged into its base).
The problems are the ``eval.split`` of the config's data (the hinted task has a test split that
no training run, tuning or early stopping reads; other data: ``eval.files``). The engine is
``rollout.engine`` (in-process, or a vLLM / SGLang server it starts); rewards are ``reward``'s.

Per problem: one greedy answer (``eval.greedy``) and ``eval.n_samples`` samples at
``eval.temperature`` / ``eval.top_p``; from them pass@1 greedy, pass@k (the unbiased estimator,
k = 1, 2, 4, ... n), avg@k and maj@k (the majority of the boxed answers of the first k samples),
overall and per data source, and for tasks with solution modes (data/hinted.py) each mode's
share and accuracy. The JSON result goes to ``--out`` (default: the run folder's
``eval_<split>_<checkpoint>.json``, never the model folder); a one-screen table to stdout. The
config, the split and the paths are checked before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from megatron_entropy.config import Config, ConfigError, DataConfig, load_config
from megatron_entropy.evaluation.passk import (avg_at_k, ks_up_to, maj_at_k, majority_answer,
                                               pass_at_k)
from megatron_entropy.runtime.harmless import silence_harmless_warnings


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the run's YAML config (its data, rollout, reward and eval "
                                  "sections)")
    p.add_argument("overrides", nargs="*", help="dotted overrides: eval.n_samples=64 ...")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="HF model folder, dist checkpoint, a run's checkpoints/ or run folder")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result (default: eval_<split>_<checkpoint>.json in the run folder "
                        "the checkpoint belongs to, else in the config's run folder)")


def model_folder(path: Path, scratch: Path) -> tuple[Path, Optional[Path]]:
    """(HF folder to serve, the dist checkpoint it was converted from or None)."""
    if (path / "config.json").is_file():
        return path, None
    from megatron_entropy.models.megatron_checkpoint import resolve_checkpoint_dir
    from megatron_entropy.trainer.lora_run import export_hf

    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint: {path} does not exist")
    ckpt = resolve_checkpoint_dir(path)
    export_hf(ckpt, scratch / "hf")  # a LoRA run's: merged into its base
    return scratch / "hf", ckpt


def _source_metrics(problems: list[dict], ks: list[int]) -> dict[str, float]:
    out: dict[str, float] = {"problems": float(len(problems))}
    if "greedy" in problems[0]:
        out["pass@1_greedy"] = sum(p["greedy"] for p in problems) / len(problems)
    for k in ks:
        out[f"pass@{k}"] = sum(p["pass"][k] for p in problems) / len(problems)
    for k in ks:
        out[f"avg@{k}"] = sum(p["avg"][k] for p in problems) / len(problems)
    for k in ks:
        out[f"maj@{k}"] = sum(p["maj"][k] for p in problems) / len(problems)
    return out


def score_problems(answers: list[str], sources: list[str], sampled: list[list[str]],
                   greedy: Optional[list[str]], scorer, ks: list[int]) -> list[dict]:
    """Per problem: its greedy reward, pass@k, avg@k, maj@k and its samples' rewards."""
    from megatron_entropy.rewards import last_boxed

    n = len(sampled[0])
    flat = [t for texts in sampled for t in texts]
    rewards = scorer(flat, [a for a in answers for _ in range(n)],
                     [s for s in sources for _ in range(n)])
    greedy_rewards = scorer(greedy, answers, sources) if greedy is not None else None
    extracted = [[last_boxed(t) for t in texts] for texts in sampled]
    # Each distinct (problem, majority answer) is scored once, by the same reward.
    votes = sorted({(i, a) for i, ans in enumerate(extracted) for k in ks
                    for a in [majority_answer(ans[:k])] if a is not None})
    vote_rewards = scorer([f"\\boxed{{{a}}}" for _, a in votes], [answers[i] for i, _ in votes],
                          [sources[i] for i, _ in votes])
    right = {v: r > 0 for v, r in zip(votes, vote_rewards)}
    out = []
    for i in range(len(answers)):
        rs = rewards[i * n:(i + 1) * n]
        c = sum(r > 0 for r in rs)
        p: dict[str, Any] = {
            "source": sources[i], "rewards": rs,
            "pass": {k: pass_at_k(n, c, k) for k in ks},
            "avg": {k: avg_at_k(rs, k) for k in ks},
            "maj": {k: maj_at_k(extracted[i], k, lambda a, i=i: right[(i, a)]) for k in ks}}
        if greedy_rewards is not None:
            p["greedy"] = float(greedy_rewards[i] > 0)
        out.append(p)
    return out


def summarize(problems: list[dict], ks: list[int]) -> dict[str, Any]:
    by_source: dict[str, list[dict]] = defaultdict(list)
    for p in problems:
        by_source[p["source"]].append(p)
    return {"overall": _source_metrics(problems, ks),
            "by_source": {s: _source_metrics(ps, ks) for s, ps in sorted(by_source.items())}}


def mode_summary(sources: list[str], sampled: list[list[str]], rewards: list[list[float]]
                 ) -> dict[str, dict[str, Optional[float]]]:
    """Share and accuracy of each solution mode among the samples, for tasks that have modes
    (data/task_metrics.py, as training logs them)."""
    from megatron_entropy.data.task_metrics import mode_shares, response_modes

    modes, mode_rewards = [], []
    for source, texts, rs in zip(sources, sampled, rewards):
        of_problem = response_modes(source, texts)
        modes += of_problem
        mode_rewards += rs[:len(of_problem)]
    return {mode: {"share": share, "accuracy": accuracy}
            for mode, (share, accuracy) in mode_shares(modes, mode_rewards).items()}


def render_table(result: dict[str, Any]) -> str:
    """One screen: a row per data source (and all), pass@1 greedy and pass / maj at each k."""
    ks = result["ks"]
    shown = [k for k in ks if k in (1, ks[-1]) or k in (4, 16)]
    cols = ["problems", *(["pass@1_greedy"] if result["settings"]["greedy"] else []),
            *(f"pass@{k}" for k in shown), f"avg@{ks[-1]}", *(f"maj@{k}" for k in shown[1:])]
    rows = [("all", result["overall"]), *result["by_source"].items()]
    width = max(len(name) for name, _ in rows)
    w = {c: max(len(c), 6) for c in cols}
    lines = [f"{'source':<{width}}  " + "  ".join(f"{c:>{w[c]}}" for c in cols)]
    for name, m in rows:
        cells = [f"{int(m[c]):>{w[c]}}" if c == "problems" else f"{m[c]:>{w[c]}.3f}"
                 for c in cols]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    for mode, v in result.get("modes", {}).items():
        acc = "-" if v["accuracy"] is None else f"{v['accuracy']:.3f}"
        lines.append(f"mode {mode}: {v['share']:.3f} of samples, accuracy {acc}")
    s = result["settings"]
    lines.append(f"{result['split']} split, {s['n_samples']} samples at T={s['temperature']} "
                 f"top-p {s['top_p']}; {result['model']}")
    return "\n".join(lines)


def evaluate(cfg: Config, checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """The eval of ``checkpoint`` under ``cfg`` (its data, rollout, reward and eval sections)."""
    from megatron_entropy.data.dataset import load_prompt_dataset, load_tokenizer
    from megatron_entropy.rewards import RewardScorer
    from megatron_entropy.rollout import SamplingParams
    from megatron_entropy.tool_use.engine import build_rollout_engine, prompt_tools

    e = cfg.eval
    model_dir, converted = model_folder(checkpoint, scratch)
    tokenizer = load_tokenizer(model_dir)
    data, split = eval_data(cfg)
    items = list(load_prompt_dataset(data, tokenizer, cfg.rollout.max_prompt_tokens, split,
                                     prompt_tools(cfg.rollout, tokenizer)))
    if e.num_problems:
        items = items[:e.num_problems]
    if not items:
        raise FileNotFoundError(f"eval: no problems in the {e.split} split")
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    engine = build_rollout_engine(cfg.rollout, model_dir, scratch)  # with tools: multi-turn
    scorer = RewardScorer(cfg.reward)
    try:
        prompts = [it.prompt_ids for it in items]
        completions = engine.generate(prompts, SamplingParams(
            n=e.n_samples, temperature=e.temperature, top_p=e.top_p, max_new_tokens=max_new,
            seed=e.seed))
        sampled = [[c.text for c in group] for group in completions]
        greedy = None
        if e.greedy:
            greedy = [group[0].text for group in engine.generate(prompts, SamplingParams(
                n=1, temperature=0.0, max_new_tokens=max_new, seed=e.seed))]
        ks = ks_up_to(e.n_samples)
        answers, sources = [it.answer for it in items], [it.source for it in items]
        problems = score_problems(answers, sources, sampled, greedy, scorer, ks)
    finally:
        scorer.close()
        engine.shutdown()
    result = {"model": str(checkpoint), "converted_from": str(converted) if converted else None,
              "split": "files" if e.files else e.split, "ks": ks,
              "settings": dataclasses.asdict(e), **summarize(problems, ks)}
    modes = mode_summary(sources, sampled, [p["rewards"] for p in problems])
    if modes:
        result["modes"] = modes
    tools = tool_summary(completions, [p["rewards"] for p in problems])
    if tools:
        result["tools"] = tools
    return result


def tool_summary(completions: list, rewards: list[list[float]]) -> dict[str, Any]:
    """With tools: the share of samples that called one, and the accuracy of those that did and
    of those that did not (None without such samples)."""
    pairs = [(c.meta["trajectory"].calls, r) for group, rs in zip(completions, rewards)
             for c, r in zip(group, rs) if "trajectory" in c.meta]
    if not pairs:
        return {}
    called = [r for calls, r in pairs if calls]
    not_called = [r for calls, r in pairs if not calls]
    accuracy = (lambda rs: sum(r > 0 for r in rs) / len(rs) if rs else None)  # noqa: E731
    return {"call_frac": len(called) / len(pairs), "accuracy_with_calls": accuracy(called),
            "accuracy_without_calls": accuracy(not_called)}


def eval_data(cfg: Config) -> tuple[DataConfig, str]:
    """The data and split the eval reads: eval.files as a validation split, else the config's
    data's eval.split."""
    if cfg.eval.files:
        return dataclasses.replace(cfg.data, val_files=list(cfg.eval.files)), "val"
    return cfg.data, cfg.eval.split


def check_eval(cfg: Config, checkpoint: Path) -> None:
    """What the config and the command line say, checked before anything loads: the split
    exists, eval.files and the checkpoint are there."""
    data, split = eval_data(cfg)
    problem = data.split_problem(split)
    if problem:
        raise ConfigError(problem)
    for f in cfg.eval.files:
        if not Path(f).is_file():
            raise ConfigError(f"eval.files: {f!r} does not exist")
    if not checkpoint.exists():
        raise FileNotFoundError(f"--checkpoint: {checkpoint} does not exist")


def default_out(checkpoint: Path, split: str, run_dir: Path) -> Path:
    """Where the result goes without --out, never into a model folder: the run folder the
    checkpoint belongs to (a run folder, its checkpoints/ or one of their step folders), else
    ``run_dir`` (the config's); named after the split and the checkpoint."""
    from megatron_entropy.models.megatron_checkpoint import read_latest

    folder = checkpoint / "checkpoints" if (checkpoint / "checkpoints").is_dir() else checkpoint
    if (folder / "latest").is_file():
        folder = read_latest(folder)
    if folder.parent.name == "checkpoints":  # a step of a run
        run_dir = folder.parent.parent
    return run_dir / f"eval_{split}_{folder.name}.json"


def run_eval(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    check_eval(cfg, args.checkpoint)
    out = args.out or default_out(args.checkpoint, "files" if cfg.eval.files else
                                  cfg.eval.split, cfg.run_dir)
    silence_harmless_warnings()  # the megatron-core notes `train` hides
    with tempfile.TemporaryDirectory(prefix="megatron_entropy_eval_") as scratch:
        result = evaluate(cfg, args.checkpoint, Path(scratch))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(render_table(result))
    print(f"wrote {out}")
    return 0


EVAL = ("a checkpoint on a held-out split: pass@1 greedy, pass@k, avg@k and maj@k per data "
        "source (eval section)", add_eval_args, run_eval)
