"""backend='compile' for DIVISION (issue #20 item 5): inductor graphs over chunks of whole planes store and decode
the bits of the specification (formats.division's division_encode_spec / division_decode_spec).

Each compiled variant (bits, block, spatial shape, value dtype) costs an inductor compilation (seconds on a loaded
2-core runner), so five variants cover every value dtype, bits value and spatial rank, block sizes 8 and 3, spatial
sizes divisible by the block and not, and a one-element plane; each is checked on one plane, a few planes, planes of
NaN and +-Inf, and many chunks (the chunk's number of planes is dynamic: plane counts do not compile again)."""
import math

import pytest
import torch

import lightning_act as act
from lightning_act.formats import compiled, compiled_division
from lightning_act.formats import quantize as quantize_format
from lightning_act.formats.division import division_decode_spec, division_encode_spec
from tests.codec_peaks import assert_peaks_within
from tests.cuda_emulation.checks import assert_same_bits
from tests.cuda_emulation.nan_payloads import GROUPS, nan_payload_groups

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")

CPU = torch.device("cpu")
# (spatial, value dtype, bits, block): the codec's defaults (2 bits, block 8) on a 2D map not divisible by the block
# first (the codec tests below use it)
VARIANTS = [((13, 10), torch.float32, 2, 8), ((100,), torch.bfloat16, 4, 8), ((5, 9, 17), torch.float16, 1, 3),
            ((8, 16), torch.float64, 8, 8), ((1,), torch.float32, 2, 8)]


def _planes(planes: int, spatial: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian planes off the float32 grid (float64), each plane with its own offset and scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(planes, *spatial, generator=g, dtype=torch.float64)
    shape = (planes, *[1] * len(spatial))
    return (x * torch.rand(shape, generator=g, dtype=torch.float64) * 4 + torch.randn(shape, generator=g)).to(dtype)


def _inputs(spatial: tuple[int, ...], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    inputs = {"one plane": _planes(1, spatial, dtype), "three planes": _planes(3, spatial, dtype, seed=1)}
    plane = math.prod(spatial)
    if plane >= 10:  # room for nan_payload_groups' special values in each plane
        inputs["NaN and Inf"] = nan_payload_groups(dtype, plane).view(GROUPS, *spatial)
    else:  # planes of one element: NaN, +-Inf and finite values side by side
        inputs["NaN and Inf"] = torch.tensor([1.5, float("nan"), float("inf"), -float("inf"), -2.0]).to(dtype).view(
            5, *spatial)
    return inputs


def _assert_encode_and_decode_are_the_specification(x: torch.Tensor, bits: int, block: int) -> None:
    expected = division_encode_spec(x, block, bits, 3, 11)
    stored = compiled_division.division_encode_compiled(x, block, bits, 3, 11)
    for a, e in zip(stored, expected, strict=True):
        assert_same_bits(a, e)
    args = (*expected, x.shape[0], tuple(x.shape[1:]), block, bits, x.dtype)
    assert_same_bits(compiled_division.division_decode_compiled(*args), division_decode_spec(*args))


@pytest.fixture(scope="module", params=VARIANTS,
                ids=lambda v: f"{'x'.join(map(str, v[0]))}-{v[1]}-{v[2]}bit-b{v[3]}".replace("torch.", ""))
def variant(request):
    return request.param


@pytest.mark.parametrize("chunk", ["default", "few planes"])
def test_encode_and_decode_are_the_specification_bit_for_bit(variant, chunk, monkeypatch):
    """Also with chunks of a few planes (the torch path's chunk shrunk), whose tensors span many graph calls and
    end on a chunk of one plane."""
    spatial, dtype, bits, block = variant
    if chunk == "few planes":
        monkeypatch.setattr(quantize_format, "CHUNK_ELEMENTS", 16)
    inputs = _inputs(spatial, dtype)
    per_call = compiled.groups_per_call(math.prod(spatial), bits, CPU)
    inputs["chunks and one plane"] = _planes(2 * per_call + 1, spatial, dtype, seed=2)
    for x in inputs.values():
        _assert_encode_and_decode_are_the_specification(x, bits, block)


def test_a_tensor_over_one_chunk_reuses_the_compiled_graphs_and_is_the_specification():
    """The first variant on more planes than a graph call takes (its own chunk size): after a first tensor, other
    numbers of planes compile nothing more."""
    from torch._dynamo.utils import counters

    spatial, dtype, bits, block = VARIANTS[0]
    _assert_encode_and_decode_are_the_specification(_planes(4, spatial, dtype), bits, block)
    graphs = counters["stats"]["unique_graphs"]
    per_call = compiled.groups_per_call(math.prod(spatial), bits, CPU)
    for planes in (2, 5, per_call + 7):
        _assert_encode_and_decode_are_the_specification(_planes(planes, spatial, dtype, seed=planes), bits, block)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("shape", [(0, 13, 10), (0, 100)])
def test_empty_tensors_are_the_specification(shape):
    x = torch.empty(shape)
    _assert_encode_and_decode_are_the_specification(x, 2, 8)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_codec_stores_and_decodes_non_contiguous_input_as_the_torch_backend(layout):
    if layout == "channels_last":
        x = torch.randn(3, 40, 13, 10).to(memory_format=torch.channels_last)
    else:
        x = torch.randn(3, 40, 10, 13).transpose(2, 3)
    assert not x.is_contiguous()
    fast, reference = (act.codecs.get("division", backend=b) for b in ("compile", "torch"))
    packed, expected = fast.encode(x, key=5), reference.encode(x, key=5)
    assert packed.buffers.keys() == expected.buffers.keys() and packed.meta == expected.meta
    for name in expected.buffers:
        assert_same_bits(packed.buffers[name], expected.buffers[name])
    decoded = fast.decode(packed)
    assert decoded.shape == x.shape
    assert_same_bits(decoded, reference.decode(expected))


def test_codec_round_trips_linear_rows_and_one_element_as_the_torch_backend():
    """Rows of a linear layer (planes of one 1D spatial dim, bfloat16 at 4 bits) and a 0-d tensor (one plane of one
    element): the second and last variants."""
    for x, bits in [(torch.randn(6, 100).to(torch.bfloat16), 4), (torch.tensor(2.5), 2)]:
        fast, reference = (act.codecs.get("division", bits=bits, backend=b) for b in ("compile", "torch"))
        packed, expected = fast.encode(x, key=9), reference.encode(x, key=9)
        for name in expected.buffers:
            assert_same_bits(packed.buffers[name], expected.buffers[name])
        assert_same_bits(fast.decode(packed), reference.decode(expected))


def test_encode_and_decode_allocate_their_results_and_chunk_sized_workspaces():
    """As on the torch path (tests/test_transients.py): a 64 MiB input costs its outputs plus workspaces of a graph
    call's size (the codes, the unpacking's scratch and inductor's buffers), not of the tensor's: measured 3 MiB
    (encode and decode) with one torch thread, 6 with two, for 16 and 64 MiB inputs alike (decode held a quarter of
    the tensor more when its NaN check ran over the whole statistics of these 130-element planes)."""
    spatial = VARIANTS[0][0]
    slack = 40 * quantize_format.chunk_elements(CPU)  # 5 MiB per thread, a graph call being 4 x 2**17 elements
    codec = act.codecs.get("division", backend="compile")
    assert_peaks_within(codec, torch.randn((1 << 24) // math.prod(spatial), *spatial), slack)
