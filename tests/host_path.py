"""Stand-ins for the CUDA host path, for tests that count what it does or fake what only CUDA has: the ATen ops a
call runs, a kernel runner that only records, and the CUDA side of lorenzo's lazy trim (pinned slots, events)."""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class recorded_ops(TorchDispatchMode):
    """Context: records the name of every ATen op run inside it (``.ops``), e.g. to count a hot path's
    allocations (``empty.memory_format``)."""

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


class RecordingRunner:
    """A kernel runner for CPU tensors that launches nothing and records each kernel's name."""

    device_type = "cpu"

    def __init__(self):
        self.kernels = []

    def launch(self, source, kernel, grid, block, args, shared_mem, device) -> None:
        self.kernels.append(kernel)


class FakeEvent:
    """Stands in for the CUDA event of an encode: complete once the test says so; counts its records."""

    def __init__(self):
        self.done, self.records = False, []

    def record(self, stream) -> None:
        self.records.append(stream)
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeTrimOps:
    """:class:`~lightning_act.cuda.lorenzo.CudaTrimOps` on CPU: plain host slots, events the test completes, a
    stream that is a name; counts the slot allocations."""

    device_type = "cpu"

    def __init__(self):
        self.allocations, self.events, self.used = 0, [], []

    def current_stream(self, device):
        return "encode stream"

    def new_slots(self, device, count):
        self.allocations += 1
        host = torch.zeros(count, dtype=torch.int64)
        events = [FakeEvent() for _ in range(count)]
        self.events += events
        return [(host[i:i + 1], event) for i, event in enumerate(events)]

    def use(self, stream):
        self.used.append(stream)
        return contextlib.nullcontext()

    def recorded(self):
        return [event for event in self.events if event.records]
