"""A mixture-of-experts policy at EP=2 feeding a shared rollout engine (the strict fake SGLang
server, disk sync): DP replica 1 hands its experts to replica 0's weight stream, whose leader
writes the whole checkpoint; the server reloads it and the weight check after each sync passes."""

from __future__ import annotations

from harness import metrics_rows, run_distributed, train_from_dict
from test_rollout_sglang import fake_command

from megatron_entropy.testing.toy_models import save_tiny_hf_model, save_tokenizer


def test_ep2_run_feeds_a_server_from_every_ep_rank(tmp_path):
    model = save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, vocab_size=512,
                               max_position_embeddings=512)
    save_tokenizer(model, 512)
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"expert": 2},
        "rollout": {"engine": "sglang", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96, "routing_replay": "recompute",
                    "server": {"launch": 1, "base_port": 32650, "startup_timeout_s": 120,
                               "launch_command": fake_command()}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 256}},
        "trainer": {"steps": 2, "lr": 1e-2, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "server", "runs_dir": str(tmp_path), "progress_bar": False},
    }
    run_distributed(train_from_dict, 2, cfg, timeout=300)
    rows = metrics_rows(tmp_path / "server")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["weight_check/replicas"] == 1 and r["weight_sync/bytes"] > 0 for r in rows)
    assert all(r["moe/routing_mismatch"] == 0 for r in rows)
