"""Peak memory of a process on Linux, for benchmarks: the RSS high-water mark since a reset.

RSS follows the live tensors only when freed blocks go back to the system: ``follow_live_tensors``
re-executes the process with glibc's mmap threshold at 64 KiB (every larger block its own
mapping, unmapped on free) unless it is set already. ``reset_peak`` then clears the kernel's
high-water mark (/proc/self/clear_refs = 5) and returns the RSS; ``status_kb("VmHWM")`` minus it
is the peak since.
"""

from __future__ import annotations

import os
import sys


def follow_live_tensors() -> None:
    """Re-run this program with MALLOC_MMAP_THRESHOLD_=65536 (once; a no-op when it is set)."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Reset the RSS high-water mark; the RSS now, in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS")
