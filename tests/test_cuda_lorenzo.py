"""The CUDA lorenzo kernels, run on CPU threads by the emulation harness, against the torch specification.

Bit for bit: headers, payload bytes and sizes, decoded tensors, NaN encodings included. Every block mode (raw,
Lorenzo, sparse, verbatim, all-zero), every dtype the kernels take (float64 runs the torch path), escapes of
every kind. The payload's reservation and its lazy trim (no host read of a device value) are tested here too."""
import numpy as np
import pytest
import torch

import lightning_act.codecs.lorenzo as codec_lorenzo
import lightning_act.cuda.launcher as launcher
import lightning_act.cuda.lorenzo as cuda_lorenzo
import lightning_act.formats.lorenzo as spec
from lightning_act.codecs.lorenzo import LorenzoCodec
from lightning_act.cuda.launcher import OneBuffer, use_runner
from lightning_act.cuda.lorenzo import KERNEL_DTYPES, lorenzo_decode_cuda, lorenzo_encode_cuda
from lightning_act.formats.lorenzo import (
    MODE_LORENZO,
    MODE_RAW,
    MODE_SPARSE,
    MODE_VERBATIM,
    block_sizes,
    lorenzo_encode_reference,
    working_bound,
)
from tests.cuda_emulation.checks import assert_refused_before_launch, assert_same_bits, check_lorenzo, lorenzo_data
from tests.cuda_emulation.emulator import EmulatorRunner, requires_gxx
from tests.cuda_emulation.nan_payloads import INT_VIEW, nan_payload_groups
from tests.host_path import FakeTrimOps, RecordingRunner, recorded_ops

DTYPES = list(KERNEL_DTYPES)


@pytest.mark.parametrize("n", [1, 31, 33, 1000])
@pytest.mark.parametrize("kind", ["noise", "smooth", "relu", "zeros", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("error_bound", [1e-1, 1e-3, 1e-5])
@pytest.mark.toolchain
@requires_gxx
def test_random_tensors_bit_identical(runner, error_bound, dtype, kind, n):
    check_lorenzo(runner, lorenzo_data(kind, n).to(dtype), error_bound)


@pytest.mark.toolchain
@requires_gxx
def test_every_mode_appears_and_matches(runner):
    x = lorenzo_data("mixed", 3000)
    x[2000] = float("nan")
    modes = block_sizes(check_lorenzo(runner, x, 1e-3)["header"], 4)[3]
    assert {MODE_RAW, MODE_LORENZO, MODE_SPARSE, MODE_VERBATIM} <= set(modes.tolist())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.toolchain
@requires_gxx
def test_wide_codes_of_16_bit_inputs_are_stored_verbatim(runner, dtype):
    """Codes of more than 16 bits cost more than a 16-bit block's own values: the block is stored verbatim."""
    x = (lorenzo_data("noise", 640) * 100).to(dtype)
    modes = block_sizes(check_lorenzo(runner, x, 1e-5)["header"], 2)[3]
    assert torch.all(modes == MODE_VERBATIM)


def _special(case: str, dtype: torch.dtype, error_bound: float) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(700)
    if case == "non_finite":
        x[::7], x[3::11], x[5::13] = float("nan"), float("inf"), float("-inf")
    elif case == "huge":  # beyond the 2**29 code range: escapes
        x = x * 1e30
    elif case == "signed_zeros":
        x[::2] = -0.0
        x[1::4] = 0.0
    elif case == "at_the_bound":  # |x| == eb, one ulp either side, and the grid's half points
        eb = torch.tensor(error_bound, dtype=torch.float32)
        ladder = torch.stack([eb, torch.nextafter(eb, torch.tensor(0.0)), torch.nextafter(eb, torch.tensor(1.0)),
                              3 * eb, 5 * eb]).repeat(140)
        x = ladder * torch.where(torch.rand(700) < 0.5, -1.0, 1.0)
    elif case == "denormal":
        x = x * 1e-39
    elif case == "constant":  # Lorenzo blocks of a lead value only (no plane): nothing else in the payload
        x = torch.full((700,), 0.5)
    elif case == "lead_bytes":  # Lorenzo blocks of codes q, q + 1, ... whose lead q needs 1, 2, 3 and 4 bytes
        step = working_bound(error_bound)[1]
        leads = torch.tensor([-3, -1000, 40000, 9_000_000]).repeat_interleave(32) + torch.arange(32).repeat(4)
        x = (leads.float() * step).repeat(6)[:700]
    return x.to(dtype)


@pytest.mark.parametrize("case", ["non_finite", "huge", "signed_zeros", "at_the_bound", "denormal", "constant",
                                  "lead_bytes"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_special_values_bit_identical(runner, dtype, case):
    check_lorenzo(runner, _special(case, dtype, 1e-2), 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_nan_payloads_come_back_bit_for_bit(runner, dtype):
    """NaNs of every encoding and +-Inf escape: the kernels store their blocks verbatim and give the raw bits back,
    as the spec."""
    x = nan_payload_groups(dtype, 32, tail=7)
    expected = check_lorenzo(runner, x, 1e-2)
    decoded = lorenzo_decode_cuda(expected, x.numel(), 1e-2, dtype, runner=runner)
    bad = ~x.isfinite()
    assert torch.equal(decoded.view(INT_VIEW[dtype])[bad], x.view(INT_VIEW[dtype])[bad])
    holds_escape = torch.cat([bad, bad.new_zeros(-x.numel() % spec.BLOCK)]).view(-1, spec.BLOCK).any(dim=1)
    modes = block_sizes(expected["header"], x.element_size())[3]
    assert holds_escape.any() and torch.all(modes[holds_escape] == MODE_VERBATIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_bound_beyond_float32_range_is_capped_alike(runner, dtype):
    x = _special("non_finite", torch.float32, 1e-2) * 1e37
    check_lorenzo(runner, x.to(dtype), 1e39)


@pytest.mark.toolchain
@requires_gxx
def test_lorenzo_blocks_with_lead_values_of_1_to_4_bytes(runner):
    header = check_lorenzo(runner, _special("lead_bytes", torch.float32, 1e-2), 1e-2)["header"]
    _, _, _, mode, _, lead = block_sizes(header, 4)
    assert set(lead[mode == MODE_LORENZO].tolist()) == {1, 2, 3, 4}


@pytest.mark.toolchain
@requires_gxx
def test_thread_blocks_claim_tiles_beyond_the_grid(runner, monkeypatch):
    monkeypatch.setattr(launcher, "MAX_BLOCKS", 2)
    runner.launches.clear()
    # 525 blocks, 17 tiles: beyond a grid of 2 thread blocks
    check_lorenzo(runner, _special("non_finite", torch.float32, 1e-2).repeat(24), 1e-2)
    assert {launch[2] for launch in runner.launches} == {(2, 1, 1)}


@pytest.mark.parametrize("kind", ["smooth", "noise"])
@pytest.mark.toolchain
@requires_gxx
def test_codec_on_the_kernel_path_equals_the_torch_codec(runner, kind):
    """LorenzoCodec through the kernels == through torch, for a strided input, compressible or not (noise at a
    bound below float32's resolution escapes: verbatim blocks); the kernels' payload is the reservation (off
    CUDA nothing trims it)."""
    x = lorenzo_data(kind, 2 * 600).view(20, 60)[:, ::2]
    bound = 1e-3 if kind == "smooth" else 1e-7
    with use_runner(runner):  # the emulator stands in for the GPU
        kernel_packed = LorenzoCodec(error_bound=bound, backend="cupy").encode(x)
    assert len(cuda_lorenzo.TRIMS) == 0  # off CUDA nothing is queued
    torch_codec = LorenzoCodec(error_bound=bound, backend="torch")
    torch_packed = torch_codec.encode(x)
    header, payload = torch_packed.buffers["header"], torch_packed.buffers["payload"]
    assert kernel_packed.buffers.keys() == torch_packed.buffers.keys()
    assert_same_bits(kernel_packed.buffers["header"], header)
    assert_same_bits(kernel_packed.buffers["payload"][:payload.numel()], payload)
    assert kernel_packed.nbytes == 2 * header.numel() + 4 * 608
    modes = block_sizes(header, 4)[3]
    assert bool(torch.any(modes == MODE_VERBATIM)) == (kind == "noise")  # float32 steps wider than 2 * eb escape
    assert_same_bits(torch_codec.decode(kernel_packed), torch_codec.decode(torch_packed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["contiguous", "channels_last"])
@pytest.mark.toolchain
@requires_gxx
def test_codec_kernel_path_takes_either_layout_and_every_dtype(runner, memory_format, dtype):
    """A (2, 6, 20, 24) activation, contiguous or channels_last, spanning several tiles: the kernel path (float64:
    the torch path) decodes to the torch codec's values in the input's shape."""
    x = lorenzo_data("mixed", 2 * 6 * 20 * 24).view(2, 6, 20, 24).to(dtype).contiguous(memory_format=memory_format)
    runner.launches.clear()
    with use_runner(runner):
        kernels = LorenzoCodec(error_bound=1e-2, backend="cupy")
        decoded = kernels.decode(kernels.encode(x))
    assert bool(runner.launches) == (dtype != torch.float64)
    reference = LorenzoCodec(error_bound=1e-2, backend="torch")
    assert decoded.shape == x.shape
    assert_same_bits(decoded.contiguous(), reference.decode(reference.encode(x)).contiguous())
    assert (decoded.float() - x.float()).abs().max() <= 1e-2


@pytest.fixture
def fake_trims(monkeypatch):
    """The codec's trim queue on CPU (``FakeTrimOps``): the emulator's encodes are tracked as CUDA's are."""
    trims = cuda_lorenzo.PayloadTrims(FakeTrimOps())
    monkeypatch.setattr(codec_lorenzo, "TRIMS", trims)
    return trims


@pytest.mark.toolchain
@requires_gxx
def test_payloads_are_trimmed_in_order_once_their_encode_completed(runner, fake_trims):
    """PayloadTrims cuts each payload to the size its encode left on the device, only after its event completed
    and the older ones too, on the encode's stream; a form released before its trim is skipped; the trimmed form
    is one allocation and decodes as the reference does."""
    x = lorenzo_data("smooth", 1000)
    with use_runner(runner):
        kernels = LorenzoCodec(error_bound=1e-3, backend="cupy")
        forms = [kernels.encode(x), kernels.encode(x * 2), kernels.encode(x)]
    reference = LorenzoCodec(error_bound=1e-3, backend="torch")
    expected = [reference.encode(v) for v in (x, x * 2, x)]
    events = fake_trims.ops.recorded()
    assert len(fake_trims) == 3 and len(events) == 3
    assert [event.records for event in events] == [["encode stream"]] * 3
    del forms[2], expected[2]  # released (decoded) before its trim
    events[1].done = True
    fake_trims.poll()  # the oldest has not completed: nothing is trimmed
    assert len(fake_trims) == 3 and [p.nbytes for p in forms] == [2 * 32 + 4 * 1024] * 2
    events[0].done = events[2].done = True
    fake_trims.poll()
    assert len(fake_trims) == 0 and fake_trims.ops.used == ["encode stream"] * 2
    for packed, exact in zip(forms, expected):
        assert type(packed.buffers) is OneBuffer and packed.buffers.data.numel() == packed.buffers.layout.total
        assert packed.nbytes == exact.nbytes < 1000
        assert_same_bits(packed.buffers["header"], exact.buffers["header"])
        assert_same_bits(packed.buffers["payload"], exact.buffers["payload"])
        with use_runner(runner):
            assert_same_bits(kernels.decode(packed), reference.decode(exact))


@pytest.mark.toolchain
@requires_gxx
def test_the_steps_records_follow_the_trims(runner, fake_trims):
    """The engine records a form's reservation at encode and its trimmed size once the trim ran: after the
    backward (whose decodes poll the queue) the stats equal the torch path's byte for byte, not the raw size."""
    import lightning_act as act

    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 4))
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    stats = {}
    for backend in ("cupy", "torch"):
        with use_runner(runner):  # the emulator stands in for the GPU
            compressor = act.ActivationCompressor(model, act.ACTConfig(codec="lorenzo", error_bound=1e-2,
                                                                       backend=backend, min_numel=1024))
            with compressor.compress():
                loss = model(x).square().mean()
            for event in fake_trims.ops.recorded():
                event.done = True
            loss.backward()
        stats[backend] = compressor.stats()
    assert len(fake_trims) == 0 and len(fake_trims.ops.recorded()) == 3  # the input and the two Tanh outputs
    trimmed, torch_path = ([(r.shape, r.stored_bytes, r.bits) for r in stats[b].records if r.kind == "compressed"]
                           for b in ("cupy", "torch"))
    assert trimmed == torch_path and len(trimmed) == 3
    assert stats["cupy"].stored_bytes == stats["torch"].stored_bytes
    assert stats["cupy"].ratio > 2.0  # the reservation would read about 1.0


def test_trim_slots_and_events_are_reused(fake_trims):
    """Tracking allocates host slots (and events) a batch at a time and reuses each once its size was read: a
    thousand encodes, polled as they go, allocate once and record on few events (the kernels do not run: what is
    tracked is the host's bookkeeping, not the bytes)."""
    x = lorenzo_data("smooth", 100)
    ops = fake_trims.ops
    runner = RecordingRunner()
    with use_runner(runner):
        codec = LorenzoCodec(error_bound=1e-3, backend="cupy")
        for _ in range(1000):
            codec.encode(x)  # polls first: the previous encode's slot is free again
            for event in ops.recorded():
                event.done = True
    fake_trims.poll()
    assert ops.allocations == 1 and len(fake_trims) == 0
    assert len(ops.recorded()) <= 2 and sum(len(event.records) for event in ops.events) == 1000
    assert runner.kernels == ["lorenzo_encode"] * 1000


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
@pytest.mark.toolchain
@requires_gxx
def test_codec_runs_the_kernels_for_their_dtypes_and_torch_for_float64(runner, monkeypatch, dtype):
    """Encode and decode ask for the kernels with the tensor's dtype: float64 takes the torch path, whatever the
    backend (the emulator stands in for the GPU: backend="cupy" sends the CPU tensors to its kernels)."""
    runner.launches.clear()
    x = lorenzo_data("mixed", 500).to(dtype)
    with use_runner(runner):
        codec = LorenzoCodec(error_bound=1e-3, backend="cupy")
        decoded = codec.decode(codec.encode(x))
    kernels = dtype != torch.float64
    assert codec.kernels_take(dtype) is kernels
    assert {launch[0] for launch in runner.launches} == ({"lorenzo.cu"} if kernels else set())
    torch_codec = LorenzoCodec(error_bound=1e-3, backend="torch")
    assert_same_bits(decoded, torch_codec.decode(torch_codec.encode(x)))


def _tile_bytes(header: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Payload bytes of each tile of the kernels' scan, from the specification's block sizes."""
    sizes = block_sizes(header, itemsize)[0]
    tile_blocks = cuda_lorenzo.TILE_ELEMENTS // spec.BLOCK
    return torch.nn.functional.pad(sizes, (0, -sizes.numel() % tile_blocks)).view(-1, tile_blocks).sum(dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.toolchain
@requires_gxx
def test_scan_state_holds_every_tiles_inclusive_prefix(runner, dtype):
    """After an encode (and a decode) every tile's flag holds the payload bytes of it and the tiles before it, the
    first word the payload's size, the counter every tile claimed plus one failed claim per thread block."""
    x = torch.cat([lorenzo_data("mixed", 3000), _special("non_finite", torch.float32, 1e-2)]).to(dtype)[:3599]
    expected = lorenzo_encode_reference(x, 1e-2)
    plan = cuda_lorenzo._plan(x.numel(), dtype, launcher.MAX_BLOCKS)
    inclusive = _tile_bytes(expected["header"], x.element_size()).cumsum(0)
    assert plan.tiles == 4 and plan.grid == (4, 1, 1)
    encoded = OneBuffer(torch.empty(plan.layout.total, dtype=torch.uint8), plan.layout)
    scans = [cuda_lorenzo.new_scan(plan, x.device) for _ in range(2)]
    cuda_lorenzo.launch_encode(launcher.pointer(x), plan, cuda_lorenzo.bound_scalars(1e-2), *encoded.pointers(),
                               scans[0], runner, x.device)
    decoded = torch.empty_like(x)
    cuda_lorenzo.launch_decode(*encoded.pointers(), plan, cuda_lorenzo.bound_scalars(1e-2)[1], decoded, scans[1],
                               runner, x.device)
    for scan in scans:
        assert scan[0] == expected["payload"].numel() == inclusive[-1]
        assert scan[1] == plan.tiles + plan.grid[0]
        assert torch.equal(scan[2:], inclusive | cuda_lorenzo.SCAN_PREFIX)
    assert_same_bits(encoded["header"], expected["header"])
    assert_same_bits(decoded, spec.lorenzo_decode_reference(expected, x.numel(), 1e-2, dtype))


# Flags of the tiles before the first one the emulator runs, as blocks still at work would have left them: the
# look-back sums aggregates across windows of 32 tiles until the nearest inclusive prefix.
LOOK_BACK_CASES = {
    "only tile 0 holds its prefix": [],
    "the nearest tile holds its prefix": [-1],
    "a prefix mid-window": [-10, -20],
    "a prefix at a window's last lane": [-32],
    "a prefix at the next window's first lane": [-33],
}


@pytest.mark.parametrize("case", LOOK_BACK_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.toolchain
@requires_gxx
def test_look_back_sums_the_flags_of_tiles_other_blocks_hold(runner, dtype, case):
    """The emulator runs thread blocks one after another, so each tile finds its predecessor's prefix: here the
    scan state is seeded with the first 40 tiles claimed, their flags holding aggregates (and prefixes where the
    case says), and the kernels run the last 2 tiles. Their headers, payload bytes, decoded values and flags must
    be the specification's."""
    claimed = 40
    n = (claimed + 2) * cuda_lorenzo.TILE_ELEMENTS - 100
    x = lorenzo_data("mixed", n).to(dtype)
    expected = lorenzo_encode_reference(x, 1e-2)
    plan = cuda_lorenzo._plan(n, dtype, launcher.MAX_BLOCKS)
    tile_bytes = _tile_bytes(expected["header"], x.element_size())
    inclusive = tile_bytes.cumsum(0)
    seeded = tile_bytes[:claimed] | cuda_lorenzo.SCAN_AGGREGATE
    for tile in [0] + [claimed + t for t in LOOK_BACK_CASES[case]]:
        seeded[tile] = inclusive[tile] | cuda_lorenzo.SCAN_PREFIX

    def scan_state():
        scan = cuda_lorenzo.new_scan(plan, x.device)
        scan[1], scan[2:2 + claimed] = claimed, seeded
        return scan

    encoded = OneBuffer(torch.zeros(plan.layout.total, dtype=torch.uint8), plan.layout)
    scans = [scan_state(), scan_state()]
    cuda_lorenzo.launch_encode(launcher.pointer(x), plan, cuda_lorenzo.bound_scalars(1e-2), *encoded.pointers(),
                               scans[0], runner, x.device)
    first_block, first_byte = claimed * cuda_lorenzo.TILE_ELEMENTS // spec.BLOCK, int(inclusive[claimed - 1])
    assert_same_bits(encoded["header"][first_block:], expected["header"][first_block:])
    assert_same_bits(encoded["payload"][first_byte:inclusive[-1]], expected["payload"][first_byte:])
    assert torch.all(encoded["payload"][:first_byte] == 0)  # the claimed tiles' bytes: not the emulator's to write
    decoded = torch.zeros_like(x)
    cuda_lorenzo.launch_decode(launcher.pointer(expected["header"]), launcher.pointer(expected["payload"]), plan,
                               cuda_lorenzo.bound_scalars(1e-2)[1], decoded, scans[1], runner, x.device)
    first = claimed * cuda_lorenzo.TILE_ELEMENTS
    assert_same_bits(decoded[first:], spec.lorenzo_decode_reference(expected, n, 1e-2, dtype)[first:])
    assert torch.all(decoded[:first] == 0)
    for scan in scans:
        assert scan[0] == inclusive[-1]
        assert torch.equal(scan[2:2 + claimed], seeded)  # other tiles' flags are only read
        assert torch.equal(scan[2 + claimed:], inclusive[claimed:] | cuda_lorenzo.SCAN_PREFIX)


@pytest.mark.toolchain
@requires_gxx
def test_chunked_reference_equals_the_unchunked_kernels(runner, monkeypatch):
    """The reference encodes and decodes chunk by chunk (CHUNK_ELEMENTS, a multiple of the block); the kernels
    run over the whole tensor: block offsets and payloads must agree across chunk borders."""
    monkeypatch.setattr(spec, "CHUNK_ELEMENTS", 2 * spec.BLOCK)
    assert len(spec._split_chunks(700)) == 11
    for x in (_special("non_finite", torch.float16, 1e-2), lorenzo_data("mixed", 700)):
        check_lorenzo(runner, x, 1e-2)


@pytest.mark.toolchain
@requires_gxx
def test_header_only_tensors_have_an_empty_payload(runner):
    """All codes zero and nothing escaping (zeros and |x| <= eb): a payload of 0 bytes; the kernels still run (the
    host never learns that the payload is empty)."""
    eb = working_bound(1e-2)[0]
    x = torch.tensor([0.0, -0.0, eb, -eb, eb / 2] * 20, dtype=torch.float32)
    runner.launches.clear()
    encoded = check_lorenzo(runner, x, 1e-2)
    assert encoded["payload"].numel() == 0
    assert [launch[1] for launch in runner.launches] == ["lorenzo_encode", "lorenzo_decode"]


def test_empty_tensor_launches_nothing():
    runner = EmulatorRunner()
    encoded, payload_bytes = lorenzo_encode_cuda(torch.empty(0, dtype=torch.float16), 1e-2, runner=runner)
    expected = lorenzo_encode_reference(torch.empty(0, dtype=torch.float16), 1e-2)
    assert {k: (v.dtype, v.numel()) for k, v in encoded.items()} == {k: (v.dtype, v.numel())
                                                                     for k, v in expected.items()}
    assert payload_bytes.tolist() == [0]
    assert lorenzo_decode_cuda(encoded, 0, 1e-2, torch.float16, runner=runner).numel() == 0
    assert runner.launches == []


def _buffers(**changes):
    buffers = lorenzo_encode_reference(torch.linspace(0, 1, 64), 1e-2)
    return {**buffers, **changes}


@pytest.mark.parametrize("call, match", [
    (lambda r: lorenzo_encode_cuda(torch.randn(8, 4).t().reshape(-1)[::2], 1e-2, runner=r),
     r"flat must be contiguous; got strides \(2,\)"),
    (lambda r: lorenzo_encode_cuda(torch.randn(8, dtype=torch.float64), 1e-2, runner=r),
     r"flat must have dtype in \(torch.float32, torch.float16, torch.bfloat16\); got torch.float64"),
    (lambda r: lorenzo_encode_cuda(torch.randn(2, 8), 1e-2, runner=r), r"flat must be 1-dimensional; got shape \(2, 8\)"),
    (lambda r: lorenzo_encode_cuda(torch.randn(8, device="meta"), 1e-2, runner=r),
     r"tensors must be on a cpu device for EmulatorRunner; got meta"),
    (lambda r: lorenzo_decode_cuda(_buffers(), 65, 1e-2, torch.float32, runner=r), r"header must have 3 elements; got 2"),
    (lambda r: lorenzo_decode_cuda(_buffers(payload=torch.zeros(257, dtype=torch.uint8)), 64, 1e-2,
                                   torch.float32, runner=r),
     r"payload must have at most 256 elements for 64 values of torch.float32; got 257"),
    (lambda r: lorenzo_decode_cuda(_buffers(payload=torch.zeros(8, dtype=torch.int32)), 64, 1e-2,
                                   torch.float32, runner=r),
     r"payload must have dtype in \(torch.uint8\); got torch.int32"),
    (lambda r: lorenzo_decode_cuda(_buffers(), 64, 1e-2, torch.int32, runner=r),
     r"dtype=torch.int32; expected one of torch.float32, torch.float16, torch.bfloat16"),
])
def test_bad_arguments_are_refused_before_launch(call, match):
    assert_refused_before_launch(call, match)


def test_config_passes_the_backend_and_bad_backends_are_named():
    import lightning_act as act

    codec = act.codecs.get("lorenzo", **act.ACTConfig(codec="lorenzo", error_bound=1e-3, backend="torch").codec_kwargs())
    assert (codec.backend, codec.error_bound) == ("torch", 1e-3)
    with pytest.raises(ValueError, match="backend='gpu'"):
        LorenzoCodec(error_bound=1e-3, backend="gpu")


def test_codec_kernel_path_allocates_its_form_once():
    """Encode on the kernel path: the form in one allocation (a OneBuffer of header and payload), the zeroed scan
    state, one launch; decode: the output, the scan state, one launch. Nothing else: no view, no copy, no check."""
    runner = RecordingRunner()
    x = torch.randn(3, 100)
    with use_runner(runner):
        codec = LorenzoCodec(error_bound=1e-2, backend="cupy")
        with recorded_ops() as encode:
            packed = codec.encode(x)
        with recorded_ops() as decode:
            out = codec.decode(packed)
    assert encode.ops == decode.ops == ["empty.memory_format", "zeros.default"]
    assert runner.kernels == ["lorenzo_encode", "lorenzo_decode"]
    assert type(packed.buffers) is OneBuffer and (out.shape, out.dtype) == (x.shape, x.dtype)
    assert packed.nbytes == 2 * 10 + 4 * 320


def test_plans_are_built_once_per_size_and_dtype():
    cuda_lorenzo._plan.cache_clear()
    with use_runner(RecordingRunner()):
        codec = LorenzoCodec(error_bound=1e-2, backend="cupy")
        for _ in range(3):
            codec.decode(codec.encode(torch.randn(300)))
        assert cuda_lorenzo._plan.cache_info()[:2] == (5, 1)  # (hits, misses)
        codec.decode(codec.encode(torch.randn(300, dtype=torch.float16)))
    assert cuda_lorenzo._plan.cache_info()[:2] == (6, 2)


def test_changing_the_bound_rebuilds_the_kernels_scalars():
    codec = LorenzoCodec(error_bound=1e-2)
    codec.error_bound = 1e-3
    assert codec.error_bound == 1e-3 and codec._bound == tuple(np.float32(v) for v in working_bound(1e-3))
    with pytest.raises(ValueError, match=r"error_bound=-1"):
        codec.error_bound = -1
    assert codec.error_bound == 1e-3
