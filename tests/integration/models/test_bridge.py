"""The HF <-> Megatron bridge: HF weights loaded into any TP/PP layout compute transformers' logits,
and exported weights are HF's tensors bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_checks import LAYOUTS, check_results, load_and_run
from harness import init_megatron, run_distributed
from tiny_models import FAMILIES, save_tiny_hf_model

from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import hf_tensor_specs, hf_to_megatron, megatron_to_hf
from megatron_entropy.models.hf_names import WeightMap, megatron_param_names, weight_map

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
