"""Tokens a tool inserted into a response (``Sample.loss_mask`` 0) through the actor and Megatron:
they get no gradient and stay out of every token count and the Cov population (the old and
engine log-probs there can be anything: the update is the same to the bit), the step's token
count is the generated tokens', and TP=2 and DP=2 give the update TP=1/DP=1 gives."""

from __future__ import annotations

import pytest
import torch

from actor_updates import UPDATES, rounding_paths, update_worker
from harness import run_distributed
from tiny_models import random_samples
from tolerance import update_tol

from megatron_entropy.trainer.batch import pack_micro_batches
from megatron_entropy.trainer.packing import packed_micro_batches

CASES = [("kl_cov", "global", None, "padded"), ("clip_cov", "global", None, "padded"),
         ("ppo_clip", "micro_batch", None, "padded"), ("kl_cov", "micro_batch", "tis", "padded"),
         ("kl_cov", "global", None, "packed")]


def test_inserted_tokens_are_out_of_every_layouts_mask():
    samples = random_samples(0, shared_prompts=True, inserted=True)
    assert any(s.loss_mask and 0 in s.loss_mask for s in samples)
    layouts = [pack_micro_batches(samples, 64, layout=layout)
               for layout in ("padded", "shared_prompt")]
    for mbs in layouts + [packed_micro_batches(samples, 64)]:
        for mb in mbs:
            for b, i in enumerate(mb.sample_ids):
                s = samples[i]
                want = torch.zeros(mb.mask.shape[1])
                want[:len(s.response_ids)] = torch.tensor(s.loss_mask or [1] * len(s.response_ids),
                                                          dtype=torch.float32)
                torch.testing.assert_close(mb.mask[b], want, rtol=0, atol=0)
                assert (mb.advantages[b][want == 0] == 0).all()


@pytest.mark.parametrize("loss,scope,correction,layout", CASES,
                         ids=[f"{a}-{b}{'-' + c if c else ''}-{d}" for a, b, c, d in CASES])
def test_inserted_tokens_get_no_gradient_and_stay_out_of_the_cov_population(loss, scope,
                                                                               correction, layout):
    """Old and engine log-probs moved by 3 nats on the inserted tokens only: were those tokens in
    the loss, their ratio, KL-Cov's |logp - old logp| and tis's weight would change; were they in
    the Cov population (global scope: the recompute's log-probs choose), its means and top-k."""
    extra = {"correction": {"mode": correction}} if correction else {}
    extra["layout"] = layout
    ((w, m, w0),) = run_distributed(update_worker, 1, loss, scope, "recompute", inserted=True,
                                    **extra)
    ((ws, ms, _),) = run_distributed(update_worker, 1, loss, scope, "recompute", inserted=True,
                                     inserted_shift=3.0, **extra)
    for name in w:
        torch.testing.assert_close(ws[name], w[name], rtol=0, atol=0, msg=name)
    for key in ("selected_frac", "cov_mean", "pg_loss"):
        if key in m:
            assert ms[key] == m[key], key
    assert max((w[n] - w0[n]).abs().max() for n in w) > 1e-3  # the step did move the weights
    if loss == "kl_cov" and scope == "global":
        # Each update selects k = int(N * ratio) of its mini-batch's N generated tokens.
        samples = random_samples(0, inserted=True)
        counts = [sum(sum(s.loss_mask or [1] * len(s.response_ids)) for s in half)
                  for half in (samples[:len(samples) // 2], samples[len(samples) // 2:])]
        assert m["selected_frac"] == pytest.approx(sum(int(n * 0.1) for n in counts)
                                                   / sum(counts))


def test_tool_masks_at_tp2_and_dp2_equal_tp1_dp1():
    ((w1, m1, w0),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute",
                                      inserted=True)
    _, path = rounding_paths(random_samples(0, inserted=True))
    for name, kwargs in (("DP=2", {}), ("TP=2", {"tensor": 2})):
        (w2, m2, _), (w2b, _, _) = run_distributed(update_worker, 2, "kl_cov", "global",
                                                   "recompute", inserted=True, **kwargs)
        assert m2["selected_frac"] == m1["selected_frac"] > 0, name
        for n in w1:
            torch.testing.assert_close(w2[n], w1[n], rtol=0, msg=f"{n} at {name}",
                                       atol=update_tol(w1[n], w0[n], UPDATES, path))
            torch.testing.assert_close(w2b[n], w2[n], rtol=0, atol=0, msg=n)
