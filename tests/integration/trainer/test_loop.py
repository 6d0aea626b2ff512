"""The RL loop end to end: real Megatron actor (TP=2 / DP=2 over gloo), in-process engine, rewards,
checkpoints, resume, and the CLI's errors."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import (STABLE, kill_after_first_step, metrics_rows, run_distributed,
                     tiny_run_config, train_cli, train_from_dict, with_sections)
from serving_model import make_tp2_model
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (4 heads, 2 KV heads: TP=2 works) with a BPE tokenizer."""
    return make_tp2_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def engine_actor_rounding(model_dir) -> tuple[float, int, int]:
    """The engine (transformers, batched, KV cache) and the actor (Megatron, TP/PP) compute the
    same fp32 log-probs in another order: (the scale of their rounding, |log p| <= log V + 2
    max|z|; the terms along one log-prob's path; the vocabulary size). max|z| is the initial
    model's on random tokens, doubled for what 3 steps at lr 1e-3 can add."""
    import torch
    import transformers

    from megatron_entropy.models.arch import load_arch

    arch = load_arch(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = torch.randint(0, arch.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        max_logit = float(model(tokens).logits.abs().max())
    rollout = _config(model_dir, model_dir, "")["rollout"]
    seq = rollout["max_prompt_tokens"] + rollout["max_new_tokens"]
    return (math.log(arch.vocab_size) + 4 * max_logit,
            transformer_terms(arch, seq, log_softmax=True), arch.vocab_size)


@pytest.fixture(scope="module")
def drift_tol(engine_actor_rounding) -> float:
    """|engine - actor| of one log-prob (``engine_actor_rounding``)."""
    scale, terms, _ = engine_actor_rounding
    return rounding_tol(scale, terms)


def _config(model_dir: Path, run_dir: Path, name: str, **extra) -> dict:
    return with_sections(tiny_run_config(model_dir, run_dir, name, parallel={"tensor": 2}),
                         **extra)


def _metrics(run_dir: Path, name: str) -> list[dict]:
    return metrics_rows(run_dir / name)


EXPECTED_KEYS = {"reward/mean", "acc/mean", "entropy/token_mean", "entropy/seq_mean",
                 "cov/mean", "cov/selected_mean", "loss/selected_frac", "loss/ppo_kl", "grad_norm",
                 "lr", "response/length_mean", "response/truncated_frac", "rollout/logprob_drift",
                 "perf/tokens_per_s", "time/rollout", "time/update", "time/sync",
                 "weight_sync/seconds", "weight_sync/bytes", "weight_sync/tensors",
                 "data/dropped_overlong", "data/prompt_repeats_per_step"}


@pytest.mark.parametrize("tensor,pipeline", [(2, 1), (1, 2)])
def test_run_writes_finite_metrics_and_engine_matches_actor(model_dir, drift_tol, tmp_path,
                                                            tensor, pipeline):
    # At PP=2 with truncated IS: the correction runs on every stage, its metrics on the last.
    correction = {"rollout_correction": {"mode": "tis"}} if pipeline == 2 else {}
    cfg = _config(model_dir, tmp_path, "tp2", parallel={"tensor": tensor, "pipeline": pipeline},
                  algorithm=correction)
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    rows = _metrics(tmp_path, "tp2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    hf_bytes = sum(t.numel() * 4 for t in load_file(model_dir / "model.safetensors").values())
    for r in rows:
        assert EXPECTED_KEYS <= r.keys(), EXPECTED_KEYS - r.keys()
        # The engine's sync metrics under the names docs/metrics.md documents, once: every HF
        # tensor (fp32) went to the engine.
        assert r["weight_sync/bytes"] == hf_bytes
        assert not [k for k in r if k.startswith("sync/")]
        bad = {k: v for k, v in r.items() if not (isinstance(v, (int, float))
                                                  and math.isfinite(v))}
        assert not bad, bad
        # Right after each weight sync the engine samples with the actor's weights: its
        # log-probs of the sampled tokens equal the actor's recompute (temperature 1).
        assert r["rollout/logprob_drift_max"] <= drift_tol
        sources = [k[len("rollout/"):-len("/logprob_drift_p50")] for k in r
                   if re.fullmatch(r"rollout/.+/logprob_drift_p50", k)]
        assert sources
        for src in sources:
            p50, p90, p99 = (r[f"rollout/{src}/logprob_drift_p{q}"] for q in (50, 90, 99))
            assert p50 <= p90 <= p99 <= r["rollout/logprob_drift_max"]
        if correction:  # weights e^(+-drift), within drift_tol of 1 (to first order)
            assert abs(r["rollout_corr/weight_max"] - 1) <= 2 * drift_tol
            assert abs(r["rollout_corr/weight_mean"] - 1) <= 2 * drift_tol
        # max_new_tokens=12 cuts responses: truncated, marked, and trained on, not a crash
        assert r["response/length_max"] <= 12
    assert any(r["response/truncated_frac"] > 0 for r in rows)
    ckpts = sorted(p.name for p in (tmp_path / "tp2" / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000002", "step_00000003"]  # keep_last=2


def test_resume_on_another_layout(model_dir, drift_tol, tmp_path):
    """A TP=2 run's checkpoint resumes as PP=2: Megatron reshards model and optimizer."""
    cfg = _config(model_dir, tmp_path, "relayout", trainer={"steps": 1})
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    cfg = _config(model_dir, tmp_path, "relayout", parallel={"tensor": 1, "pipeline": 2},
                  trainer={"steps": 2})
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    rows = _metrics(tmp_path, "relayout")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["rollout/logprob_drift_max"] <= drift_tol
    # The drift's trend window came back with the checkpoint: step 2's slope spans steps 1-2.
    assert "rollout/logprob_drift_slope" not in rows[0]
    assert rows[1]["rollout/logprob_drift_slope"] == pytest.approx(
        rows[1]["rollout/logprob_drift"] - rows[0]["rollout/logprob_drift"], rel=1e-9, abs=1e-18)


def _gather_everything_reference(engine, rounds, sampling, reward_fn, shared, target_groups):
    """The path the trainer took before DP shares (the reference for them): every rank receives
    every scored group (all_gather_object), filters, computes advantages and keeps its share."""
    import torch
    import torch.distributed as dist

    from megatron_entropy.algorithms.advantages import compute_advantages
    from megatron_entropy.data import GroupFilter
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.trainer.batch import Sample
    from megatron_entropy.trainer.rollouts import GroupStats, dp_share, generate_round, served_by

    keep = GroupFilter(target_groups, max_refill_rounds=3)
    generated, received = [], 0
    while not keep.done:
        items = rounds[keep.rounds][:keep.prompts_needed()]
        local, _, _ = generate_round(engine, items, SamplingParams(**{
            **vars(sampling), "seed": sampling.seed * 31 + keep.rounds}), reward_fn, shared)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        received += sum(len(pickle.dumps(part)) for r, part in enumerate(gathered)
                        if r != dist.get_rank())
        groups = [g for i in range(len(items)) for part in gathered for j, g in part.items()
                  if j == i]
        generated += groups
        keep.add(groups, [g.rewards for g in groups])
    kept = keep.take()
    samples = [Sample(prompt_ids=list(g.item.prompt_ids), response_ids=list(c.token_ids),
                      engine_logprobs=list(c.logprobs), engine_entropies=c.entropies,
                      reward=r, group=gi, source=g.item.source, **served_by(c))
               for gi, g in enumerate(kept) for c, r in zip(g.completions, g.rewards)]
    adv = compute_advantages("grpo", torch.tensor([s.reward for s in samples]),
                             torch.tensor([s.group for s in samples]), norm_by_std=True)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return dp_share(samples), [GroupStats.of(g) for g in generated], received


def _dp_share_worker(model_dir: str, tensor: int, pipeline: int, shared: bool):
    """Worker: one step's rollouts (dynamic sampling, refills) by DP share and by the reference
    path, with a real in-process engine on the ranks that talk to one; with a shared engine also
    by the asynchronous path's rank-0 generation + distribution (the same samples)."""
    import torch.distributed as dist

    from harness import init_megatron
    from megatron_entropy.data import PromptItem, load_tokenizer
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.trainer.rollouts import (collect_step_groups, groups_to_samples,
                                                   rollout_metrics)

    init_megatron(tensor, pipeline)
    leader = dist.get_rank() == 0 if shared else dist.get_rank() % (tensor * pipeline) == 0
    engine = InProcessEngine(model_dir) if leader else None
    tok = load_tokenizer(model_dir)
    rounds = [[PromptItem(tok.encode(f"{r} + {i} ="), str(r + i), f"src{i % 2}", "")
               for i in range(6)] for r in range(4)]

    def reward_fn(texts, answers, sources):  # of the text, with variance inside most groups
        return [float(len(t) % 3 == 0) for t in texts]

    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=11)
    feed = iter(rounds)
    step = collect_step_groups(engine, lambda n: next(feed)[:n], sampling, reward_fn, shared,
                               target_groups=5, dynamic_sampling=True, max_refill_rounds=3)
    mine = groups_to_samples(step, "grpo", True)
    if shared:  # the asynchronous path's split: rank 0 alone generates, then distributes
        from megatron_entropy.trainer.rollouts import distribute_step, generate_step_local

        feed = iter(rounds)
        local = generate_step_local(engine, lambda n: next(feed)[:n], sampling, reward_fn,
                                    target_groups=5, dynamic_sampling=True,
                                    max_refill_rounds=3) if dist.get_rank() == 0 else None
        split, _ = distribute_step(local)
        assert groups_to_samples(split, "grpo", True) == mine
        assert (split.kept, split.generated) == (step.kept, step.generated)
        assert {k: v for k, v in split.metrics.items() if k != "rollout/bytes_received"} == \
            {k: v for k, v in step.metrics.items() if k != "rollout/bytes_received"}
    ref, ref_generated, ref_bytes = _gather_everything_reference(
        engine, rounds, sampling, reward_fn, shared, 5)
    return (mine, ref, rollout_metrics(step.generated), rollout_metrics(ref_generated),
            step.metrics, ref_bytes)


@pytest.mark.parametrize("world,tensor,pipeline,shared", [
    (2, 1, 1, False), (2, 1, 1, True), (2, 2, 1, True), (2, 1, 2, False)])
def test_dp_shares_equal_the_gather_everything_path(model_dir, world, tensor, pipeline, shared):
    """Each rank receives only its DP share of the kept groups, and trains on exactly the
    samples (tokens, log-probs, rewards, advantages, order) the gather-everything path gave it:
    the same update, bit for bit. Metrics over every generated group are the same."""
    out = run_distributed(_dp_share_worker, world, str(model_dir), tensor, pipeline, shared,
                          timeout=120)
    dp = world // (tensor * pipeline)
    for rank, (mine, ref, metrics, ref_metrics, step_metrics, ref_bytes) in enumerate(out):
        assert mine == ref, rank
        assert metrics == ref_metrics
        assert {s.group % dp for s in mine} == {(rank // (tensor * pipeline)) % dp}
    assert step_metrics["data/sampling_rounds"] > 1  # refills happened: shares span rounds
    assert {s.group for o in out for s in o[0]} == set(range(int(step_metrics["data/groups"])))
    # The most any rank received: its share and the statistics, less than everything.
    assert 0 < step_metrics["rollout/bytes_received"] < max(o[5] for o in out)


def test_bf16_run_with_the_distributed_optimizer_resumes_across_a_change_of_dp(model_dir,
                                                                              tmp_path):
    """bf16 params with fp32 main weights and Adam moments (Megatron's mixed-precision optimizer)
    sharded by the distributed optimizer over DP=2 on gloo: a step updates the weights (an
    entropy bonus gives gradients whatever the rewards of the random model), and its checkpoint
    resumes at DP=1 x TP=2 (optimizer state resharded) for another step."""
    extra = dict(model={"dtype": "bf16"}, algorithm={"entropy_coef": 0.01})
    cfg = _config(model_dir, tmp_path, "bf16", parallel={"tensor": 1},
                  trainer={"steps": 1, "distributed_optimizer": True}, **extra)
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    state = json.loads((tmp_path / "bf16" / "checkpoints" / "step_00000001"
                        / "trainer_state.json").read_text())
    assert state["optimizer_state"] and state["layout"] == {"world": 2, "tensor": 1,
                                                            "pipeline": 1, "expert": 1,
                                                            "context": 1}
    cfg = _config(model_dir, tmp_path, "bf16", trainer={"steps": 2, "distributed_optimizer": True},
                  **extra)
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    rows = _metrics(tmp_path, "bf16")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["grad_norm"] > 0 and not r["loss/update_skipped"]
        bad = {k: v for k, v in r.items() if not (isinstance(v, (int, float))
                                                  and math.isfinite(v))}
        assert not bad, bad


def test_dp2_counts_the_tokens_of_every_engine(model_dir, tmp_path):
    """At DP=2 each replica's leader runs its own in-process engine: the step's response tokens
    and rates count both engines' work, not rank 0's half. No validation and no weight check:
    the engines generate only the step's rollouts, every sample of which is kept."""
    cfg = _config(model_dir, tmp_path, "dp2tok", parallel={"tensor": 1},
                  rollout={"weight_check": {"enabled": False}},
                  trainer={"steps": 2, "save_interval": 0})
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    rows = _metrics(tmp_path, "dp2tok")
    samples = cfg["data"]["prompts_per_step"] * cfg["rollout"]["n_samples"]
    for r in rows:
        generated = r["response/length_mean"] * samples  # every generated sample, all ranks
        assert r["rollout/response_tokens"] == pytest.approx(generated, rel=1e-12)
        # The rate is all engines' tokens over the longest engine's generating time. Rank 0's
        # rollout phase need not span the other engine's generation (on a loaded machine rank 1
        # generated for 0.98 s while rank 0's phase took 0.53 s), but its step does: the ranks
        # meet in the update's collectives.
        assert r["rollout/tokens_per_s"] >= generated / r["time/step"]
        # Prompt and response tokens of every kept sample, per second of the step.
        assert r["perf/tokens_per_s"] * r["time/step"] > generated


def test_old_logprobs_from_the_engine_train_as_the_recompute_does(model_dir, drift_tol,
                                                                  engine_actor_rounding,
                                                                  tmp_path):
    """algorithm.old_logprobs=engine at TP=2 (the engine's numbers reach both ranks of the
    replica), KL-Cov, 2 mini-batches: the first step (same weights and seeds: the same rollouts)
    trains as with the recompute, up to the engine-vs-actor rounding; the first update's own
    forward gives its old log-probs (the recompute's, bit for bit: a ratio of exactly 1). Nothing
    compares the engine with itself: no drift metric, no per-step weight check of the rollout."""
    rows = {}
    for mode in ("recompute", "engine"):
        cfg = _config(model_dir, tmp_path, mode, algorithm={"old_logprobs": mode},
                      trainer={"steps": 1, "save_interval": 0, "mini_batches_per_step": 2})
        run_distributed(train_from_dict, 2, cfg, timeout=300)
        (rows[mode],) = _metrics(tmp_path, mode)
    rec, eng = rows["recompute"], rows["engine"]
    for key in ("reward/mean", "response/length_mean", "response/length_max"):
        assert eng[key] == rec[key], key
    # Entropies: the same rounding as a log-prob's, plus the sum over the vocabulary.
    scale, terms, vocab = engine_actor_rounding
    h_tol = rounding_tol(scale, terms + vocab)
    assert abs(eng["entropy/token_mean"] - rec["entropy/token_mean"]) <= h_tol
    assert eng["entropy/token_mean"] > 100 * h_tol  # a random model: far from 0
    # Token mean of (old - new log-prob) over both updates: the first's terms equal, the second's
    # each within a log-prob's rounding.
    assert abs(eng["loss/ppo_kl"] - rec["loss/ppo_kl"]) <= drift_tol
    assert "rollout/logprob_drift" in rec and "weight_check/rollout_drift_mean" in rec
    assert not [k for k in eng if "logprob_drift" in k or k.startswith("weight_check/rollout")]
    assert "weight_check/drift_mean" in eng  # the check after the sync still runs


def _model_sequence_length(cfg: dict) -> int:
    """Worker: the sequence length the trainer built its Megatron model for."""
    from megatron_entropy.config import load_config
    from megatron_entropy.runtime import shutdown
    from megatron_entropy.trainer.loop import Trainer

    trainer = Trainer(load_config(data=cfg))
    try:
        return trainer.model[0].module.max_sequence_length
    finally:
        trainer.close()
        shutdown()


def test_model_is_built_for_model_seq_length(model_dir, tmp_path):
    cfg = _config(model_dir, tmp_path, "seq", parallel={"tensor": 1})
    full = cfg["rollout"]["max_prompt_tokens"] + cfg["rollout"]["max_new_tokens"]
    assert cfg["model"]["seq_length"] > full  # what the trainer used instead
    assert run_distributed(_model_sequence_length, 1, cfg) == [cfg["model"]["seq_length"]]


def test_the_configured_reward_scores_training_and_validation(model_dir, tmp_path):
    """reward.function = the example format reward (examples/rewards_format.py), scored in two
    worker processes, for the rollouts and the validation: the run logs its rewards, which are
    -1 for a response without a boxed answer, where the math reward is never below 0."""
    cfg = _config(model_dir, tmp_path, "fmt", parallel={"tensor": 1},
                  reward={"function": f"{REPO / 'examples' / 'rewards_format.py'}:format_reward",
                          "workers": 2},
                  data={"arithmetic": {"num_train": 256, "num_val": 4}},
                  trainer={"steps": 1, "val_before_train": True})
    run_distributed(train_from_dict, 1, cfg, timeout=300)
    rows = _metrics(tmp_path, "fmt")
    assert [r["step"] for r in rows] == [0, 1]
    assert -1 <= rows[0]["val/reward/mean"] < 0 and rows[0]["val/reward/failures"] == 0
    assert -1 <= rows[1]["reward/mean"] < 0 and rows[1]["reward/failures"] == 0


def test_cli_first_screen_shows_the_run_not_megatrons_start_up_notes(model_dir, tmp_path):
    """One process, 2 steps with a validation before them: the progress bar ends at 2/2, and
    none of megatron-core's known-harmless notes (runtime/harmless.py) reach the console."""
    import yaml

    from megatron_entropy.runtime.harmless import HARMLESS_LOG_LINES, HARMLESS_WARNINGS

    cfg = _config(model_dir, tmp_path, "screen", parallel={"tensor": 1},
                  trainer={"steps": 2, "val_before_train": True, "val_interval": 2,
                           "save_interval": 0},
                  data={"arithmetic": {"num_train": 256, "num_val": 4}},
                  logging={"progress_bar": True})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = train_cli(tmp_path / "c.yaml", "--nproc", "1", log=tmp_path / "screen.log")
    assert run.wait(timeout=300) == 0, (tmp_path / "screen.log").read_text()[-3000:]
    screen = (tmp_path / "screen.log").read_text()
    bars = [line for line in screen.replace("\r", "\n").splitlines()
            if line.startswith("RL steps")]
    # The bar counts to its total and never past it: no "3/2", and no "3it [..." (a count without
    # a total). A rate such as "3.03it/s" is neither.
    assert bars and "2/2" in bars[-1], bars
    assert not [b for b in bars if "3/2" in b or re.search(r": *\d+it \[", b)], bars
    for _, message in HARMLESS_WARNINGS:
        assert not re.search(message, screen), message
    for line in HARMLESS_LOG_LINES:
        assert line not in screen
    # It ends saying where the run's checkpoint and metrics are.
    run_dir = Path(cfg["logging"]["runs_dir"]) / "screen"
    assert screen.strip().splitlines()[-1] == (
        f"finished: 2 steps; last checkpoint {run_dir / 'checkpoints' / 'step_00000002'}; "
        f"metrics {run_dir / 'metrics.jsonl'} (megatron-entropy plot {run_dir})")


QUICKSTART = REPO / "examples" / "quickstart.yaml"


def _quickstart(run_dir: Path, name: str, **extra) -> dict:
    """The quickstart config made small: the shipped model on the arithmetic task."""
    import yaml

    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg["model"]["hf_path"] = str(REPO / cfg["model"]["hf_path"])
    cfg["rollout"].update(max_new_tokens=40)
    cfg["data"].update(prompts_per_step=8)
    cfg["data"]["arithmetic"].update(num_val=64)
    cfg["trainer"].update(micro_batch_tokens=2048, val_interval=0, val_before_train=False,
                          save_interval=0)
    cfg["logging"] = {"name": name, "runs_dir": str(run_dir), "progress_bar": False}
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


@pytest.mark.slow
def test_accuracy_rises_on_the_arithmetic_task(tmp_path):
    """KL-Cov on the shipped quickstart model at TP=2: greedy validation accuracy after a few
    steps is above where it started (seeded: the same numbers every run on this CPU type)."""
    cfg = _quickstart(tmp_path, "learn", parallel={"tensor": 2},
                      trainer={"steps": 8, "val_interval": 8, "val_before_train": True,
                               "lr": 5e-5})
    run_distributed(train_from_dict, 2, cfg, timeout=600)
    rows = {r["step"]: r for r in _metrics(tmp_path, "learn")}
    start, end = rows[0]["val/acc/mean"], rows[8]["val/acc/mean"]
    assert 0 < start < 0.9, start  # the shipped model solves some, not all
    assert end > start, (start, end)
    assert all(rows[s]["loss/selected_frac"] > 0 for s in range(1, 9))


@pytest.mark.slow
def test_killed_run_resumes_bit_identical(tmp_path):
    """DP=2 run killed (SIGKILL, whole process group) after a checkpoint; the resumed run's later
    steps equal an uninterrupted run's: weights, optimizer state (the distributed optimizer's,
    on by default at DP > 1), data order (with dynamic sampling's refills), sampling seeds and
    the entropy controller (its knob, KL-Cov's k, moves every step) included. The killed and
    the resumed run overlap their DP communication (trainer.overlap_communication, on GPUs by
    default): grads reduced during the backward, params gathered after the update while the
    next forward starts, completed before a sync or a checkpoint reads them: the same numbers.
    The uninterrupted reference runs in ranks forked from this process, beside the victim: the
    same loop as the CLI's ranks, without two more interpreters' imports."""
    import yaml

    cfg_path = tmp_path / "c.yaml"
    # The quickstart policy's entropy is ~0.1 nats: a target of 0.05 lowers k from the first step.
    control = {"enabled": True, "target": 0.05, "knob": "kl_cov_ratio", "knob_min": 1e-4,
               "knob_max": 0.05, "warmup_steps": 0}
    steps = 3  # killed after the first, compared on the two after it
    cfg = _quickstart(tmp_path, "ref", parallel={"tensor": 1},
                      trainer={"steps": steps, "save_interval": 1, "keep_last": steps},
                      algorithm={"entropy_control": control})
    cfg["data"]["arithmetic"]["num_train"] = 256  # 3 steps draw a few dozen problems
    cfg_path.write_text(yaml.safe_dump(cfg))
    overlap = "trainer.overlap_communication=true"
    # One thread per rank, as the forked reference's ranks have (the CLI's default is cores /
    # ranks): the same kernels, so the same numbers on any machine.
    threads = {"OMP_NUM_THREADS": "1"}
    victim = train_cli(cfg_path, "logging.name=victim", overlap, "--nproc", "2",
                  log=tmp_path / "victim.log", **threads)
    metrics = tmp_path / "victim" / "metrics.jsonl"
    kill_after_first_step(victim, metrics, tmp_path / "victim.log",
                          lambda: run_distributed(train_from_dict, 2, cfg, timeout=300))
    killed_at = len(metrics.read_text().splitlines())
    resumed = train_cli(cfg_path, "logging.name=victim", overlap, "--nproc", "2",
                   log=tmp_path / "resumed.log", **threads)
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    resumed_log = (tmp_path / "resumed.log").read_text()
    assert "resumed from" in resumed_log and "no step to run" not in resumed_log
    # torch.distributed.checkpoint's deprecations, three per rank on every resume: hidden.
    assert "FutureWarning" not in resumed_log, resumed_log[-3000:]
    # The same command once more: the run is done; it says so and runs no step.
    again = train_cli(cfg_path, "logging.name=victim", "--nproc", "2",
                      log=tmp_path / "again.log", **threads)
    assert again.wait(timeout=300) == 0, (tmp_path / "again.log").read_text()[-3000:]
    assert (f"the run is at step {steps} of trainer.steps={steps}: no step to run"
            in (tmp_path / "again.log").read_text())
    got, want = _metrics(tmp_path, "victim"), _metrics(tmp_path, "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # each step once
    assert killed_at < steps
    assert all(r["grad_norm"] > 0 for r in want)  # real updates, so optimizer state matters
    knobs = [r["control/knob"] for r in want]  # the controller's state matters too
    assert len(set(knobs)) == steps and knobs[0] == 0.002, knobs
    # so does the data position: refills drew extra prompts
    assert any(r["data/sampling_rounds"] > 1 for r in want), want
    for g, w in zip(got, want):
        g = {k: v for k, v in g.items() if not k.startswith(STABLE)}
        w = {k: v for k, v in w.items() if not k.startswith(STABLE)}
        assert g == w, f"step {g['step']} differs"
    ckpts = tmp_path / "victim" / "checkpoints"
    saved = json.loads((ckpts / (ckpts / "latest").read_text() / "trainer_state.json").read_text())
    assert saved["distributed_optimizer"] is True


def _expect_failure(cfg: dict, match: str) -> None:
    with pytest.raises(AssertionError, match=match):
        run_distributed(train_from_dict, 1, cfg, timeout=120)


def test_missing_dataset_file_is_a_clear_error(model_dir, tmp_path):
    earlier = tmp_path / "x" / "config.yaml"  # of an earlier run in this folder
    earlier.parent.mkdir()
    earlier.write_text("the earlier run's config\n")
    _expect_failure(_config(model_dir, tmp_path, "x", parallel={"tensor": 1},
                            data={"train_files": [str(tmp_path / "nope.jsonl")]}),
                    r"data.train_files: .*nope.jsonl")
    # A start that failed is no run: the folder's config stays the earlier run's.
    assert sorted(p.name for p in earlier.parent.iterdir()) == ["config.yaml"]
    assert earlier.read_text() == "the earlier run's config\n"


def test_row_without_answer_is_a_clear_error(model_dir, tmp_path):
    rows = tmp_path / "d.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": "2+2?"}) + "\n")
    _expect_failure(_config(model_dir, tmp_path, "x", parallel={"tensor": 1},
                            data={"train_files": [str(rows)]}), r"d.jsonl:2.*answer")


def test_world_size_that_does_not_fit_the_layout(model_dir, tmp_path, capsys):
    import yaml

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(model_dir, tmp_path, "x")))
    assert cli_main(["train", str(cfg_path), "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "world size 3 is not divisible by parallel.tensor x parallel.pipeline = 2 x 1" in err
    assert cli_main(["train", str(cfg_path), "trainer.lr=fast"]) == 2
    assert "trainer.lr: expected a number" in capsys.readouterr().err
