"""The end of the two-process scripts the distributed tests run (Lightning DDP/FSDP ranks, torchrun workers)."""
import os
import sys

import torch


def end_rank() -> None:
    """End this rank once its results are written: every rank past that point (a barrier, so the test finds every
    rank's file when the launching process returns), the process group destroyed, then ``os._exit(0)``. gloo's
    worker threads can still abort the interpreter's teardown after ``destroy_process_group`` ("terminate called
    without an active exception", SIGABRT, seen on loaded CI machines), and that teardown writes nothing a test
    reads."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
