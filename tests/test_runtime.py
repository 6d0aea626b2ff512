import os
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from megatron_entropy.config import ConfigError, ServerConfig
from megatron_entropy.runtime import LaunchEnv, cpu_compat, detect_launch_env, expand_nodelist
from megatron_entropy.runtime.distributed import pick_backend
from megatron_entropy.runtime.launch_env import SLURM_MASTER_PORT_BASE, SLURM_MASTER_PORT_SPAN


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
    assert e.master_port == SLURM_MASTER_PORT_BASE + 123456 % SLURM_MASTER_PORT_SPAN
    assert detect_launch_env({**env, "SLURM_PROCID": "0"}).master_port == e.master_port


def test_slurm_master_port_stays_below_the_ephemeral_range(monkeypatch):
    """Every job id gets a port below this machine's ephemeral range (where outgoing connections
    take their local ports, so the TCPStore could find it taken) and below the servers'
    default base_port."""
    monkeypatch.setattr("shutil.which", lambda name: None)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}
    ports = {detect_launch_env({**env, "SLURM_JOB_ID": str(job)}).master_port
             for job in range(0, 3 * SLURM_MASTER_PORT_SPAN, 7)}
    assert len(ports) > SLURM_MASTER_PORT_SPAN // 8  # spread, not one port
    assert 1024 <= min(ports) and max(ports) < min(low, ServerConfig().base_port), \
        (min(ports), max(ports), low)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_auto_backend_without_a_visible_gpu_is_an_error_under_slurm(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    monkeypatch.delenv("SLURM_STEP_GPUS", raising=False)
    slurm = LaunchEnv(3, 8, 3, "gpu016", 12345, "slurm")
    with pytest.raises(ConfigError) as e:
        pick_backend("auto", slurm)
    msg = str(e.value)
    assert "parallel.backend=auto" in msg and "rank 3, node gpu017" in msg
    assert "CUDA_VISIBLE_DEVICES=''" in msg and "SLURM_STEP_GPUS=(unset)" in msg
    assert "--gpus-per-node" in msg and "parallel.backend=gloo" in msg
    assert pick_backend("gloo", slurm) == "gloo"  # a CPU run says so
    assert pick_backend("auto", LaunchEnv(0, 2, 0, "h", 1, "torchrun")) == "gloo"  # not Slurm


def _groups_after_init(socket_ifname):
    from megatron.core import parallel_state as ps

    from megatron_entropy.runtime import init_distributed

    init_distributed(1, 1, backend="gloo", socket_ifname=socket_ifname)
    return (os.environ.get("NCCL_SOCKET_IFNAME"), os.environ.get("GLOO_SOCKET_IFNAME"),
            ps._DATA_PARALLEL_GROUP_GLOO, ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO,
            torch.distributed.get_world_size(ps.get_data_parallel_group()))


def test_no_gloo_dp_groups_and_the_socket_interface_reaches_gloo():
    """Megatron's gloo copies of the DP groups are not created; parallel.socket_ifname becomes
    NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME, and gloo's new groups bind that interface: `lo`
    works, an interface that does not exist fails naming it."""
    for rank in run_distributed(_groups_after_init, 2, "lo", timeout=120):
        assert rank == ("lo", "lo", None, None, 2)
    with pytest.raises(AssertionError, match="Unable to find address for: nosuchif0"):
        run_distributed(_groups_after_init, 2, "nosuchif0", timeout=120)


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
