"""Peak measurements shared by the tests of chunked paths: a codec's encode and decode, a compressed backward."""
import torch

from lightning_act.profiling import measure_step_memory


def assert_peaks_within(codec, x: torch.Tensor, slack: int) -> None:
    """Encoding ``x`` allocates at most its encoded form plus ``slack`` bytes, decoding at most ``x``'s size plus
    ``slack`` (on CPU)."""
    codec.decode(codec.encode(x))  # warm-up: the profiler sizes frees only of blocks it saw allocated
    out = []
    peak = measure_step_memory(lambda: out.append(codec.encode(x))).peak_bytes
    assert peak <= out[0].nbytes + slack, f"encode peaked {peak / 2**20:.1f} MiB"
    peak = measure_step_memory(lambda: out.append(codec.decode(out[0]))).peak_bytes
    assert peak <= x.numel() * x.element_size() + slack, f"decode peaked {peak / 2**20:.1f} MiB"


def compressed_backward_peak(module, x: torch.Tensor, compressor) -> int:
    """Bytes the backward of ``module(x)`` (forward under ``compressor``, incoming gradient of ones) allocates at its
    peak above its start, gradients freed before it; one forward and backward first, as the profiler sizes frees
    only of blocks it saw allocated."""
    def forward():
        with compressor.compress():
            return module(x)

    forward().sum().backward()
    out = forward()
    grad = torch.ones_like(out)
    module.zero_grad(set_to_none=True)
    x.grad = None
    return measure_step_memory(lambda: out.backward(grad)).peak_bytes
