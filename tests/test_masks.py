"""Lossless masks: ReLU signs, dropout noise and max-pool indices, on their own and chosen by the saving op."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_act as act
from lightning_act.codecs import op_rules
from lightning_act.formats._bitpack import pack_bits, pack_codes, packed_nbytes, unpack_bits, unpack_codes
from lightning_act.stats import COMPRESSED
from tests.host_path import recorded_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(), (1,), (13,), (3, 5, 7), (2, 3, 9, 10)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(0,)])
def test_positive_mask_keeps_the_sign_pattern_in_one_bit(shape, dtype):
    x = torch.randn(shape).to(dtype)
    if x.numel() > 2:
        x.view(-1)[:3] = torch.tensor([0.0, -0.0, float("nan")])  # none of them positive
    codec = act.codecs.get("positive_mask")
    packed = codec.encode(x)
    y = codec.decode(packed)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, (x > 0).to(dtype))
    assert packed.nbytes == math.ceil(x.numel() / 8)


def test_positive_mask_of_a_non_contiguous_tensor():
    x = torch.randn(6, 5).t()
    codec = act.codecs.get("positive_mask")
    assert torch.equal(codec.decode(codec.encode(x)), (x > 0).float())


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_scaled_mask_stores_dropout_noise_exactly(shape, p, dtype, check):
    torch.manual_seed(0)
    noise = torch.empty(shape, dtype=dtype).bernoulli_(1 - p)
    if p < 1:
        noise.div_(1 - p)
    codec = act.codecs.get("scaled_mask", check=check)
    packed = codec.encode(noise)
    assert torch.equal(codec.decode(packed), noise)
    assert packed.nbytes == math.ceil(noise.numel() / 8) + noise.element_size()


def test_scaled_mask_of_an_empty_tensor():
    codec = act.codecs.get("scaled_mask")
    y = codec.decode(codec.encode(torch.empty(0, 4)))
    assert y.shape == (0, 4)


def test_scaled_mask_refuses_several_values():
    with pytest.raises(ValueError, match=r"non-zero elements all equal one value; got a tensor of shape \[3\]"):
        act.codecs.get("scaled_mask").encode(torch.tensor([0.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"check='no'; expected True or False"):
        act.codecs.get("scaled_mask", check="no")


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 64, 1001])
@pytest.mark.parametrize("offset", [0, 3])
def test_pack_bits_matches_pack_codes(numel, offset):
    """The word-arithmetic 1-bit packing the mask codecs use stores pack_codes' layout, from any storage offset."""
    torch.manual_seed(numel)
    flags = (torch.rand(numel + offset) > 0.5)[offset:]
    packed = pack_bits(flags)
    assert torch.equal(packed, pack_codes(flags.view(torch.uint8).contiguous(), 1))
    assert torch.equal(unpack_bits(packed, numel), flags)
    assert unpack_bits(packed, numel).dtype == torch.bool


def test_pack_bits_covers_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8)
    flags = unpack_codes(every_byte, 1, 2048)
    assert torch.equal(pack_bits(flags), every_byte)
    assert torch.equal(unpack_bits(every_byte, 2048).view(torch.uint8), flags)


@pytest.mark.parametrize("name", ["positive_mask", "scaled_mask"])
def test_masks_refuse_integer_tensors(name):
    with pytest.raises(ValueError, match=rf"{name} codec takes floating-point tensors; got dtype=torch.int64"):
        act.codecs.get(name).encode(torch.arange(4))


POOLS = [  # (pool function, input shape, pooling arguments, bits per index)
    (F.max_pool1d, (2, 3, 20), dict(kernel_size=4, stride=3, padding=1), 2),
    (F.max_pool1d, (3, 21), dict(kernel_size=5, stride=2, dilation=2, ceil_mode=True), 3),
    (F.max_pool2d, (2, 3, 11, 13), dict(kernel_size=3, stride=2, padding=1), 4),
    (F.max_pool2d, (2, 3, 11, 13), dict(kernel_size=2), 1 + 1),
    (F.max_pool2d, (1, 2, 10, 9), dict(kernel_size=(3, 2), stride=(1, 2), dilation=(2, 1), ceil_mode=True), 3),
    (F.max_pool2d, (2, 5, 7), dict(kernel_size=1), 0),
    (F.max_pool3d, (2, 3, 4, 6, 7), dict(kernel_size=3, stride=2, padding=1), 5),
    (F.max_pool3d, (1, 2, 5, 5, 5), dict(kernel_size=(1, 2, 3), stride=(1, 2, 2), ceil_mode=True), 3),
    (F.max_pool3d, (1, 2, 5, 9, 10), dict(kernel_size=(4, 8, 9)), 9),  # offsets past a byte: int32 bit-planes
]


@pytest.mark.parametrize("pool,shape,args,bits", POOLS)
def test_maxpool_index_round_trips_exactly_in_the_fewest_bits(pool, shape, args, bits):
    nd = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3}[pool]
    _, index = pool(torch.randn(shape), return_indices=True, **args)
    codec = act.codecs.get("maxpool_index", input_size=shape[-nd:], **args)
    packed = codec.encode(index)
    assert codec.bits == bits == codec.bits_per_element(index)
    assert packed.nbytes == bits * math.ceil(index.numel() / 8)
    decoded = codec.decode(packed)
    assert decoded.dtype == torch.int64 and torch.equal(decoded, index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "cl"])
def test_maxpool_index_round_trips_over_many_chunks_in_every_layout(monkeypatch, dtype, memory_format):
    """Chunks of a few planes (the last one partial): each chunk's bit-planes are packed and unpacked at its own
    byte offset; the indices of a channels_last input are read plane by plane."""
    from lightning_act.codecs import masks

    monkeypatch.setattr(masks, "chunk_elements", lambda device: 8 * 3 * 25)  # 3 planes of 5 x 5 per chunk
    x = torch.randn(2, 5, 10, 11, dtype=dtype).to(memory_format=memory_format)
    _, index = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    codec = act.codecs.get("maxpool_index", kernel_size=3, stride=2, padding=1, input_size=(10, 11))
    assert codec._planes_per_chunk(index.device) * math.prod(codec.output_size) < index.numel()
    assert torch.equal(codec.decode(codec.encode(index)), index)


def test_maxpool_index_runs_few_ops_on_a_gpu_sized_tensor():
    """ResNet-50's max-pool indices at batch 128 (128 x 64 x 56 x 56) on a device other than the CPU (``meta``
    stands in: its chunks are a GPU's), each op a kernel launch the host waits on there: the encode ran 3866 ATen
    ops and the decode 5563 (140 ms of an H100 host's time a step) before the bit-planes of a chunk were packed
    in one pass and the chunks grew; 481 and 555 now."""
    codec = act.codecs.get("maxpool_index", kernel_size=3, stride=2, padding=1, input_size=(112, 112), check=False)
    x = torch.empty(128, 64, 56, 56, dtype=torch.int64, device="meta")
    with recorded_ops() as encode:
        packed = codec.encode(x)
    with recorded_ops() as decode:
        out = codec.decode(packed)
    assert packed.buffers["planes"].shape == (4, packed_nbytes(x.numel(), 1)) and out.shape == x.shape
    assert len(encode.ops) <= 600 and len(decode.ops) <= 700, (len(encode.ops), len(decode.ops))


@pytest.mark.parametrize("options,match", [
    (dict(kernel_size=0, input_size=(8, 8)), r"kernel_size=0; expected an integer >= 1 or 2 of them"),
    (dict(kernel_size=(2, 2, 2), input_size=(8, 8)), r"kernel_size=\(2, 2, 2\); expected an integer >= 1 or 2"),
    (dict(kernel_size="2", input_size=(8, 8)), r"kernel_size='2'; expected an integer >= 1 or 2 of them"),
    (dict(kernel_size=2, input_size=(8, 8), padding=-1), r"padding=-1; expected an integer >= 0 or 2 of them"),
    (dict(kernel_size=2, input_size=(8, 8), stride=0), r"stride=0; expected an integer >= 1 or 2 of them"),
    (dict(kernel_size=2, input_size=(2, 2, 2, 2)), r"input_size=\(2, 2, 2, 2\); expected 1, 2 or 3 spatial sizes"),
    (dict(kernel_size=2, input_size=(8, 0)), r"input_size=\(8, 0\); expected an integer >= 1 or 2 of them"),
    (dict(kernel_size=2, input_size=(8, 8), ceil_mode=1), r"ceil_mode=1; expected one of False, True"),
    (dict(kernel_size=5, input_size=(3, 3)), r"give no output for input_size=\(3, 3\)"),
])
def test_maxpool_index_bad_options_raise(options, match):
    with pytest.raises(ValueError, match=match):
        act.codecs.get("maxpool_index", **options)


def test_maxpool_index_refuses_indices_outside_their_window_and_wrong_tensors():
    codec = act.codecs.get("maxpool_index", kernel_size=2, input_size=(4, 4))
    _, index = F.max_pool2d(torch.randn(1, 1, 4, 4), 2, return_indices=True)
    index[0, 0, 1, 1] = 0  # the top-left window's element, not the bottom-right one's
    with pytest.raises(ValueError, match=r"an index lies outside its pooling window \(kernel_size=\(2, 2\)"):
        codec.encode(index)
    with pytest.raises(ValueError, match=r"int64 tensors of whole \[2, 2\] output planes; got dtype=torch.int32"):
        codec.encode(index.int())
    with pytest.raises(ValueError, match=r"got dtype=torch.int64 with 3 elements"):
        codec.encode(index.view(-1)[:3])


# ---- chosen by the op that saves the tensor ---------------------------------------------------------------
def test_rules_are_registered_for_relu_dropout_and_max_pool():
    for fn in (F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_, F.leaky_relu, F.dropout,
               F.max_pool1d, F.max_pool2d, F.max_pool3d, F.max_pool2d_with_indices, torch.max_pool2d):
        assert fn in op_rules.OP_RULES


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1),
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(16 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))


def _train_step(masks: bool | None, x: torch.Tensor):
    """Parameter gradients of one step (``masks=None``: no compressor) and the step's stats."""
    model = _cnn()
    torch.manual_seed(1)  # same dropout draws in every run
    stats = None
    if masks is None:
        model(x).square().sum().backward()
    else:
        # values kept exact (32 bits) so that only the masks differ between the runs
        config = act.ACTConfig(codec="quantize", bits=32, compress_masks=masks, min_numel=0)
        compressor = act.ActivationCompressor(model, config)
        with compressor.compress():
            loss = model(x).square().sum()
        loss.backward()
        stats = compressor.stats()
    return [p.grad for p in model.parameters()], stats


def test_relu_cnn_gradients_are_bit_identical_with_masks_on_and_off():
    x = torch.randn(16, 1, 32, 32)
    exact, _ = _train_step(None, x)
    off_grads, off = _train_step(False, x)
    on_grads, on = _train_step(True, x)
    assert all(torch.equal(a, b) for a, b in zip(exact, off_grads))
    assert all(torch.equal(a, b) for a, b in zip(exact, on_grads))
    codecs = {r.codec for r in on.records if r.kind == COMPRESSED}
    assert {"positive_mask", "maxpool_index", "scaled_mask"} <= codecs
    # int64 indices (8 bytes) -> 2 and 4 bits, float dropout noise -> 1 bit: stored bytes drop by over a third
    assert on.stored_bytes < 0.75 * off.stored_bytes


@pytest.mark.parametrize("relu", [
    nn.ReLU(), nn.ReLU(inplace=True), F.relu, lambda t: torch.relu(t), lambda t: t.relu(), lambda t: t.relu_(),
    lambda t: F.leaky_relu(t, 0.1), lambda t: F.leaky_relu(t, 0.1, inplace=True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_relu_spelling_stores_a_mask_and_the_next_layer_keeps_its_values(relu, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)).to(dtype)
    x = torch.randn(128, 32, dtype=dtype)

    def step(compress: bool):
        model.zero_grad()
        compressor = act.ActivationCompressor(model, act.ACTConfig(codec="quantize", bits=32, min_numel=0))
        with compressor.compress() if compress else torch.enable_grad():
            loss = model[1](relu(model[0](x))).float().square().sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], compressor.stats()

    exact, _ = step(False)
    grads, stats = step(True)
    assert all(torch.equal(a, b) for a, b in zip(exact, grads))  # Linear 2's weight gradient needs the values
    saved = [(r.codec, r.shape) for r in stats.records if r.kind == COMPRESSED]
    assert ("positive_mask", (128, 64)) in saved and ("quantize", (128, 64)) in saved


@pytest.mark.parametrize("call", [
    lambda t: F.max_pool1d(t.flatten(2), 3, 2, 1),
    lambda t: F.max_pool2d(t, 3, 2, 1, ceil_mode=True),
    lambda t: F.max_pool2d(t, 2, return_indices=True)[0],
    lambda t: torch.max_pool2d(t, [2, 2]),
    lambda t: F.max_pool3d(t.unsqueeze(1), (2, 3, 3), (1, 2, 2)),
])
def test_max_pool_spellings_store_packed_indices_with_exact_gradients(call):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 15, 15, requires_grad=True)
    weight = torch.randn(4, 4, 1, 1)
    call(F.conv2d(x, weight)).square().sum().backward()
    exact, x.grad = x.grad, None
    compressor = act.ActivationCompressor(None, act.ACTConfig(codec="quantize", bits=32, min_numel=0))
    with compressor.compress():
        loss = call(F.conv2d(x, weight)).square().sum()
    loss.backward()
    assert torch.equal(x.grad, exact)
    assert any(r.codec == "maxpool_index" for r in compressor.stats().records)


def test_masks_off_leaves_indices_and_relu_outputs_to_the_default_policy():
    _, stats = _train_step(False, torch.randn(4, 1, 32, 32))
    assert not {"positive_mask", "maxpool_index", "scaled_mask"} & {r.codec for r in stats.records}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [2.5, -2.5])  # a negative value is not the maximum: the fallback finds it
def test_scaled_mask_of_channels_last_noise_and_of_a_negative_value(dtype, scale):
    torch.manual_seed(0)
    noise = (torch.rand(2, 3, 4, 5, dtype=dtype) < 0.6).to(dtype).mul_(scale)
    noise = noise.contiguous(memory_format=torch.channels_last)
    codec = act.codecs.get("scaled_mask")
    decoded = codec.decode(codec.encode(noise))
    assert torch.equal(decoded, noise) and decoded.dtype == dtype


# ---- what scaled_dot_product_attention saves besides q, k, v ----------------------------------------------------
def _sdpa_grads(compressor, q, k, v, mask, dropout_p):
    torch.manual_seed(0)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if compressor is None:
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, dropout_p=dropout_p)
    else:
        with compressor.compress():
            out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, dropout_p=dropout_p)
    out.backward(torch.ones_like(out))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("config", [dict(bits=8, adaptive=False), dict(codec="division", compress_masks=False)],
                         ids=["8-bit", "division, masks off"])
def test_sdpa_padding_mask_and_dropout_noise_are_stored_losslessly(dropout_p, config):
    """CPU SDPA saves a padding mask as a float tensor holding -inf (flash path) and its dropout noise (math path):
    quantized, a group holding -inf decodes to NaN (the format's rule), which made every gradient NaN. The rule
    keeps gradients right, so it applies with ``compress_masks=False`` too (a padded GPT-2 under DIVISION trained on
    NaN there)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 64, 16) for _ in range(3))
    mask = torch.ones(4, 1, 64, 64, dtype=torch.bool)
    mask[0, ..., 40:] = False
    compressor = act.ActivationCompressor(None, act.ACTConfig(**config))
    grads = _sdpa_grads(compressor, q, k, v, mask, dropout_p)
    assert all(torch.isfinite(g).all() for g in grads)
    exact = _sdpa_grads(None, q, k, v, mask, dropout_p)
    for g, e in zip(grads, exact):  # (DIVISION's own error on the attention's saved probabilities: 0.37-0.95)
        assert F.cosine_similarity(g.flatten(), e.flatten(), dim=0) > (0.99 if "bits" in config else 0.3)
    records = [r for r in compressor.stats().records if r.kind == COMPRESSED]
    assert any(r.codec == "scaled_mask" and r.bits == 1.0 and tuple(r.shape[-2:]) == (64, 64) for r in records)
    # the flash path's log-sum-exp (batch, heads, queries) is not scores-shaped: kept exact, no host read
    assert all(r.codec == "none" for r in records if tuple(r.shape) == (4, 2, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_log_sum_exp_is_kept_exact(dtype):
    """The backward recomputes the probabilities as exp(scores - lse): an error d in the log-sum-exp scales a
    row by e^-d. Quantized at 4 bits it took the gradients of q and k to cosine 0.66 and 0.72 here; kept exact
    (a 1 / keys share of the scores), the attention output's 4 bits leave them above 0.85."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 64, 16, dtype=dtype) * scale for scale in (3, 3, 1))  # peaked rows: lse spread
    mask = torch.ones(4, 1, 64, 64, dtype=torch.bool)
    mask[0, ..., 40:] = False
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=4, adaptive=False, min_numel=256))
    grads = _sdpa_grads(compressor, q, k, v, mask, 0.0)
    for g, e in zip(grads, _sdpa_grads(None, q, k, v, mask, 0.0)):
        assert F.cosine_similarity(g.flatten(), e.flatten(), dim=0) > 0.85
    lse = [r for r in compressor.stats().records if tuple(r.shape) == (4, 2, 64)]
    assert lse and all((r.codec, r.stored_bytes) == ("none", r.original_bytes) for r in lse)


def test_sdpa_float_mask_of_several_values_is_kept_exactly():
    """An additive float mask of several values (a position bias) that SDPA saves is not one value: kept raw."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 16) for _ in range(3))
    bias = torch.randn(2, 1, 32, 32)
    bias[0, ..., 20:] = float("-inf")
    compressor = act.ActivationCompressor(None, act.ACTConfig(bits=8, adaptive=False))
    grads = _sdpa_grads(compressor, q, k, v, bias, 0.0)
    assert all(torch.isfinite(g).all() for g in grads)
    for g, e in zip(grads, _sdpa_grads(None, q, k, v, bias, 0.0)):
        assert F.cosine_similarity(g.flatten(), e.flatten(), dim=0) > 0.99


def test_sdpa_scores_shaped_tensors_off_cpu_are_kept_raw_without_a_host_read():
    """Off CPU (CUDA's math fallback) the one-value check would wait for the device: a scores-shaped tensor SDPA
    saves is kept as it is there (exact, no check); on CPU it goes to the checked 1-bit codec; the log-sum-exp
    is kept as it is everywhere."""
    from lightning_act.codecs import op_rules

    def rule(device):
        q, k = (torch.empty(2, 4, 16, 8, device=device) for _ in range(2))
        call = op_rules.FunctionCall(F.scaled_dot_product_attention, (q, k, k), {})
        scores, lse = torch.empty(2, 4, 16, 16, device=device), torch.empty(2, 4, 16, device=device)
        return op_rules.codec_for_call(call, scores), op_rules.codec_for_call(call, lse)

    (on_cpu, cpu_lse), (off_cpu, meta_lse) = rule("cpu"), rule("meta")
    assert (on_cpu.name, on_cpu.check, on_cpu.strict) == ("scaled_mask", True, False)
    assert off_cpu.name == "none" and cpu_lse.name == "none" and meta_lse.name == "none"


def test_scaled_mask_not_strict_keeps_several_values_raw():
    codec = act.codecs.get("scaled_mask", strict=False)
    x = torch.tensor([0.0, 2.0, 3.0, float("-inf")])
    packed = codec.encode(x)
    assert torch.equal(codec.decode(packed), x) and packed.nbytes == x.numel() * 4
    assert codec.bits_per_element(x, packed) == 32.0


def test_op_rules_skip_the_verification_their_op_guarantees():
    """Dropout noise and max-pool argmax are what their masks assume by construction: the rules' codecs skip the
    verification passes, whose result a CUDA device would have to send to the host."""
    x = torch.randn(2, 3, 8, 8)
    _, indices = F.max_pool2d(x, 2, return_indices=True)
    pool_call = op_rules.FunctionCall(F.max_pool2d, (x, 2), {"return_indices": True})
    assert op_rules.codec_for_call(pool_call, indices).check is False
    noise = torch.ones(4, 4)
    drop_call = op_rules.FunctionCall(F.dropout, (noise,), {})
    assert op_rules.codec_for_call(drop_call, noise).check is False
    with pytest.raises(ValueError, match=r"check=1; expected True or False"):
        act.codecs.get("maxpool_index", kernel_size=2, input_size=(8, 8), check=1)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("chunks", [1, 3], ids=["one chunk", "several chunks"])
def test_positive_mask_and_bitmask_round_trip_every_layout_and_float64(dtype, memory_format, chunks):
    """The 1-bit codecs on a tensor of one chunk (the fast path) and of several, channels_last or not, float64
    included."""
    from lightning_act.formats.quantize import chunk_elements

    torch.manual_seed(0)
    # several chunks with a ragged last one, or one chunk whose element count is not a multiple of 8
    channels = (chunks - 1) * chunk_elements(torch.device("cpu")) // (9 * 10) + 3
    x = torch.randn(1, channels, 9, 10).to(dtype).contiguous(memory_format=memory_format)
    positive = act.codecs.get("positive_mask")
    assert torch.equal(positive.decode(positive.encode(x)), (x > 0).to(dtype))
    bitmask = act.codecs.get("bitmask")
    mask = x > 0
    assert torch.equal(bitmask.decode(bitmask.encode(mask)), mask)


@pytest.mark.parametrize("chunks", [1, 3], ids=["one chunk", "several chunks"])
def test_checked_scaled_mask_decides_alike_on_one_chunk_and_several(chunks):
    """The one-chunk fast path (one comparison) and the chunked one (a device flag per chunk) take the same
    tensors: all zeros and a 0/-inf additive mask at 1 bit; several values, or a NaN, raw (strict=False)."""
    from lightning_act.formats.quantize import chunk_elements

    n = (chunks - 1) * chunk_elements(torch.device("cpu")) + 13
    codec = act.codecs.get("scaled_mask", strict=False)
    additive = torch.zeros(n)
    additive[1::3] = float("-inf")
    several = additive.clone()
    several[-1] = 2.0
    with_nan = torch.zeros(n)
    with_nan[[2, -2]] = float("nan")
    for x, stored_raw in ((torch.zeros(n), False), (additive, False), (several, True), (with_nan, True)):
        packed = codec.encode(x)
        assert ("raw" in packed.buffers) == stored_raw
        torch.testing.assert_close(codec.decode(packed), x, rtol=0, atol=0, equal_nan=True)
        assert packed.nbytes == (4 * n if stored_raw else math.ceil(n / 8) + 4)
