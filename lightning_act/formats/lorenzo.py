"""Error-bounded Lorenzo format with zero preservation, the specification for the CUDA kernels in
``lightning_act/cuda/lorenzo.cu`` (bit for bit; ``backend="auto"`` runs them on CUDA tensors when CuPy imports).

Strict guarantee, for every finite input element ``x`` of a float32/bfloat16/float16/float64 tensor and its
decode ``y`` (same dtype): ``|x - y| <= error_bound`` exactly (the real-number difference, not a rounded one);
``|x| <= eb`` (below) decodes to exactly 0, which for 16/32-bit inputs is every ``|x| <= error_bound``; NaN and
+-Inf come back bit for bit (NaN payloads included: they are escapes, stored raw, never computed with).
cuSZ/cuSZp/FZ-GPU accept 1.01-1.1x the bound; here every reconstruction is verified at encode time and a block
holding an escape is stored raw.

Constants, computed once on the host in float32: ``eb`` = the largest float32 <= ``error_bound``,
``step = 2 * eb``, ``inv = 1 / step`` (each one IEEE float32 operation), ``TMAX = 2**29`` (so |codes| <= 2**29 + 1 and
Lorenzo deltas stay below 2**31: no int32 overflow for any input).

Encode, per element (every float operation is one IEEE operation, round to nearest even, no fused multiply-add;
``r(q) = dtype(float32(q) * step)``, the decode of code ``q`` rounded into the input dtype, exact for float64):

    x32 = float32(x)                 (a float64 input rounded to nearest even; the others exactly)
    xc  = x for a float64 input, else x32: the checks below are made on x itself, in xc's precision
    |xc| <= eb                       -> q = 0                                (zero preservation)
    t = x32 * inv;  !(|t| < TMAX)    -> escape                               (NaN, Inf, out of range)
    q0 = rint(t)                     (ties to even)
    ok(q) := |xc - r(q)| < eb        (strict: a rounded difference below eb proves the exact one is)
    ok(q0) -> q0;  else q1 = q0 + (xc > r(q0) ? 1 : -1);  ok(q1) -> q1;  else escape
    escape -> code 0, and its block is stored verbatim (mode 3 below)

The grid (``eb``, ``step``, ``inv``, ``t``) is float32 for every dtype; only the checks of a float64 input are
float64, so its bound holds for x itself, not for float32(x).

Blocks of 32 consecutive codes of the flattened tensor (the last is zero-padded) are stored independently
(so a GPU decodes them in parallel). Each block stores values ``v`` in one of four modes, the cheapest,
ties to the lower mode number; a block holding an escape is always verbatim:

    mode 0  raw codes   v[i] = q[i]
    mode 1  Lorenzo     v[0] = 0, v[i] = q[i] - q[i-1]             (1D prediction along the contiguous dim;
                        q[0], the lead value, is stored in the fewest bytes f = 1..4 of two's complement)
    mode 2  sparse      the nonzero codes only (ReLU-heavy blocks)
    mode 3  verbatim    the 32 input values themselves, |xc| <= eb set to +0.0 (padding lanes 0): blocks with
                        an escape, and blocks whose codes cost more than their values (16-bit inputs, tiny bounds)

``w`` = bit length of max |v| (0..31), ``s`` = 1 if any v < 0.
Header: one uint16 per block, ``w | s << 5 | mode << 6 | k << 8 | (f - 1) << 14`` (k = nonzero codes in
sparse mode, f = lead-value bytes in Lorenzo mode, else both 0; w = s = 0 in verbatim mode).
Payload, 32-bit little-endian words where lane i is bit i:

    raw (mode 0):     [sign word if s] + w magnitude bit-planes      -> 4 * (w + s) bytes (0 if w = 0)
    Lorenzo (mode 1): f lead-value bytes, then as raw                -> f + 4 * (w + s) bytes
    sparse (mode 2):  nonzero-lane mask word + a bit stream where plane p (sign first if s, then magnitude
                      bits) of the j-th nonzero code is bit p * k + j  -> 4 + ceil(k * (w + s) / 8) bytes
    verbatim (mode 3): the 32 values' bytes, lane order, little-endian  -> 32 * itemsize bytes

2D prediction (independent 4 x 8 tiles, ``q - left - up + upleft``) was measured on conv activations and stores
3-4% more than these 1D blocks (``benchmarks/results/lorenzo_2d.md``), so it is not a mode.

Block payload sizes follow from the headers (and the dtype) alone; byte offsets are their exclusive prefix sum
(int64). No block stores more than its 32 values verbatim (32 codes of at most 30 bits and a sign word take
124 bytes, a float32 block 128), so a tensor's payload never exceeds ``reserved_payload_bytes``, the bytes of the
input padded to whole blocks: the CUDA encode writes into a buffer of that size without reading the actual size
on the host (:mod:`lightning_act.cuda.lorenzo`). With the headers, an incompressible tensor stores at most 2 bytes
per 32 elements more than its raw bytes (no escape list, no whole-tensor raw form).

Decode: codes from the payload (mode 1: inclusive prefix sum within the block), ``y = r(q)``; verbatim blocks
give their values' bits back. A zero code decodes to +0.0; ``r(q)`` of a stored code is never NaN.

This module is the specification, written to be read; :mod:`lightning_act.formats.lorenzo_fast` computes the same
bytes and bits in far fewer passes, and is what the codec runs off the kernels (``tests/test_lorenzo_fast.py``
compares them). Kernels: the CUDA kernels take float32/float16/bfloat16. A float64 tensor (rare: scientific
models) runs the torch path on any device and with every backend, ``backend="cupy"`` included: a saved tensor
never raises for its dtype.
"""
from __future__ import annotations

import numpy as np
import torch

from ._bitpack import pack_codes, unpack_codes

BLOCK = 32
TMAX = float(1 << 29)
MODE_RAW, MODE_LORENZO, MODE_SPARSE, MODE_VERBATIM = 0, 1, 2, 3
# Elements per torch chunk: bounds the bit-plane temporaries (a few bytes per element and plane).
CHUNK_ELEMENTS = 1 << 17


# Largest working bound: twice it is the largest finite float32, so the grid step never overflows (a larger
# bound would decode code 0 as 0 * inf = NaN); every finite float32 beyond it escapes and is stored raw.
MAX_WORKING_BOUND = float(np.finfo(np.float32).max) / 2


def working_bound(error_bound: float) -> tuple[float, float, float]:
    """``(eb, step, inv)``: the largest float32 <= ``error_bound`` (at most ``MAX_WORKING_BOUND``), ``2 * eb``
    and ``1 / step`` in float32."""
    eb = np.float32(min(error_bound, MAX_WORKING_BOUND))
    if float(eb) > error_bound:
        eb = np.nextafter(eb, np.float32(0))
    with np.errstate(over="ignore", divide="ignore"):
        step = eb * np.float32(2)
        inv = np.float32(1) / step
    return float(eb), float(step), float(inv)


def reserved_payload_bytes(numel: int, itemsize: int) -> int:
    """The most payload bytes a tensor of ``numel`` elements of ``itemsize`` bytes can store: every block
    verbatim."""
    return -(-numel // BLOCK) * BLOCK * itemsize


def _reconstruct(q: torch.Tensor, step: float, dtype: torch.dtype) -> torch.Tensor:
    """``dtype(float32(q) * step)``: the decode of int32 codes."""
    return (q.float() * step).to(dtype)


def checked_float(x: torch.Tensor) -> torch.Tensor:
    """``xc`` of the module's encode rules: ``x`` itself for float64, else float32 (exact for the other dtypes)."""
    return x if x.dtype == torch.float64 else x.float()


def prequantize(x: torch.Tensor, eb: float, step: float, inv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int32) and escape mask of a flat float tensor, following the module's encode rules."""
    xc = checked_float(x)
    t = x.float() * inv
    inside = t.abs() < TMAX  # False for NaN/Inf
    q0f = torch.where(inside, torch.round(t), 0.0)
    q0 = q0f.to(torch.int32)

    def error_ok(q):
        r = _reconstruct(q, step, x.dtype).to(xc.dtype)
        return (xc - r).abs() < eb, r

    ok0, r0 = error_ok(q0)
    q1 = q0 + torch.where(xc > r0, 1, -1).to(torch.int32)
    ok1, _ = error_ok(q1)
    zero = xc.abs() <= eb
    q = torch.where(ok0, q0, q1)
    escape = ~zero & ~(inside & (ok0 | ok1))
    q = torch.where(zero | escape, 0, q)
    return q.to(torch.int32), escape


def bit_length(mag: torch.Tensor) -> torch.Tensor:
    """Bit length of non-negative integers below 2**31 (0 for 0), exact through float64: the biased exponent of
    ``float64(mag)`` less 1022 (0 has exponent field 0)."""
    return (mag.double().view(torch.int64) >> 52).sub_(1022).clamp_(min=0)


def _planes(v: torch.Tensor, signed: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` bit planes (blocks, rows, 32 lanes) uint8 of int32 values: the sign plane first in
    ``signed`` blocks, then magnitude bits from the lowest."""
    row = torch.arange(rows, device=v.device, dtype=torch.int32)[None, :, None]
    s = signed.to(torch.int32)[:, None, None]
    magnitude_bits = (v.abs()[:, None, :] >> (row - s).clamp(min=0)) & 1
    sign_bits = (v < 0).to(torch.int32)[:, None, :]
    return torch.where((row == 0) & (s == 1), sign_bits, magnitude_bits).to(torch.uint8)


def _magnitudes(planes: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_planes`: int32 values (blocks, 32) from (blocks, rows, 32) planes."""
    row = torch.arange(planes.shape[1], device=planes.device, dtype=torch.int32)[None, :]
    s = signed.to(torch.int32)[:, None]
    weight = torch.where(row >= s, 1 << (row - s).clamp(min=0), 0)
    magnitude = (planes.to(torch.int32) * weight[:, :, None]).sum(dim=1, dtype=torch.int32)
    negative = (s == 1) & (planes[:, 0, :] == 1)
    return torch.where(negative, -magnitude, magnitude)


def _bytes_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """(blocks, n bits) uint8 -> (blocks, n / 8) bytes, bit i at bit i % 8 of byte i // 8."""
    return pack_codes(bits.reshape(-1), 1).view(bits.shape[0], -1)


def _bits_of_bytes(rows: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bytes_of_bits`."""
    return unpack_codes(rows.reshape(-1), 1, 8 * rows.numel()).view(rows.shape[0], -1)


def _sparse_positions(k: torch.Tensor, nonzero: torch.Tensor, rows: int) -> torch.Tensor:
    """Stream bit of plane p of the j-th nonzero lane: ``p * k + j`` as (blocks, rows, 32) int64."""
    rank = nonzero.cumsum(dim=1) - 1
    plane = torch.arange(rows, device=k.device)[None, :, None]
    return (plane * k[:, None, None] + rank[:, None, :]).clamp(min=0)


def lead_magnitude(first: torch.Tensor) -> torch.Tensor:
    """What the two's complement form of each int32 ``first`` must hold besides its sign: ``first``, or
    ``-(first + 1)`` (``~first``) for a negative one; its bytes are ``bit_length(...) // 8 + 1``."""
    return first ^ (first >> 31)


def _lead_bytes(first: torch.Tensor) -> torch.Tensor:
    """Bytes (1..4) of the shortest little-endian two's complement form of each int32 ``first``."""
    return bit_length(lead_magnitude(first)) // 8 + 1


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor zero-padded to whole blocks, as (blocks, 32)."""
    return torch.cat([t, t.new_zeros((-t.numel()) % BLOCK)]).view(-1, BLOCK)


def choose_modes(w_raw: torch.Tensor, s_raw: torch.Tensor, w_delta: torch.Tensor, s_delta: torch.Tensor,
                 k: torch.Tensor, lead: torch.Tensor, escaped: torch.Tensor | None, verbatim_bytes: int):
    """Each block's ``(sizes, mode, w, s, header)`` (int16 storage of the uint16 header) from its statistics:
    bit lengths and sign flags of its codes (raw) and deltas, nonzero count ``k``, lead-value bytes; ``escaped``
    (blocks holding an escape) is None when no block may be verbatim (``verbatim_bytes``: 32 values' bytes)."""
    raw_rows = w_raw + s_raw
    cost = torch.empty(k.numel(), 3 if escaped is None else 4, dtype=torch.int64, device=k.device)
    torch.mul(raw_rows, 4, out=cost[:, MODE_RAW])
    torch.add(lead, 4 * (w_delta + s_delta), out=cost[:, MODE_LORENZO])
    torch.add((k * raw_rows + 7) >> 3, 4, out=cost[:, MODE_SPARSE]).masked_fill_(k == 0, 1 << 30)
    if escaped is not None:
        cost[:, :MODE_VERBATIM].masked_fill_(escaped[:, None], 1 << 30)
        cost[:, MODE_VERBATIM] = verbatim_bytes
    sizes, mode = cost.min(dim=1)  # first minimum: ties go to the lower mode
    use_delta, verbatim = mode == MODE_LORENZO, mode == MODE_VERBATIM
    w = torch.where(use_delta, w_delta, w_raw).masked_fill_(verbatim, 0)
    s = torch.where(use_delta, s_delta, s_raw).masked_fill_(verbatim, False)
    header = (w | (s.to(torch.int64) << 5) | (mode << 6) | ((mode == MODE_SPARSE) * k << 8)
              | (use_delta * (lead - 1) << 14))
    return sizes, mode, w, s, header.to(torch.int16)  # the uint16 bit pattern (int64 -> int16 wraps)


def encode_blocks(q: torch.Tensor, raw: torch.Tensor | None = None,
                  escape: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Headers (int16 storage of the uint16 headers) and payload bytes of a flat int32 code tensor. ``raw`` (the
    values verbatim blocks store: the input with ``|xc| <= eb`` set to 0) and ``escape`` (the escape mask) allow
    verbatim blocks; without them every block stores codes."""
    codes = _blocks(q)
    deltas = torch.zeros_like(codes)  # lane 0 holds no delta: its code is the block's lead value
    deltas[:, 1:] = codes[:, 1:] - codes[:, :-1]
    lead = _lead_bytes(codes[:, 0])

    nonzero = codes != 0
    k = nonzero.sum(dim=1)
    escaped = None if raw is None else _blocks(escape).any(dim=1)
    verbatim_bytes = 0 if raw is None else BLOCK * raw.element_size()
    sizes, mode, w, s, header = choose_modes(
        bit_length(codes.abs().amax(dim=1)), (codes < 0).any(dim=1), bit_length(deltas.abs().amax(dim=1)),
        (deltas < 0).any(dim=1), k, lead, escaped, verbatim_bytes)
    use_delta, verbatim = mode == MODE_LORENZO, mode == MODE_VERBATIM
    if not bool((sizes > 0).any()):
        return header, q.new_zeros(0, dtype=torch.uint8)

    # row layout: 4 bytes of the lead value, then the region (dense planes, sparse mask + stream, or verbatim)
    rows = max(int((w + s).max()), 1)
    values = torch.where(use_delta[:, None], deltas, codes)
    planes = _planes(values, s, rows)
    out = torch.zeros(codes.shape[0], 4 + max(4 * rows + 4, verbatim_bytes), dtype=torch.uint8, device=q.device)
    byte = torch.arange(4, device=q.device)
    out[:, :4] = ((codes[:, :1].to(torch.int64) >> (8 * byte)) & 255).to(torch.uint8)
    out[:, 4: 4 * rows + 4] = _bytes_of_bits(planes.reshape(codes.shape[0], -1))
    sparse = (mode == MODE_SPARSE).nonzero().view(-1)
    if sparse.numel():
        ks, lanes = k[sparse], nonzero[sparse]
        stream = torch.zeros(sparse.numel(), rows * BLOCK, dtype=torch.uint8, device=q.device)
        position = _sparse_positions(ks, lanes, rows)
        stream.scatter_add_(1, position.reshape(sparse.numel(), -1),
                            (planes[sparse] * lanes[:, None, :]).reshape(sparse.numel(), -1))
        out[sparse, 4: 4 * rows + 8] = _bytes_of_bits(torch.cat([lanes.to(torch.uint8), stream], dim=1))
    if raw is not None:
        out[verbatim, 4: 4 + verbatim_bytes] = _blocks(raw).view(torch.uint8).view(-1, verbatim_bytes)[verbatim]
    lead_used = torch.where(use_delta, lead, 0)
    column = torch.arange(out.shape[1], device=q.device)[None, :]
    keep = (column < lead_used[:, None]) | ((column >= 4) & (column - 4 < (sizes - lead_used)[:, None]))
    return header, out[keep]


def block_sizes(header: torch.Tensor, itemsize: int) -> tuple[torch.Tensor, ...]:
    """``(sizes, w, s, mode, k, lead)`` of each block (int64), from the uint16 headers and the bytes per value
    (of verbatim blocks) alone (``lead``: bytes of the lead value, Lorenzo blocks only)."""
    h = header.to(torch.int64) & 0xFFFF
    w, s, mode, k = h & 31, (h >> 5) & 1, (h >> 6) & 3, (h >> 8) & 63
    lead = torch.where(mode == MODE_LORENZO, (h >> 14) + 1, 0)
    dense = lead + 4 * (w + s)
    sparse = 4 + (k * (w + s) + 7) // 8
    sizes = torch.where(mode == MODE_SPARSE, sparse, torch.where(mode == MODE_VERBATIM, BLOCK * itemsize, dense))
    return sizes, w, s, mode, k, lead


def decode_blocks(header: torch.Tensor, payload: torch.Tensor, numel: int, itemsize: int) -> torch.Tensor:
    """Inverse of :func:`encode_blocks` for the coded blocks: ``numel`` int32 codes (0 in verbatim blocks)."""
    sizes, w, s, mode, k, lead = block_sizes(header, itemsize)
    blocks = sizes.numel()
    coded = mode != MODE_VERBATIM
    region = torch.where(coded, sizes - lead, 0)
    if not blocks or not bool((coded & (sizes > 0)).any()):
        return torch.zeros(numel, dtype=torch.int32, device=header.device)
    offsets = torch.cumsum(sizes, 0) - sizes
    last = payload.numel() - 1

    def gather(start, count, limit):
        column = torch.arange(count, device=header.device)[None, :]
        index = (start[:, None] + column).clamp(max=last)
        return torch.where(column < limit[:, None], payload[index], 0).to(torch.int64)

    lead_bytes = gather(offsets, 4, lead)
    lead_value = (lead_bytes << (8 * torch.arange(4, device=header.device))).sum(dim=1)
    lead_bits = 8 * lead.clamp(min=1)
    lead_value = torch.where(lead_value >= (1 << (lead_bits - 1)), lead_value - (1 << lead_bits), lead_value)
    width = 4 * max(-(-int(region.max()) // 4), 1)
    rows = gather(offsets + lead, width, region).to(torch.uint8)
    planes = _bits_of_bytes(rows).view(blocks, width // 4, BLOCK)  # rows past w + s are zero: masked bytes
    values = _magnitudes(planes, s)

    sparse = (mode == MODE_SPARSE).nonzero().view(-1)
    if sparse.numel():
        ks, ss, ws = k[sparse], s[sparse], w[sparse]
        lanes = planes[sparse, 0, :].bool()
        stream = planes[sparse, 1:, :].reshape(sparse.numel(), -1)
        used = int((ws + ss).max())
        position = _sparse_positions(ks, lanes, used).clamp(max=stream.shape[1] - 1)
        sparse_planes = stream.gather(1, position.reshape(sparse.numel(), -1)).view(sparse.numel(), used, BLOCK)
        in_stream = torch.arange(used, device=header.device)[None, :] < (ws + ss)[:, None]
        sparse_planes = sparse_planes * lanes[:, None, :] * in_stream[:, :, None]
        values[sparse] = _magnitudes(sparse_planes, ss)
    lorenzo = lead_value[:, None] + values.cumsum(dim=1, dtype=torch.int64)
    codes = torch.where((mode == MODE_LORENZO)[:, None], lorenzo, values)
    return codes.reshape(-1)[:numel].to(torch.int32)


def _split_chunks(numel: int) -> list[tuple[int, int]]:
    return [(e0, min(numel, e0 + CHUNK_ELEMENTS)) for e0 in range(0, numel, CHUNK_ELEMENTS)]


def decode_values(header: torch.Tensor, payload: torch.Tensor, numel: int, step: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """``numel`` decoded values in ``dtype``: ``r(q)`` of the coded blocks, the stored bits of verbatim ones."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    values = _reconstruct(decode_blocks(header, payload, numel, itemsize), step, dtype)
    sizes, _, _, mode, _, _ = block_sizes(header, itemsize)
    verbatim = (mode == MODE_VERBATIM).nonzero().view(-1)
    if not verbatim.numel():
        return values
    offsets = torch.cumsum(sizes, 0) - sizes
    index = offsets[verbatim, None] + torch.arange(BLOCK * itemsize, device=header.device)
    blocks = _blocks(values)
    blocks[verbatim] = payload[index].view(dtype)
    return blocks.view(-1)[:numel]


def lorenzo_encode_reference(flat: torch.Tensor, error_bound: float) -> dict[str, torch.Tensor]:
    """Torch specification of the encode kernels: buffers ``header`` and ``payload`` of a flat tensor, at their
    exact sizes."""
    eb, step, inv = working_bound(error_bound)
    headers, payloads = [], []
    for e0, e1 in _split_chunks(flat.numel()):
        chunk = flat[e0:e1]
        q, escape = prequantize(chunk, eb, step, inv)
        header, payload = encode_blocks(q, torch.where(checked_float(chunk).abs() <= eb, 0, chunk), escape)
        headers.append(header)
        payloads.append(payload)

    def cat(parts, dtype):
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=flat.device)

    return {"header": cat(headers, torch.int16), "payload": cat(payloads, torch.uint8)}


def lorenzo_decode_reference(buffers: dict[str, torch.Tensor], numel: int, error_bound: float,
                             dtype: torch.dtype) -> torch.Tensor:
    """Torch specification of the decode kernel: a flat tensor of ``numel`` elements in ``dtype``. The payload
    may be longer than the headers' total (the CUDA encode's reservation): the bytes past it are not read."""
    _, step, _ = working_bound(error_bound)
    header, payload = buffers["header"], buffers["payload"]
    out = torch.empty(numel, dtype=dtype, device=header.device)
    sizes = block_sizes(header, out.element_size())[0]
    block_offsets = torch.cumsum(sizes, 0) - sizes
    for e0, e1 in _split_chunks(numel):
        b0, b1 = e0 // BLOCK, -(-e1 // BLOCK)
        start = int(block_offsets[b0])
        end = start + int(sizes[b0:b1].sum())
        out[e0:e1] = decode_values(header[b0:b1], payload[start:end], e1 - e0, step, dtype)
    return out
