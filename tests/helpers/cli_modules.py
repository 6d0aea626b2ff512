"""The modules a fresh `megatron-entropy` process loaded: to check that a command loads only
what it needs (no torch where it computes nothing)."""

from __future__ import annotations

import json
import subprocess
import sys

# Run as a user starts it (python -m megatron_entropy.cli ARGS); at exit, the modules it loaded.
_LOADED_AT_EXIT = """
import atexit, json, runpy, sys
atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv = ["megatron-entropy", *sys.argv[1:]]
runpy.run_module("megatron_entropy.cli", run_name="__main__")
"""


def cli_modules(*args: str, code: int) -> tuple[set[str], list[str]]:
    """``megatron-entropy ARGS`` in a fresh process, which must exit with ``code``: (the modules
    it loaded, the lines of its stderr before their list)."""
    done = subprocess.run([sys.executable, "-c", _LOADED_AT_EXIT, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    *err, loaded = done.stderr.strip().splitlines()
    return set(json.loads(loaded)), err
