"""Mixture-of-experts settings that depend on the rollout engine: routing replay from the engine
(R3) is refused for servers naming why, replay works with activation recompute, and a vLLM
rollout of an MoE model warns at start-up."""

from __future__ import annotations

import pytest

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.testing.toy_models import tiny_hf_config
from megatron_entropy.trainer.moe_routing import engine_notes

SERVER = {"urls": ["http://127.0.0.1:1"]}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_rollout_replay_needs_the_in_process_engine(engine):
    with pytest.raises(ConfigError, match=r"^rollout\.routing_replay=rollout needs each token's "
                                          rf"routed experts .*rollout\.engine={engine}: .*Model "
                                          r"Runner V2.*Triton"):
        load_config(data={"rollout": {"engine": engine, "routing_replay": "rollout",
                                      "server": SERVER}})
    # R2 needs nothing from the engine.
    load_config(data={"rollout": {"engine": engine, "routing_replay": "recompute",
                                  "server": SERVER}})


@pytest.mark.parametrize("replay", ["recompute", "rollout"])
def test_replay_with_activation_recompute_is_accepted(replay):
    """The backward's re-forward replays the routing too (REPLAY_BACKWARD; the update equals
    the one without recompute: tests/integration/trainer/test_moe_routing.py)."""
    cfg = load_config(data={"rollout": {"routing_replay": replay},
                            "model": {"recompute_activations": True}})
    assert cfg.rollout.routing_replay == replay and cfg.model.recompute_activations


def test_vllm_with_an_moe_model_warns_once_naming_the_drift_and_the_alternatives():
    moe = arch_from_hf_config(tiny_hf_config("qwen3_moe"))
    dense = arch_from_hf_config(tiny_hf_config("qwen3"))
    (note,) = engine_notes("vllm", moe)
    assert "\n" not in note and "1.95e-2" in note and "rollout/logprob_drift" in note
    assert "rollout.engine=inprocess" in note and "sglang" in note
    assert engine_notes("sglang", moe) == engine_notes("inprocess", moe) == []
    assert engine_notes("vllm", dense) == []
