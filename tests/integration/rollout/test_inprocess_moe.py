"""The in-process engine on a mixture-of-experts model: the routing it returns with each sample is
the one its routers used, at every position of the prompt and the response."""

from __future__ import annotations

import pytest
import torch

from serving_model import reference
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.inprocess import InProcessEngine
from megatron_entropy.testing.toy_models import save_tiny_hf_model, save_tokenizer


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_routing_is_what_a_plain_forward_routes(tmp_path, norm_topk_prob):
    """Samples of different lengths (stop tokens end some early; left-padded prompts; 3 rows a
    batch, so rows leave batches mid-way): each sample's ``meta["routing"]`` [layers, prompt +
    response, k] equals the top-k of the router logits of one plain forward of the whole
    sequence, and its log-probs stay those of that forward (the extra forward that routes a
    finished row's last token does not disturb the others)."""
    hf_dir = save_tiny_hf_model("qwen3_moe", tmp_path, vocab_size=512,
                                norm_topk_prob=norm_topk_prob)
    save_tokenizer(hf_dir, 512)
    engine = InProcessEngine(hf_dir, batch_size=3)
    model = engine.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 7)]
    sp = SamplingParams(n=2, max_new_tokens=10, seed=1, stop_token_ids=tuple(range(3, 100)))
    out = engine.generate(prompts, sp)
    lengths = {len(c.token_ids) for group in out for c in group}
    assert len(lengths) > 1 and max(lengths) == 10
    k = model.config.num_experts_per_tok
    arch = arch_from_hf_config(model.config.to_dict())
    for prompt, group in zip(prompts, out):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(input_ids=ids, output_router_logits=True).router_logits
            z = torch.stack([x.float() for x in logits])  # [layers, tokens, experts]
            want = torch.softmax(z, -1).topk(k, dim=-1).indices.sort(-1).values
            assert c.meta["routing"].dtype == torch.int16
            assert torch.equal(c.meta["routing"].long(), want)
            # The k-th and the next expert's logits are further apart than the rounding of a
            # cached, padded forward can move them: the equality is not luck.
            top = z.sort(-1, descending=True).values
            gap = float((top[..., k - 1] - top[..., k]).min())
            assert gap > 2 * rounding_tol(z, transformer_terms(arch, ids.shape[1]))
            ref, tol = reference(model, prompt, c.token_ids)
            assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) <= tol
