import ipaddress
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import free_port, run_distributed
from megatron_entropy.config import ConfigError, ServerConfig
from megatron_entropy.runtime import LaunchEnv, cpu_compat, detect_launch_env, expand_nodelist
from megatron_entropy.runtime.distributed import pick_backend
from megatron_entropy.runtime.launch_env import (SLURM_MASTER_PORT_BASE, SLURM_MASTER_PORT_SPAN,
                                                 raise_open_files_limit, server_environment)


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


def test_a_slurm_step_on_one_node_meets_on_loopback(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[1-4]",
           "SLURM_STEP_NODELIST": "gpu3", "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    one = detect_launch_env(env)
    assert (one.master_addr, one.single_node) == ("127.0.0.1", True)
    across = detect_launch_env({**env, "SLURM_STEP_NODELIST": "gpu[3-4]",
                                "SLURM_STEP_NUM_NODES": "2"})
    assert (across.master_addr, across.single_node) == ("gpu3", False)
    # torchrun: one machine when all ranks are local or the master is a loopback address.
    torchrun = {"RANK": "0", "WORLD_SIZE": "16", "MASTER_ADDR": "n0", "MASTER_PORT": "1"}
    assert not detect_launch_env({**torchrun, "LOCAL_WORLD_SIZE": "8"}).single_node
    assert detect_launch_env({**torchrun, "LOCAL_WORLD_SIZE": "16"}).single_node
    assert detect_launch_env({**torchrun, "MASTER_ADDR": "127.0.0.1"}).single_node


def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc/net prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
            found.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return found


def _join_like_a_launched_rank(port: int):
    """Worker: leave the harness's group and join the job as `megatron-entropy train --nproc`
    ranks do (init_distributed from RANK/WORLD_SIZE/MASTER_ADDR=127.0.0.1/MASTER_PORT); then
    the sockets this rank listens on, after a collective on the new groups."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.runtime import init_distributed, shutdown

    torch.distributed.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.pop(name, None)
    init_distributed(1, 1, backend="gloo")
    t = torch.ones(1)
    torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    listening = _listening_sockets(os.getpid())
    ifnames = (os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME"))
    shutdown()
    return float(t), listening, ifnames


def test_a_run_on_one_machine_listens_on_loopback_only():
    """Rank 0's c10d store (torch binds it to every interface, [::], whatever MASTER_ADDR
    says) and gloo's sockets listen on loopback only in a 2-rank run on one machine."""
    port = free_port()
    ranks = run_distributed(_join_like_a_launched_rank, 2, port, timeout=120)
    for total, listening, ifnames in ranks:
        assert total == 2.0 and ifnames == ("lo", "lo")
        assert listening, "no listening socket seen"
        assert all(ipaddress.ip_address(a).is_loopback for a, _ in listening), listening
    assert ("127.0.0.1", port) in ranks[0][1]  # the store, on the master address


def test_servers_get_the_environment_without_the_ranks_identity():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
           "GROUP_RANK": "0", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/h"}
    assert server_environment({"VLLM_SERVER_DEV_MODE": "1"}, env) == {
        "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "HF_HOME": "/h",
        "VLLM_SERVER_DEV_MODE": "1"}


def _open_files_limit_raised_from(soft: int):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)


def test_open_files_soft_limit_is_raised_to_the_hard_limit():
    """(In a worker: the limit is the process's.)"""
    [((soft, hard), now)] = run_distributed(_open_files_limit_raised_from, 1, 256)
    assert now == (soft, hard)
    if hard != resource.RLIM_INFINITY:
        assert soft == hard
    assert soft > 256


# A parent that starts a child with die_with_parent(SIGTERM) (as the study starts its runs), then
# waits; the child marks a file on SIGTERM.
_PARENT = """
import functools, os, signal, subprocess, sys
from megatron_entropy.runtime.processes import die_with_parent
child = ("import pathlib, signal, sys, time\\n"
         "def stop(*_): pathlib.Path(sys.argv[1]).touch(); sys.exit(0)\\n"
         "signal.signal(signal.SIGTERM, stop)\\n"
         "print('up', flush=True)\\n"
         "time.sleep(600)\\n")
proc = subprocess.Popen([sys.executable, "-c", child, sys.argv[1]],
                        preexec_fn=functools.partial(die_with_parent, signal.SIGTERM, os.getpid()))
print(proc.pid, flush=True)
proc.wait()
"""


def test_a_child_gets_its_signal_when_the_parent_is_killed(tmp_path):
    """die_with_parent: the parent SIGKILLed (no cleanup of its own), the child gets the signal
    it asked for; a child whose parent is gone before it asked exits at once."""
    marker = tmp_path / "terminated"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(marker)], stdout=subprocess.PIPE,
                              text=True)
    lines = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}  # pid, "up"
    (child,) = {int(line) for line in lines if line.isdigit()}
    assert "up" in lines and not marker.exists()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert marker.exists()
    finally:
        try:
            os.kill(child, signal.SIGKILL)  # a failed check leaves nothing behind
        except ProcessLookupError:
            pass
    gone = subprocess.Popen(["true"])  # a pid that no longer runs: a parent that died already
    gone.wait()
    orphan = subprocess.run([sys.executable, "-c", "from megatron_entropy.runtime.processes import "
                             f"die_with_parent; die_with_parent(parent={gone.pid}); print('ran')"],
                            capture_output=True, text=True, timeout=60)
    assert (orphan.returncode, orphan.stdout) == (1, "")
