"""``end_rank_at_once`` (runtime/processes.py): a rank of a process group ends with its code, its
exit handlers run and its output flushed, without the interpreter's teardown; outside a group it
does nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import atexit, sys
import torch.distributed as dist
from megatron_entropy.runtime.processes import end_rank_at_once
marker = sys.argv[1]
atexit.register(lambda: open(marker, "w").write("ran"))
if sys.argv[2] == "group":
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
print("last words", end="")  # unflushed: a pipe is block-buffered
end_rank_at_once(75)
print(" and after", end="")
"""


@pytest.mark.parametrize("where", ["group", "alone"])
def test_a_rank_ends_at_once_with_its_exit_handlers_and_output(tmp_path: Path, where):
    marker = tmp_path / "atexit"
    done = subprocess.run([sys.executable, "-c", CHILD, str(marker), where],
                          capture_output=True, text=True, timeout=120)
    assert marker.read_text() == "ran", done.stderr
    if where == "group":
        assert (done.returncode, done.stdout) == (75, "last words"), done.stderr
    else:  # no group: it returns, and the process ends as it would have
        assert (done.returncode, done.stdout) == (0, "last words and after"), done.stderr
