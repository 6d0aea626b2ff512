"""RL updates of the tiny Qwen3-MoE: expert parallelism changes nothing but rounding (EP=2 equals
EP=1 on the same data and DP split), the router's metrics are logged, and routing replay (R2)
makes every update route as the recompute did."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

from harness import init_megatron, run_distributed
from metrics_table import undocumented_metrics
from tiny_models import random_samples, save_tiny_hf_model
from tolerance import grad_terms, rounding_tol, transformer_terms, update_tol

from megatron_entropy.models.arch import load_arch
from megatron_entropy.testing.toy_models import save_tokenizer

UPDATES = 4  # ppo_epochs x mini_batches_per_step
KL_COV = dict(loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=1.0)
# Clip-Cov with its candidate band wide open (every token with positive Cov): 10% detached.
CLIP_COV = dict(loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=100.0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_train"))
    save_tokenizer(out)  # for the in-process engine
    return out


@pytest.fixture(scope="module")
def moe8_dir(tmp_path_factory):
    """8 experts, top-2: closer calls between the second and third expert than with 4, so that
    a bf16 engine routes some tokens elsewhere than the fp32 trainer."""
    out = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe8"), num_experts=8)
    save_tokenizer(out)
    return out


def _moe_actor(hf_dir, expert: int, replay: str = "none", aux: float = 1e-2, lr: float = 1e-2,
               recompute: bool = False, pipeline: int = 1, micro_batch_tokens: int = 48,
               algorithm: Optional[dict] = None, context: int = 1, layout: str = "auto",
               z_loss: float = 0.0):
    """Inside a rank: Megatron at EP=``expert`` x PP=``pipeline`` x CP=``context``, the tiny MoE
    from its HF weights (router losses: ``aux``, ``z_loss``) and its Actor (KL-Cov unless
    ``algorithm`` says otherwise; 2 epochs x 2 mini-batches a step; micro-batches in
    ``layout``); returns (actor, this stage's full weights before)."""
    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         TrainerConfig)
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_megatron(pipeline=pipeline, expert=expert, context=context)
    arch = load_arch(hf_dir)
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64,
                          moe_aux_loss_coeff=aux, moe_z_loss_coeff=z_loss,
                          recompute_activations=recompute),
        ParallelConfig(pipeline=pipeline, expert=expert), routing_replay=replay != "none")
    load_hf_weights(chunks[0], hf_dir, arch)
    initial = full_state_dict(chunks[0])
    # adam_eps = 1: updates proportional to the gradients (see test_actor.py).
    trainer = TrainerConfig(lr=lr, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=micro_batch_tokens, mini_batches_per_step=2,
                            ppo_epochs=2, seed=5, micro_batch_layout=layout)
    optimizer, scheduler = build_optimizer(chunks, trainer)
    settings = AlgorithmConfig(**(algorithm or KL_COV))
    return Actor(arch, chunks, optimizer, scheduler, settings, trainer, 1.0,
                 routing_replay=replay), initial


def _moe_update_worker(hf_dir, expert: int, replay: str = "none", aux: float = 1e-2,
                       lr: float = 1e-2, recompute: bool = False,
                       backward_replay: Optional[bool] = None, pipeline: int = 1,
                       micro_batch_tokens: int = 48, algorithm: Optional[dict] = None,
                       context: int = 1, layout: str = "auto", z_loss: float = 0.0,
                       advantage: Optional[float] = None):
    """One RL step of ``_moe_actor`` on ``random_samples(0)`` (every advantage ``advantage``
    where given) split over the DP ranks; returns this rank's weights after (global names: its
    experts), the metrics, the weights before and its samples' recorded routing.
    ``backward_replay`` overrides whether the backward's re-forward replays (a test's
    control)."""
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.rollouts import dp_share

    actor, initial = _moe_actor(hf_dir, expert, replay, aux, lr, recompute, pipeline,
                                micro_batch_tokens, algorithm, context, layout, z_loss)
    if backward_replay is not None:
        actor.routing.backward_replay = backward_replay
    mine = dp_share(random_samples(0))
    for s in mine if advantage is not None else ():
        s.advantage = advantage
    actor.recompute(mine)
    metrics = actor.update(mine, step=1)
    metrics["max_abs_logp"] = float(torch.cat([s.old_logprobs for s in mine]).abs().max())
    return full_state_dict(actor.model[0]), metrics, initial, [s.routing for s in mine]


def _whole(results) -> tuple[dict, dict]:
    """Weights after and before over all ranks (each EP rank adds its experts)."""
    after, before = {}, {}
    for w, _, w0, _ in results:
        after.update(w)
        before.update(w0)
    return after, before


def _paths(hf_dir) -> tuple[int, int]:
    samples = random_samples(0)
    logp_path = transformer_terms(load_arch(hf_dir), max(s.length for s in samples),
                                  log_softmax=True)
    return logp_path, grad_terms(logp_path, sum(len(s.response_ids) for s in samples))


@pytest.mark.parametrize("pipeline, micro_batch_tokens, algorithm", [
    (1, 48, KL_COV), (2, 48, KL_COV), (1, 24, KL_COV), (1, 48, CLIP_COV),
    (1, 24, {**KL_COV, "cov_scope": "global"}), (1, 24, {**CLIP_COV, "cov_scope": "global"})],
    ids=["kl_cov", "kl_cov-pp2", "kl_cov-filler", "clip_cov", "kl_cov-global-filler",
         "clip_cov-global-filler"])
def test_ep2_equals_ep1_losses_metrics_and_weights(moe_dir, pipeline, micro_batch_tokens,
                                                   algorithm):
    """DP = 2 at PP = ``pipeline`` (world 2 or 4): each stage's experts, their loads and the
    router losses summed over the stages. At 24 tokens a micro-batch the DP ranks pack 2 and 1
    micro-batches into a mini-batch: at EP = 2 a filler evens them out and changes nothing (with
    cov_scope global too: the filler holds no token of the step's Cov population)."""
    world = 2 * pipeline
    kw = dict(pipeline=pipeline, micro_batch_tokens=micro_batch_tokens, algorithm=algorithm)
    ep1 = run_distributed(_moe_update_worker, world, moe_dir, 1, **kw)
    ep2 = run_distributed(_moe_update_worker, world, moe_dir, 2, **kw)
    _assert_same_update(moe_dir, ep1, ep2)
    (w1, w0), m1 = _whole(ep1), ep1[0][1]
    # The Cov selection is discrete: the same tokens (no near-tie in this data), some of them.
    assert ep2[0][1]["selected_frac"] == m1["selected_frac"] > 0
    # Every expert was trained (its weights moved) and the load counts every routed token.
    samples = random_samples(0)
    tokens = UPDATES // 2 * sum(s.length for s in samples)  # each epoch sees every token
    for layer in (0, 1):
        assert m1[f"moe/layer{layer}/tokens_per_expert_mean"] * 4 == pytest.approx(2 * tokens)
        assert m1[f"moe/layer{layer}/tokens_per_expert_max"] >= \
            m1[f"moe/layer{layer}/tokens_per_expert_mean"]
    for name in w1:
        if ".local_experts." in name:
            assert not torch.equal(w1[name], w0[name]), name
    assert not undocumented_metrics(k for k in m1 if k.startswith("moe/"))


def test_pp2_with_replay_and_recomputed_activations_equals_pp1(moe_dir):
    """EP = 2, R2, one sample per micro-batch: at PP = 2 with activation recompute (1F1B: stage 0
    runs two forwards before the first backward, whose re-forwards take their routing in order)
    the update equals PP = 1's without recompute."""
    kw = dict(replay="recompute", micro_batch_tokens=24)
    pp1 = run_distributed(_moe_update_worker, 2, moe_dir, 2, **kw)
    pp2 = run_distributed(_moe_update_worker, 4, moe_dir, 2, pipeline=2, recompute=True, **kw)
    _assert_same_update(moe_dir, pp1, pp2)


def _assert_same_update(hf_dir, ref: list, got: list) -> None:
    """Two runs of ``_moe_update_worker`` (results by rank) made the same update: weights,
    routing, losses and the gradient norm, up to rounding along their paths."""
    (w1, w0), (w2, _) = _whole(ref), _whole(got)
    m1, m2 = ref[0][1], got[0][1]
    logp_path, path = _paths(hf_dir)
    assert w1.keys() == w2.keys() and sum(".local_experts." in n for n in w1) == 2 * 2 * 4
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=name,
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
    # Routing is discrete: the same tokens go to the same experts (no near-tie in this data).
    for key in m1:
        if key.startswith("moe/layer"):
            assert m2[key] == m1[key], key
    assert m1["moe/routing_mismatch"] == m2["moe/routing_mismatch"]
    # Losses and the gradient norm: the same math up to rounding along their paths.
    logp_tol = rounding_tol(m1["max_abs_logp"], logp_path)
    for key in ("pg_loss", "ppo_kl", "entropy"):
        assert m2[key] == pytest.approx(m1[key], abs=4 * logp_tol), key
    assert m2["moe/aux_loss"] == pytest.approx(m1["moe/aux_loss"],
                                               abs=rounding_tol(m1["moe/aux_loss"], path))
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"],
                                            abs=rounding_tol(m1["grad_norm"], path))


@pytest.mark.parametrize("expert, micro_batch_tokens, layout", [
    (2, 48, "padded"), (2, 48, "packed"), (4, 24, "padded")],
    ids=["ep2-padded", "ep2-packed", "ep4-filler"])
def test_context_parallel_equals_one_rank_with_experts_and_replay(moe_dir, expert,
                                                                  micro_batch_tokens, layout):
    """EP x CP=2 on 4 ranks (DP=2) with R2 replay against EP=1 x CP=1 on 2 ranks: the same DP
    split (so the same micro-batches and Cov populations), the plainest reference, and EP=2
    equals EP=1 is shown above. Each CP rank's forward sees chunks i and 3-i of every sequence:
    the recompute's routing, gathered from both, is replayed chunk by chunk in the updates, and
    the KL-Cov update, the routing, the expert loads, the aux loss and the gradient norm are
    CP=1's up to rounding. At EP=2 Megatron's EP group is a replica's CP pair; at EP=4 it spans
    both replicas, whose 2 and 1 micro-batches a mini-batch (24 tokens) need a filler, which both
    CP ranks of the replica run. The samples' lengths are not all multiples of 2 x CP: CP pads
    them, and that padding stays out of the router's losses (counted, the update differs)."""
    assert any(s.length % 4 for s in random_samples(0))
    kw = dict(replay="recompute", micro_batch_tokens=micro_batch_tokens, layout=layout)
    ref = run_distributed(_moe_update_worker, 2, moe_dir, 1, **kw)
    got = run_distributed(_moe_update_worker, 4, moe_dir, expert, context=2, timeout=300, **kw)
    _assert_same_update(moe_dir, ref, got)
    assert got[0][1]["selected_frac"] == ref[0][1]["selected_frac"] > 0
    assert got[0][1]["moe/routing_mismatch"] == 0.0
    for rank, (_, metrics, _, routing) in enumerate(got):
        assert metrics == got[rank ^ 1][1], rank  # every rank reports the step's metrics
        # and holds its replica's samples' routing whole, as CP=1 recorded it (discrete: the
        # same experts for every token)
        assert all(torch.equal(a, b) for a, b in zip(routing, ref[rank // 2][3], strict=True))


def test_pp2_ep2_cp2_equals_one_process(moe_dir):
    """PP = 2 x EP = 2 x CP = 2 on 4 ranks (DP = 1; Megatron carves the EP group out of DP x CP:
    each stage's CP pair is its EP group) against one process: one KL-Cov step with R2 replay on
    packed rows whose samples CP pads, the same weights after, losses, aux loss, expert loads,
    gradient norm, and each stage's routing record is its layers of the one process's."""
    kw = dict(replay="recompute", micro_batch_tokens=48, layout="packed")
    ref = run_distributed(_moe_update_worker, 1, moe_dir, 1, **kw)
    got = run_distributed(_moe_update_worker, 4, moe_dir, 2, pipeline=2, context=2, timeout=300,
                          **kw)
    _assert_same_update(moe_dir, ref, got)
    assert got[0][1]["selected_frac"] == ref[0][1]["selected_frac"] > 0
    for rank, (_, metrics, _, routing) in enumerate(got):
        assert metrics == got[0][1], rank
        stage = rank // 2  # ranks [0, 1]: stage 0's CP pair, [2, 3]: stage 1's
        assert all(torch.equal(a, b[stage:stage + 1])
                   for a, b in zip(routing, ref[0][3], strict=True)), rank


@pytest.mark.parametrize("z_loss", [0.0, 1e-1], ids=["aux", "aux+z"])
def test_router_losses_leave_padding_out(moe_dir, z_loss):
    """The router's losses of the same micro-batches, padded (each row right-padded to the
    longest) and packed (back to back, no padding at CP = 1: the losses over the real tokens
    only): the same load-balancing (and z-) loss and, with every advantage 0 so that the router
    losses are all the gradient there is, the same update. Counting padding, the padded layout's
    would differ."""
    kw = dict(algorithm=dict(loss="ppo_clip"), aux=1.0, z_loss=z_loss, advantage=0.0,
              micro_batch_tokens=96)
    packed = run_distributed(_moe_update_worker, 1, moe_dir, 1, layout="packed", **kw)
    padded = run_distributed(_moe_update_worker, 1, moe_dir, 1, layout="padded", **kw)
    _assert_same_update(moe_dir, packed, padded)
    m1, m2 = packed[0][1], padded[0][1]
    assert m1["grad_norm"] > 0
    if z_loss:
        tol = rounding_tol(m1["moe/z_loss"], _paths(moe_dir)[1])
        assert m2["moe/z_loss"] == pytest.approx(m1["moe/z_loss"], abs=tol)


def _copy(index: int = 0):
    """``random_samples(0)[index]`` cut to 16 tokens (a multiple of 2 x CP = 4), advantage 0."""
    one = random_samples(0)[index]
    return dataclasses.replace(one, prompt_ids=one.prompt_ids[one.length - 16:], advantage=0.0)


def _copies_worker(hf_dir, micro_batch_tokens: int, context: int = 1):
    """One step of aux and z-loss alone (PPO-clip, advantages 0) on 8 copies of one sample (4 a
    mini-batch) in packed rows of ``micro_batch_tokens`` at CP = ``context``: the weights after
    and the metrics."""
    from megatron_entropy.models.sharding import full_state_dict

    actor, _ = _moe_actor(hf_dir, 1, aux=1.0, z_loss=1e-2, micro_batch_tokens=micro_batch_tokens,
                          algorithm=dict(loss="ppo_clip"), layout="packed", context=context)
    samples = [_copy() for _ in range(8)]
    actor.recompute(samples)
    metrics = actor.update(samples, step=1)
    return full_state_dict(actor.model[0]), metrics


def test_router_losses_enter_as_their_token_weighted_mean(moe_dir):
    """The router losses enter a step as their token-weighted mean over micro-batches times their
    coefficients: a mini-batch of 4 copies of a sample in one micro-batch has the losses (and
    gradient) of the sample, and so has each of 4 micro-batches of one copy, whose mean is
    that. Weighted otherwise (each micro-batch's loss over the step's tokens), 4 micro-batches
    would give 4 times the gradient of one."""
    one = run_distributed(_copies_worker, 1, moe_dir, 4 * 16)[0]
    four = run_distributed(_copies_worker, 1, moe_dir, 16)[0]
    assert one[1]["grad_norm"] > 0
    _assert_same_router_losses(moe_dir, one, four)


def test_router_losses_under_context_parallelism(moe_dir):
    """CP = 2 equals CP = 1 in the router losses' values (the z-loss's too: each CP rank tracks
    its own tokens' mean) and gradient where the CP ranks hold as many real tokens (samples of
    16 tokens, no CP padding; with uneven ones the z-loss is the mean of each rank's mean, see
    docs/long_sequences.md)."""
    ref = run_distributed(_copies_worker, 1, moe_dir, 4 * 16)[0]
    got = run_distributed(_copies_worker, 2, moe_dir, 4 * 16, context=2)
    assert got[0][1] == got[1][1]
    _assert_same_router_losses(moe_dir, ref, got[0])


def _assert_same_router_losses(hf_dir, ref: tuple, got: tuple) -> None:
    """Two runs of ``_copies_worker``: the same router losses, gradient norm and weights."""
    path = _paths(hf_dir)[1]
    for key in ("moe/aux_loss", "moe/z_loss", "grad_norm"):
        assert got[1][key] == pytest.approx(ref[1][key], abs=rounding_tol(ref[1][key], path)), key
    for name in ref[0]:
        torch.testing.assert_close(got[0][name], ref[0][name], rtol=0, msg=name,
                                   atol=rounding_tol(float(ref[0][name].abs().max()), path))


def test_aux_loss_coefficient_acts_on_the_update(moe_dir):
    with_aux = _whole(run_distributed(_moe_update_worker, 1, moe_dir, 1, aux=1.0))[0]
    without = run_distributed(_moe_update_worker, 1, moe_dir, 1, aux=0.0)
    assert "moe/aux_loss" not in without[0][1]
    routers = [n for n in with_aux if n.endswith("mlp.router.weight")]
    assert routers and all(not torch.equal(with_aux[n], without[0][0][n]) for n in routers)


def test_routing_replay_routes_every_update_as_the_recompute(moe_dir):
    """Without replay the updated router sends some tokens elsewhere in the later updates; with
    replay (R2) the mismatch is zero by construction, and it changes the update."""
    ((free, m_free, _, _),) = run_distributed(_moe_update_worker, 1, moe_dir, 1, lr=0.1)
    ((replayed, m_replay, _, _),) = run_distributed(_moe_update_worker, 1, moe_dir, 1,
                                                 replay="recompute", lr=0.1)
    assert m_free["moe/routing_mismatch"] > 0
    assert m_replay["moe/routing_mismatch"] == 0.0
    assert any(not torch.equal(free[n], replayed[n]) for n in free)


def test_replay_reaches_the_backward_of_recomputed_activations(moe_dir):
    """With full activation recompute the backward re-runs each layer's forward; under R2 it
    replays the same routing (REPLAY_BACKWARD), so the update equals the one without recompute
    bit for bit (the re-forward repeats the forward's arithmetic). The control: a re-forward
    that routes afresh (the router moved after the first mini-batch, lr 0.1) changes it."""
    run = lambda **kw: run_distributed(_moe_update_worker, 1, moe_dir, 1,  # noqa: E731
                                       replay="recompute", lr=0.1, **kw)[0]
    plain, recomputed = run(), run(recompute=True)
    free = run(recompute=True, backward_replay=False)[0]
    assert recomputed[1]["moe/routing_mismatch"] == 0.0
    for name, t in plain[0].items():
        assert torch.equal(recomputed[0][name], t), name
    assert any(not torch.equal(free[n], plain[0][n]) for n in free)


def _engine_samples(hf_dir, dtype: str) -> list:
    """Rollouts of the in-process engine in ``dtype`` (6 random prompts x 2 samples of up to 12
    tokens) as Samples with its log-probs and routing; random advantages."""
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.trainer.batch import Sample

    engine = InProcessEngine(hf_dir, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 8, 6, 9, 4, 7)]
    done = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=11))
    return [Sample(prompt_ids=p, response_ids=c.token_ids, engine_logprobs=c.logprobs,
                   reward=float(j == 0), group=i, source="s",
                   advantage=float(torch.randn(1, generator=g)), engine_routing=c.meta["routing"])
            for i, (p, cs) in enumerate(zip(prompts, done)) for j, c in enumerate(cs)]


def _rollout_replay_worker(hf_dir, expert: int, replay: str, engine_dtype: str,
                           context: int = 1):
    """One RL step of ``_moe_actor`` (at CP=``context``) on the engine's rollouts; returns the
    metrics, whether each sample's recorded routing is the engine's, and |engine - recompute|
    per response token."""
    from megatron_entropy.trainer.rollouts import dp_share

    actor, _ = _moe_actor(hf_dir, expert, replay, context=context)
    mine = dp_share(_engine_samples(hf_dir, engine_dtype))
    actor.recompute(mine)
    same = [torch.equal(s.routing, s.engine_routing) for s in mine]
    drift = torch.cat([(torch.tensor(s.engine_logprobs, dtype=torch.float64)
                        - s.old_logprobs.double()).abs() for s in mine])
    return actor.update(mine, step=1), same, drift


def test_engine_routing_is_the_trainers_at_equal_precision(moe8_dir):
    """An fp32 engine's recorded routing is the fp32 trainer's own, token for token and layer
    for layer (no near-tie in this data): the engine records every position, the prompt's too,
    in the trainer's layout."""
    ((metrics, same, drift),) = run_distributed(_rollout_replay_worker, 1, moe8_dir, 1, "none",
                                                "fp32")
    assert metrics["moe/rollout_routing_mismatch"] == 0.0 and all(same)


@pytest.mark.parametrize("expert, context", [(1, 1), (2, 1), (2, 2)],
                         ids=["ep1", "ep2", "ep2-cp2"])
def test_rollout_replay_routes_as_the_engine(moe8_dir, expert, context):
    """R3 with a bf16 engine and an fp32 trainer: without replay the trainer routes some
    (token, layer) pairs elsewhere than the engine; with it every sample's recorded routing is
    the engine's (the routing the trainer's routers produced, read off their output), the
    updates replay it, and the recompute's log-probs change. At EP=2 x CP=2 (2 ranks, DP=1)
    each CP rank replays its chunks of the engine's routing, and the record gathered from both
    is the engine's whole."""
    free = run_distributed(_rollout_replay_worker, 1, moe8_dir, 1, "none", "bf16")[0]
    replayed = run_distributed(_rollout_replay_worker, expert, moe8_dir, expert, "rollout",
                               "bf16", context)
    assert free[0]["moe/rollout_routing_mismatch"] > 0 and not all(free[1])
    for metrics, same, _ in replayed:
        assert metrics["moe/rollout_routing_mismatch"] == 0.0 and all(same)
        assert metrics["moe/routing_mismatch"] == 0.0
    drift_r3 = torch.cat([d for _, _, d in replayed[::context]])  # each DP rank's samples
    assert drift_r3.shape == free[2].shape and not torch.equal(drift_r3.sort().values,
                                                                free[2].sort().values)
    assert not undocumented_metrics(k for k in free[0] if k.startswith("moe/"))


def _sync_worker(hf_dir, expert: int):
    """Worker: the model at EP=``expert`` from HF weights, synced in place into an in-process
    engine whose weights were zeroed; returns the engine's state dict and weight version."""
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.weight_sync import InPlaceSync

    init_megatron(expert=expert)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, dtype="fp32", transformer_impl="local", seq_length=64,
                            expert=expert)
    load_hf_weights(model, hf_dir, arch)
    engine = InProcessEngine(hf_dir)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    InPlaceSync(engine, 64 * 1024).sync(model, arch, version=3)
    return {k: v.clone() for k, v in engine.model.state_dict().items()}, engine.weight_version


def test_ep2_weight_sync_fills_the_in_process_engine_bit_for_bit(moe_dir):
    """Every EP rank gathers all experts of each layer (small buckets: many relays), and the
    engine's fused expert tensors get each expert's slices: transformers' own weights exactly."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    for state, version in run_distributed(_sync_worker, 2, moe_dir, 2):
        assert version == 3 and state.keys() == ref.state_dict().keys()
        for name, t in ref.state_dict().items():
            assert torch.equal(state[name], t), name
