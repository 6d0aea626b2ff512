"""The environment of a vLLM CPU server (rollout/server/vllm.py: server_env) and the
sitecustomize it puts first on the server's PYTHONPATH: every Python process of the server asks
Linux for AMX permission (vLLM 0.32's CPU AMX attention does not, and its workers died of SIGILL
at their first request on an Intel Xeon with AMX), and a sitecustomize later on the path still
runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_entropy.rollout.server.vllm import CPU_SITE, server_env

ARCH_GET_XCOMP_PERM = 0x1022
XTILEDATA = 1 << 18
PERMITTED = (
    "import ctypes\n"
    "mask = ctypes.c_uint64(0)\n"
    f"ctypes.CDLL(None).syscall(158, {ARCH_GET_XCOMP_PERM}, ctypes.byref(mask))\n"
    f"print(bool(mask.value & {XTILEDATA}))\n")


def _cpu_has_amx() -> bool:
    return "amx_tile" in Path("/proc/cpuinfo").read_text()


def test_a_cpu_server_gets_the_site_first_on_its_path_and_the_reload_endpoints():
    env = server_env({"PYTHONPATH": "/plugins", "X": "1"}, on_cpu=True)
    assert env["PYTHONPATH"] == os.pathsep.join([str(CPU_SITE), "/plugins"])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["X"] == "1"
    assert server_env({}, on_cpu=False) == {"VLLM_SERVER_DEV_MODE": "1"}  # GPU: as it is


def test_every_process_with_the_site_on_its_path_may_use_amx(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the next sitecustomize ran')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CPU_SITE), str(other)])}
    out = subprocess.run([sys.executable, "-c", PERMITTED], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out[0] == "the" and out[-1] == str(_cpu_has_amx())
    # Without it a process has no AMX permission until something asks.
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", PERMITTED], env=bare, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["False"]
