import pytest

from megatron_entropy.runtime import cpu_compat, detect_launch_env, expand_nodelist


def test_torchrun_env():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "1234"}
    e = detect_launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == \
        (3, 8, 1, "n0", 1234, "torchrun")


def test_torchrun_env_without_master_is_an_error():
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


def test_slurm_env_master_is_first_node(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)  # parse the node list ourselves
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
           "SLURM_JOB_NODELIST": "gpu[007-008,010],cpu1", "SLURM_JOB_ID": "123456"}
    e = detect_launch_env(env)
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.launcher) == \
        (5, 16, 5, "gpu007", "slurm")
    assert e.master_port == 20000 + 123456 % 20000
    assert detect_launch_env({**env, "SLURM_PROCID": "0"}).master_port == e.master_port


def test_expand_nodelist_syntax(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert expand_nodelist("a[1-3],b,c[09-10]") == ["a1", "a2", "a3", "b", "c09", "c10"]
    assert expand_nodelist("node-x") == ["node-x"]


def test_single_process_default():
    e = detect_launch_env({})
    assert (e.rank, e.world_size, e.launcher) == (0, 1, "single")


def test_cpu_compat_refuses_unknown_megatron(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "9.9.0")
    with pytest.raises(RuntimeError, match="supports megatron-core 0.16.x, but 9.9.0"):
        cpu_compat._check_version()
