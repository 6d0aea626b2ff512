"""Tools the loop tests configure by module (``tools_under_test:HostilePython``): tool workers
import them from pytest's sys.path, as reward workers import rewards_under_test."""

from __future__ import annotations

from megatron_entropy.tool_use.tools import PythonTool

# What the code tool runs instead of the scripted model's ``print(S*2)``, by S (the sum it was
# given, megatron_entropy/testing/tool_script.py): each a hostile snippet of its own.
HOSTILE = {
    "5": "import time\ntime.sleep(600)",
    "13": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)",
    "11": "print('x' * 10_000_000)",
    "10": ("import os, signal, time\n"
           "for _ in range(100):\n"
           "    try:\n"
           "        if os.fork() == 0:\n"
           "            time.sleep(600)\n"
           "    except OSError:\n"
           "        break\n"
           "os.kill(os.getpid(), signal.SIGSEGV)"),
}


class HostilePython(PythonTool):
    """The code tool, running the hostile snippet of the sum the policy's code doubles."""

    def __call__(self, code=None, **extra):
        total = (code or "").removeprefix("print(").split("*")[0]
        return super().__call__(code=HOSTILE.get(total, code), **extra)
