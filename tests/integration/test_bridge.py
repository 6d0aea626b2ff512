"""The HF <-> Megatron bridge: HF weights loaded into any TP/PP layout compute transformers' logits,
and exported weights are HF's tensors bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import FAMILIES, save_tiny_hf_model
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import (WeightMap, hf_tensor_specs, hf_to_megatron,
                                            megatron_param_names, megatron_to_hf, weight_map)

B, S = 2, 16
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def tokens_for(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))


def hf_reference(hf_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """transformers' fp32 logits and the HF tensors as ``save_pretrained`` stored them."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits
    return logits, load_file(hf_dir / "model.safetensors")


def forward_logits(model, tokens: torch.Tensor):
    """Full-vocab logits [B, S, V_pad] on the last PP stage (None elsewhere), through Megatron's
    pipeline schedule so that PP > 1 runs the real stage-to-stage path."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    outputs = []

    def step(data_iter, m):
        out = m(next(data_iter), pos, None)

        def loss_func(logits):
            outputs.append(logits.detach())
            return logits.sum() * 0, {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]),
                                model=[model], num_microbatches=1, seq_length=tokens.shape[1],
                                micro_batch_size=tokens.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = outputs[0]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def load_and_run(hf_dir: Path, tp: int, pp: int, source: str, tokens: torch.Tensor,
                 ckpt_dir=None, export: bool = True):
    """Worker: build the model at TP x PP, load it from HF (``source="hf"``) or a dist checkpoint
    (``"ckpt"``), return (logits or None, exported [(name, tensor or None)])."""
    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.megatron_checkpoint import load_model_weights

    init_megatron(tensor=tp, pipeline=pp, seed=123)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, tp, pp, dtype="fp32", transformer_impl="local", seq_length=64)
    if source == "hf":
        load_hf_weights(model, hf_dir, arch)
    else:
        load_model_weights(model, ckpt_dir)
    logits = forward_logits(model, tokens)
    exported = [(n, None if t is None else t.clone())
                for n, t in export_hf_weights(model, arch)] if export else None
    return logits, exported


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """family -> (HF folder, tokens, reference logits, reference tensors)."""
    out = {}
    for family in FAMILIES:
        hf_dir = save_tiny_hf_model(family, tmp_path_factory.mktemp(family))
        tokens = tokens_for(1000)
        out[family] = (hf_dir, tokens, *hf_reference(hf_dir, tokens))
    tied = save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_tied"),
                              tie_word_embeddings=True)
    out["qwen2_tied"] = (tied, tokens_for(1000), *hf_reference(tied, tokens_for(1000)))
    return out


def check_results(results: list, ref_logits: torch.Tensor, ref_tensors: dict, arch):
    """Logits on every last-stage rank equal transformers' (the same math in another order: up to
    rounding along one logit's path); the leader (rank 0) exports the HF tensors bit for bit, in
    ``hf_tensor_specs`` order, and every other rank walks the same names with None."""
    vocab = arch.vocab_size
    logits = [r[0] for r in results if r[0] is not None]
    assert logits, "no rank returned logits"
    tol = rounding_tol(ref_logits, transformer_terms(arch, ref_logits.shape[1]))
    for got in logits:
        assert got.shape[-1] % 128 == 0 and got.shape[-1] >= vocab
        torch.testing.assert_close(got[..., :vocab], ref_logits, rtol=0, atol=tol)
    leader = results[0][1]
    names = [n for n, _ in leader]
    assert sorted(names) == sorted(ref_tensors)
    assert names == [n for n, _, _ in hf_tensor_specs(arch, torch.float32)]
    for name, t in leader:
        assert t is not None and t.dtype == ref_tensors[name].dtype, name
        assert torch.equal(t, ref_tensors[name]), name
    for _, exported in results[1:]:
        assert [n for n, _ in exported] == [n for n, _ in leader]
        assert all(t is None for _, t in exported)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES) + ["qwen2_tied"])
def test_hf_weights_give_transformers_logits(tiny_hf, family, layout):
    hf_dir, tokens, ref_logits, ref_tensors = tiny_hf[family]
    tp, pp = LAYOUTS[layout]
    results = run_distributed(load_and_run, tp * pp, hf_dir, tp, pp, "hf", tokens)
    check_results(results, ref_logits, ref_tensors, load_arch(hf_dir))


def test_export_at_tp2_pp2_is_bit_identical(tiny_hf):
    hf_dir, tokens, ref_logits, ref_tensors = tiny_hf["qwen3"]
    results = run_distributed(load_and_run, 4, hf_dir, 2, 2, "hf", tokens)
    check_results(results, ref_logits, ref_tensors, load_arch(hf_dir))


def test_mapping_inverts_and_shards_like_megatron(tiny_hf):
    """hf_to_megatron then megatron_to_hf is the identity, a TP shard read from HF equals the
    shard Megatron's own sharding takes of the full tensor, and TE names map like local ones."""
    from megatron_entropy.models.sharding import tp_shard

    hf_dir, _, _, ref = tiny_hf["qwen2"]
    arch = load_arch(hf_dir)

    class Param:  # the attributes tp_shard reads from a Megatron parameter
        tensor_model_parallel, partition_dim = True, 0

    for name in megatron_param_names(arch):
        wm = weight_map(name, arch)
        full = hf_to_megatron(wm, [ref[n] for n in wm.hf], arch)
        back = megatron_to_hf(wm, full, arch)
        assert [n for n, _ in back] == list(wm.hf)
        for n, t in back:
            assert torch.equal(t, ref[n]), n
        if wm.kind != "copy":  # qkv, glu and vocab are all split along rows under TP
            for rank in range(2):
                shard = hf_to_megatron(wm, [ref[n] for n in wm.hf], arch, rank, 2, 0)
                assert torch.equal(shard, tp_shard(name, full, Param, rank, 2)), name
    qkv = weight_map("decoder.layers.1.self_attention.linear_qkv.weight", arch)
    assert qkv == WeightMap(qkv.megatron, ("model.layers.1.self_attn.q_proj.weight",
                                           "model.layers.1.self_attn.k_proj.weight",
                                           "model.layers.1.self_attn.v_proj.weight"), "qkv")
    assert weight_map("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", arch).hf \
        == weight_map("decoder.layers.1.input_layernorm.weight", arch).hf
    assert weight_map("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", arch).hf \
        == ("model.layers.0.post_attention_layernorm.weight",)
    assert [n for n, _, _ in hf_tensor_specs(arch, torch.float32)] == [
        n for name in megatron_param_names(arch) for n in weight_map(name, arch).hf]
    assert sorted(n for n, _, _ in hf_tensor_specs(arch, torch.float32)) == sorted(ref)


def test_qkv_interleave_puts_each_group_together():
    """Megatron's fused QKV rows are [q heads of group g; k_g; v_g] for each group g (written out
    here by hand), not [all q; all k; all v]; TP rank r holds whole groups."""
    from tiny_models import tiny_hf_config

    from megatron_entropy.models.arch import arch_from_hf_config

    # 4 heads in 2 groups, head_dim 2: q has 8 rows, k and v 4 each.
    arch = arch_from_hf_config(tiny_hf_config("qwen2", hidden_size=8, num_attention_heads=4,
                                              num_key_value_heads=2))
    q = torch.arange(8, dtype=torch.float32)
    k = 100 + torch.arange(4, dtype=torch.float32)
    v = 200 + torch.arange(4, dtype=torch.float32)
    wm = weight_map("decoder.layers.0.self_attention.linear_qkv.bias", arch)
    expected = torch.cat([q[0:4], k[0:2], v[0:2], q[4:8], k[2:4], v[2:4]])
    assert torch.equal(hf_to_megatron(wm, [q, k, v], arch), expected)
    assert torch.equal(hf_to_megatron(wm, [q, k, v], arch, 1, 2, 0), expected[8:])
    assert [t.tolist() for _, t in megatron_to_hf(wm, expected, arch)] == [
        q.tolist(), k.tolist(), v.tolist()]


def _export_to_disk(hf_dir: Path, tp: int, pp: int, out: Path) -> None:
    """Worker: the disk weight-sync pattern: every rank iterates the export, the leader streams it
    into safetensors holding one tensor at a time."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.hf_io import save_hf_weights

    init_megatron(tensor=tp, pipeline=pp)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, tp, pp, dtype="fp32", transformer_impl="local", seq_length=64)
    load_hf_weights(model, hf_dir, arch)
    stream = export_hf_weights(model, arch)
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0:
        save_hf_weights(stream, out, metadata_from=hf_dir, max_shard_bytes=200_000,
                        specs=hf_tensor_specs(arch, torch.float32))
    else:
        for _ in stream:
            pass


def test_export_streams_to_disk_at_tp2_pp2(tiny_hf, tmp_path):
    import transformers

    hf_dir, tokens, ref_logits, ref_tensors = tiny_hf["llama"]
    run_distributed(_export_to_disk, 4, hf_dir, 2, 2, tmp_path / "out")
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float32)
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref_tensors[name]), name
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref_logits)


def test_save_exported_weights_takes_any_order_and_checks_completeness(tmp_path):
    """The disk weight sync writes tensors where the plan puts them, whatever order they come in
    (exported or HF state-dict order), and refuses a stream with a tensor missing or repeated."""
    from megatron_entropy.models.bridge import save_exported_weights
    from megatron_entropy.models.hf_io import iter_hf_tensors

    hf = save_tiny_hf_model("qwen2", tmp_path / "hf", seed=4)
    tensors = dict(iter_hf_tensors(hf))
    save_exported_weights(iter(list(tensors.items())[::-1]), tmp_path / "out", hf)
    out = dict(iter_hf_tensors(tmp_path / "out"))
    assert out.keys() == tensors.keys()
    assert all(torch.equal(out[k], tensors[k]) for k in tensors)
    assert (tmp_path / "out" / "config.json").is_file()
    items = list(tensors.items())
    with pytest.raises(ValueError, match="ended without 1 tensors"):
        save_exported_weights(iter(items[:-1]), tmp_path / "bad", hf)
    with pytest.raises(ValueError, match="twice"):
        save_exported_weights(iter(items + items[:1]), tmp_path / "bad", hf)
    assert not (tmp_path / "bad").exists()
