"""``model.lora``'s settings and the checks around a LoRA run: bad keys named, the adapter
sync only where the engine serves adapters, vLLM's LoRA ranks, SGLang's LoRA flags, and what a
resume refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.models.arch import UnsupportedModelError
from megatron_entropy.models.lora import fingerprint_difference
from megatron_entropy.models.lora_settings import LoraSettings, check_lora_model
from megatron_entropy.models.megatron_checkpoint import CheckpointError
from megatron_entropy.trainer.lora_run import check_resume


def test_bad_lora_keys_are_named():
    with pytest.raises(ConfigError, match=r"model\.lora\.targets: \['linear_qkvz'\] are not"):
        load_config(overrides=["model.lora.rank=8", "model.lora.targets=[linear_qkvz]"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank: -1 is out of range"):
        load_config(overrides=["model.lora.rank=-1"])
    with pytest.raises(ConfigError, match=r"strategy=adapters has servers load a LoRA adapter "
                                          r"folder, which rollout\.engine=inprocess does not"):
        load_config(overrides=["model.lora.rank=8", "rollout.weight_sync.strategy=adapters"])
    with pytest.raises(ConfigError, match=r"strategy=adapters sends .*set model\.lora\.rank"):
        load_config(overrides=["rollout.engine=vllm", "rollout.server.launch=1",
                               "model.hf_path=m", "rollout.weight_sync.strategy=adapters"])
    with pytest.raises(ConfigError, match=r"strategy=adapters sends .*and model\.hf_path"):
        load_config(overrides=["rollout.engine=vllm", "rollout.server.launch=1",
                               "model.lora.rank=8", "model.megatron_ckpt=ckpt",
                               "rollout.weight_sync.strategy=adapters"])
    with pytest.raises(ConfigError, match=r"model\.lora: .*model\.transformer_impl="
                                          r"transformer_engine replaces"):
        load_config(overrides=["model.lora.rank=8", "model.transformer_impl=transformer_engine"])
    with pytest.raises(ConfigError, match=r"model\.lora: .*set parallel\.sequence_parallel="
                                          r"false"):
        load_config(overrides=["model.lora.rank=8", "parallel.tensor=2",
                               "parallel.sequence_parallel=true"])
    cfg = load_config(overrides=["model.lora.rank=8", "model.lora.alpha=16"])
    assert cfg.model.lora.enabled and cfg.model.lora.scale == 2.0
    assert not load_config().model.lora.enabled  # every weight trained by default


def test_expert_adapters_refused_where_they_cannot_work():
    """Under tensor parallelism, or synced alone; a dense model, or adapters off the experts,
    pass."""
    lora, attention = LoraSettings(rank=8), LoraSettings(rank=8, targets=["linear_qkv"])
    with pytest.raises(UnsupportedModelError, match=r"model\.lora\.targets=\['linear_fc1', "
                                                    r"'linear_fc2'\]: .* need parallel\.tensor=1"):
        check_lora_model(lora, is_moe=True, tensor=2)
    with pytest.raises(UnsupportedModelError, match=r"strategy=adapters: .* no PEFT form"):
        check_lora_model(lora, is_moe=True, adapter_sync=True)
    check_lora_model(lora, is_moe=False, tensor=2, adapter_sync=True)
    check_lora_model(attention, is_moe=True, tensor=2, adapter_sync=True)
    check_lora_model(LoraSettings(), is_moe=True, tensor=2, adapter_sync=True)


def test_vllm_lora_serving_takes_the_next_rank_it_is_built_for():
    from megatron_entropy.config import ServerConfig
    from megatron_entropy.rollout.server.vllm import lora_serving

    cfg = lora_serving(ServerConfig(extra_args=["--enforce-eager"]), 4)
    assert cfg.extra_args == ["--enforce-eager", "--enable-lora", "--max-lora-rank", "8",
                              "--max-loras", "1"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in cfg.extra_env
    assert lora_serving(ServerConfig(), 512).extra_args[2] == "512"
    # A rank vLLM cannot serve is refused when the config loads, before any server starts.
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=600: vLLM serves LoRA adapters "
                                          r"up to rank 512; use rollout\.weight_sync\.strategy"
                                          r"=disk"):
        load_config(overrides=["rollout.engine=vllm", "rollout.server.launch=1",
                               "model.hf_path=m", "model.lora.rank=600",
                               "rollout.weight_sync.strategy=adapters"])


def test_sglang_lora_serving_flags_follow_model_lora():
    from megatron_entropy.config import ServerConfig
    from megatron_entropy.rollout.server.sglang import lora_serving

    lora = LoraSettings(rank=16, targets=["linear_qkv", "linear_fc2"])
    flags = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "down_proj",
             "k_proj", "q_proj", "v_proj", "--max-loras-per-batch", "1", "--max-loaded-loras",
             "2"]
    assert lora_serving(ServerConfig(extra_args=["--tp", "2"]), lora).extra_args == \
        ["--tp", "2", *flags]
    # A launch_command replaces the whole command line: the flags go onto it.
    cfg = lora_serving(ServerConfig(launch_command=["serve", "{model}"]), lora)
    assert cfg.launch_command == ["serve", "{model}", *flags] and cfg.extra_args == []
    # SGLang's --max-lora-rank has no list of ranks: vLLM's largest does not bound it.
    cfg = load_config(overrides=["rollout.engine=sglang", "rollout.server.launch=1",
                                 "model.hf_path=m", "model.lora.rank=600",
                                 "rollout.weight_sync.strategy=adapters"])
    assert cfg.rollout.weight_sync.strategy_for("sglang") == "adapters"


def _identity(**changes) -> dict:
    identity = {"rank": 8, "alpha": 16.0, "targets": ["linear_qkv"], "base_key": "model.hf_path",
                "base": "/models/a", "dtype": "bf16",
                "fingerprint": {"decoder.layers.0.mlp.linear_fc1.weight": [1.5, 1.0e4]}}
    return {**identity, **changes}


def test_resume_refuses_what_the_checkpoint_cannot_resume():
    path = Path("run/checkpoints/step_00000002")
    check_resume({"lora": _identity()}, _identity(), path)
    check_resume({}, None, path)  # no adapters either side
    with pytest.raises(CheckpointError, match=r"set model\.lora\.rank=8 to resume it"):
        check_resume({"lora": _identity()}, None, path)
    with pytest.raises(CheckpointError, match=r"model\.lora\.rank=8: .* holds every weight"):
        check_resume({}, _identity(), path)
    with pytest.raises(CheckpointError, match=r"model\.lora\.rank=4, but .* rank 8"):
        check_resume({"lora": _identity()}, _identity(rank=4), path)
    other = _identity(fingerprint={"decoder.layers.0.mlp.linear_fc1.weight": [1.5, 1.001e4]})
    with pytest.raises(CheckpointError, match=r"model\.hf_path: the base model .* is not the one"
                                              r".*linear_fc1\.weight differs"):
        check_resume({"lora": _identity()}, other, path)


def test_fingerprints_differ_beyond_float64_rounding_only():
    saved = {"w": [0.25, 400.0]}
    assert fingerprint_difference(saved, {"w": [0.25 + 1e-12, 400.0 * (1 + 1e-13)]}) is None
    assert "w differs" in fingerprint_difference(saved, {"w": [0.25, 400.0 * (1 + 1e-7)]})
    assert "w differs" in fingerprint_difference(saved, {"w": [0.26, 400.0]})
    assert "other tensors" in fingerprint_difference(saved, {"v": [0.25, 400.0]})
