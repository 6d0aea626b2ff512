"""``rollout.weight_sync``: its old keys are still read, each with one line, as the keys they
became; a strategy the engine has no endpoints for is refused when the config loads."""

from __future__ import annotations

import pytest

from megatron_entropy.config import ConfigError, load_config

SERVERS = ["rollout.server.urls=[http://10.0.0.2:30000]"]
OLD = {"rollout": {"engine": "sglang", "weight_sync_bucket_mb": 64,
                   "server": {"urls": ["http://10.0.0.2:30000"], "weight_sync": "distributed", "weight_sync_dir": "/dev/shm/w",
                              "weight_sync_backend": "gloo",
                              "weight_sync_master_addr": "10.0.0.12"}}}
NEW = {"rollout": {"engine": "sglang", "server": {"urls": ["http://10.0.0.2:30000"]},
                   "weight_sync": {
    "strategy": "broadcast", "bucket_mb": 64, "dir": "/dev/shm/w", "backend": "gloo",
    "master_addr": "10.0.0.12"}}}


def test_old_keys_are_read_as_the_new_ones_with_one_line_each(tmp_path):
    old, new = load_config(data=OLD), load_config(data=NEW)
    assert old.to_dict() == new.to_dict()
    assert new.deprecations == ()
    assert old.deprecations == (
        "config key 'rollout.weight_sync_bucket_mb' is deprecated: it is read as "
        "'rollout.weight_sync.bucket_mb'; rename it",
        "config key 'rollout.server.weight_sync' is deprecated: it is read as "
        "'rollout.weight_sync.strategy' ('distributed' is 'broadcast' there); rename it",
        "config key 'rollout.server.weight_sync_dir' is deprecated: it is read as "
        "'rollout.weight_sync.dir'; rename it",
        "config key 'rollout.server.weight_sync_backend' is deprecated: it is read as "
        "'rollout.weight_sync.backend'; rename it",
        "config key 'rollout.server.weight_sync_master_addr' is deprecated: it is read as "
        "'rollout.weight_sync.master_addr'; rename it")
    assert OLD["rollout"]["server"]["weight_sync"] == "distributed"  # the caller's is left as is
    # In a YAML file and on the command line too; an override of the old key wins over the
    # file's new one, as any override does.
    (tmp_path / "c.yaml").write_text("rollout:\n  engine: sglang\n  server:\n"
                                     "    weight_sync: disk\n")
    from_file = load_config(tmp_path / "c.yaml", ["rollout.server.weight_sync=distributed",
                                                  *SERVERS])
    assert from_file.rollout.weight_sync.strategy == "broadcast"
    assert len(from_file.deprecations) == 1
    (tmp_path / "new.yaml").write_text("rollout:\n  weight_sync:\n    bucket_mb: 8\n")
    assert load_config(tmp_path / "new.yaml", ["rollout.weight_sync_bucket_mb=16"]
                       ).rollout.weight_sync.bucket_mb == 16


def test_an_old_key_beside_its_new_one_is_refused():
    with pytest.raises(ConfigError, match="config keys 'rollout.weight_sync_bucket_mb' and "
                                          "'rollout.weight_sync.bucket_mb' are both set"):
        load_config(data={"rollout": {"weight_sync_bucket_mb": 8,
                                      "weight_sync": {"bucket_mb": 16}}})


@pytest.mark.parametrize("engine, strategy, why", [
    ("vllm", "broadcast", "rollout.weight_sync.strategy=broadcast broadcasts to the servers' "
                          "ranks (SGLang's endpoints), which rollout.engine=vllm does not take: "
                          "use disk or adapters (or auto)"),
    ("inprocess", "disk", "rollout.weight_sync.strategy=disk has servers reload an HF folder, "
                          "which rollout.engine=inprocess does not take: use in_place (or auto)"),
    ("sglang", "in_place", "rollout.weight_sync.strategy=in_place copies tensors into the "
                           "in-process engine's model, which rollout.engine=sglang does not "
                           "take: use disk or broadcast or adapters (or auto)")])
def test_a_strategy_the_engine_cannot_take_is_refused_at_load(engine, strategy, why):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"rollout.engine={engine}",
                               f"rollout.weight_sync.strategy={strategy}", *SERVERS])
    assert str(e.value) == why


@pytest.mark.parametrize("engine, strategy", [("inprocess", "in_place"), ("vllm", "disk"),
                                              ("sglang", "disk")])
def test_auto_is_the_engine_s_own(engine, strategy):
    cfg = load_config(overrides=[f"rollout.engine={engine}", *SERVERS])
    assert cfg.rollout.weight_sync.strategy_for(engine) == strategy
