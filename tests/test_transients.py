"""Bounded transients (issue #17 item 1): what one encode, one decode or one backward allocates besides its
result, measured by the allocator (``lightning_act.profiling``), not estimated."""
import pytest
import torch
import torch.nn.functional as F

import lightning_act as act
from lightning_act.formats.quantize import chunk_elements
from lightning_act.profiling import measure_step_memory

MiB = 2**20
N = 1 << 22  # 4 Mi elements: 16 MiB of float32, 4 MiB of bool, 0.5 MiB at 1 bit
# chunk workspaces and small tensors: 16 bytes per chunk element (2 MiB at one torch thread; chunks grow with
# the threads), far below any whole-tensor temporary of these 16 MiB inputs
SLACK = max(2 * MiB, 16 * chunk_elements(torch.device("cpu")))


def _peak(fn) -> tuple[int, object]:
    """(peak bytes above the start of ``fn()``, what it returned)."""
    out = []
    peak = measure_step_memory(lambda: out.append(fn())).peak_bytes
    return peak, out[0]


def _noise(n: int, p: float = 0.1) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.empty(n).bernoulli_(1 - p).div_(1 - p)


# each lossless mask codec with an input it takes
MASK_INPUTS = [
    ("positive_mask", lambda: torch.randn(N)),
    ("scaled_mask", lambda: _noise(N)),
    ("bitmask", lambda: torch.randn(N) > 0),
]


@pytest.mark.parametrize("name,make", MASK_INPUTS)
def test_mask_encode_allocates_its_payload_and_a_bounded_workspace(name, make):
    codec, x = act.codecs.get(name), make()
    codec.encode(x)  # warm-up: the profiler sizes frees only of blocks it saw allocated
    peak, packed = _peak(lambda: codec.encode(x))
    assert peak <= packed.nbytes + SLACK, f"{name}.encode peaked {peak / MiB:.1f} MiB for {packed.nbytes / MiB:.1f}"


@pytest.mark.parametrize("name,make", MASK_INPUTS)
def test_mask_decode_allocates_its_output_and_a_bounded_workspace(name, make):
    codec, x = act.codecs.get(name), make()
    packed = codec.encode(x)
    expected = (x > 0).to(x.dtype) if name == "positive_mask" else x
    peak, y = _peak(lambda: codec.decode(packed))
    assert torch.equal(y, expected)
    out_bytes = y.numel() * y.element_size()
    assert peak <= out_bytes + SLACK, f"{name}.decode peaked {peak / MiB:.1f} MiB for a {out_bytes / MiB:.1f} MiB output"


def _pool_indices(batch=16, channels=64, side=112):
    torch.manual_seed(0)
    x = torch.randn(batch, channels, side, side)
    _, index = F.max_pool2d_with_indices(x, 3, 2, 1)
    return act.codecs.get("maxpool_index", kernel_size=3, input_size=(side, side), stride=2, padding=1), index


def test_maxpool_index_encode_and_decode_bound_their_int64_temporaries():
    codec, index = _pool_indices()  # 16 x 64 x 56 x 56 int64: 24.5 MiB
    index_bytes = index.numel() * 8
    packed = codec.encode(index)
    peak, again = _peak(lambda: codec.encode(index))
    assert peak <= again.nbytes + SLACK, f"encode peaked {peak / MiB:.1f} MiB"
    peak, y = _peak(lambda: codec.decode(packed))
    assert torch.equal(y, index)
    assert peak <= index_bytes + SLACK, f"decode peaked {peak / MiB:.1f} MiB for {index_bytes / MiB:.1f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bfloat16_cast_encodes_and_decodes_without_a_whole_nan_mask(dtype):
    """quantize at 16 bits: the bfloat16 copy's NaNs are made canonical chunk by chunk (the whole-tensor isnan
    mask was a byte per element: encode 12 MiB, decode 20 MiB for 16 MiB of float32 before)."""
    torch.manual_seed(0)
    x = torch.randn(N).to(dtype)
    x[::1000] = float("nan")
    codec = act.codecs.get("quantize", bits=16)
    packed = codec.encode(x)
    if dtype == torch.float16:  # 16-bit inputs are kept raw: nothing to bound
        return
    peak, again = _peak(lambda: codec.encode(x))
    assert peak <= again.nbytes + SLACK, f"encode peaked {peak / MiB:.1f} MiB"
    peak, y = _peak(lambda: codec.decode(packed))
    assert torch.equal(y.isnan(), x.isnan())
    assert peak <= x.numel() * 4 + SLACK, f"decode peaked {peak / MiB:.1f} MiB"


def test_lorenzo_torch_path_temporaries_are_a_chunks_not_the_tensors():
    """The lorenzo torch path works chunk by chunk: an encode or decode of a tensor twice as large peaks higher
    by no more than the extra stored and decoded bytes (its workspace is one chunk's,
    ``formats.lorenzo_fast.chunk_elements``), and that workspace stays under 200 bytes per chunk element."""
    from lightning_act.formats.lorenzo_fast import chunk_elements as lorenzo_chunk

    chunk = lorenzo_chunk(torch.device("cpu"))
    codec = act.codecs.get("lorenzo", error_bound=1e-2, backend="torch")
    torch.manual_seed(0)
    peaks = {}
    for n in (4 * chunk, 8 * chunk):
        x = torch.randn(n).relu_()
        codec.encode(x)  # warm-up (see the mask tests)
        encode_peak, packed = _peak(lambda: codec.encode(x))
        decode_peak, y = _peak(lambda: codec.decode(packed))
        assert (y - x).abs().max() <= 1e-2
        peaks[n] = (encode_peak - packed.nbytes, decode_peak - y.numel() * y.element_size())
    (small_encode, small_decode), (large_encode, large_decode) = peaks[4 * chunk], peaks[8 * chunk]
    assert large_encode <= small_encode + SLACK and large_decode <= small_decode + SLACK, peaks
    assert max(large_encode, large_decode) <= 200 * chunk, peaks
