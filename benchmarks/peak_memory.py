"""Peak memory of one training step on CPU, measured from the process's resident set (not from counting bytes).

Linux keeps the peak resident set size (VmHWM) and lets a process reset it (``/proc/self/clear_refs`` = 5).
glibc serves large allocations with mmap and returns them on free, but raises that threshold dynamically
after frees, which would hide reused memory from the RSS; ``ensure_fixed_mmap_threshold()`` re-executes the
script once with ``MALLOC_MMAP_THRESHOLD_`` pinned at 64 KiB, so every tensor above it maps and unmaps pages
and the peak RSS above the pre-step RSS is the step's peak of live tensor memory (plus small-object noise of
a few hundred KiB). Used by every benchmark that reports peak memory.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

MMAP_THRESHOLD = "65536"


def ensure_fixed_mmap_threshold() -> None:
    """Re-execute the running script with a fixed glibc mmap threshold (once; no-op when already set)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status: peak memory needs Linux")


def resident_bytes() -> int:
    """The process's resident set now."""
    return _status_bytes("VmRSS:")


def peak_resident_bytes() -> int:
    """The resident set's peak (VmHWM) since the process started or the last ``reset_peak()``."""
    return _status_bytes("VmHWM:")


def reset_peak() -> None:
    """Reset the resident-set peak (VmHWM) to the current resident set: what ran before no longer counts."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_step_bytes(step: Callable[[], object]) -> int:
    """Bytes the resident set grew to above its level before ``step()`` ran (``step`` may call ``reset_peak()``
    to leave out what it did before, such as planning: then the peak after it counts)."""
    before = resident_bytes()
    reset_peak()
    step()
    return peak_resident_bytes() - before
