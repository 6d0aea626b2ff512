"""Put first on a vLLM CPU server's PYTHONPATH (rollout/server/vllm.py: server_env), so that every
Python process of the server runs this at start-up.

vLLM 0.32's CPU build runs its AMX attention kernels (bf16, Intel Xeons with AMX) without asking
Linux for permission to use the AMX tile registers, which a process must do before its first
AMX instruction (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): unless something else in
the worker asked first (oneDNN does when it runs an AMX kernel), the worker dies of SIGILL at its
first request. This asks once per process, as torch._C._cpu._init_amx() does; on a CPU without
AMX Linux refuses and nothing changes. A sitecustomize later on the path still runs.
"""

import ctypes
import importlib.util
import os
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM,
                                                  XFEATURE_XTILEDATA)
    except (OSError, AttributeError):
        pass

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _next = os.path.join(_entry or os.getcwd(), "sitecustomize.py")
    if os.path.abspath(os.path.dirname(_next)) != _here and os.path.isfile(_next):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _next)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
