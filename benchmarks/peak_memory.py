"""Peak memory of one training step on CPU, measured from the process's resident set (not from counting bytes).

Linux keeps the peak resident set size (VmHWM) and lets a process reset it (``/proc/self/clear_refs`` = 5).
glibc serves large allocations with mmap and returns them on free, but raises that threshold dynamically
after frees, which would hide reused memory from the RSS; ``ensure_fixed_mmap_threshold()`` re-executes the
script once with ``MALLOC_MMAP_THRESHOLD_`` pinned at 64 KiB, so every tensor above it maps and unmaps pages
and the peak RSS above the pre-step RSS is the step's peak of live tensor memory (plus small-object noise of
a few hundred KiB). Used by every benchmark that reports peak memory.

That pin makes every large allocation fault its pages in afresh: a step that allocates more blocks (a compressed
one: payloads, decode outputs) pays for it in time as no user's process does (a compiled BERT step at 4 bits took
1.42x the compiled one with the pin, 1.06-1.14x without). And the pin cannot be lifted for a while and set again:
glibc serves later allocations from the free chunks the heap kept, out of the resident set's sight. So benchmarks
time their steps in a child process without it (``timing_child``), which rebuilds the same models.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

MMAP_THRESHOLD = "65536"
# set in a timing child: the path its timings are written to (``write_timings``); it runs without the pin
TIMING_CHILD_ENV = "LIGHTNING_ACT_BENCH_TIMINGS"


def ensure_fixed_mmap_threshold() -> None:
    """Re-execute the running script with a fixed glibc mmap threshold (once; no-op when already set, and in a
    timing child, which measures no peak)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD and not is_timing_child():
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def is_timing_child() -> bool:
    """Whether this process is a ``timing_child``: it times steps and measures no peak."""
    return TIMING_CHILD_ENV in os.environ


def timing_child(script: str | Path, argv: list[str], timeout: float = 3600) -> dict:
    """Run ``script argv`` in a child process with glibc's own allocation thresholds (no pin) and return what it
    wrote with ``write_timings``. Its output goes to this process's stdout and stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
        env[TIMING_CHILD_ENV] = str(out)
        subprocess.run([sys.executable, str(script), *argv], env=env, check=True, timeout=timeout)
        return json.loads(out.read_text())


def write_timings(timings: dict) -> None:
    """A timing child's result, for ``timing_child`` in its parent."""
    Path(os.environ[TIMING_CHILD_ENV]).write_text(json.dumps(timings))


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
    if is_timing_child():
        raise RuntimeError("a timing child runs without the pinned mmap threshold: its resident set is no peak")
    before = resident_bytes()
    reset_peak()
    step()
    return peak_resident_bytes() - before
