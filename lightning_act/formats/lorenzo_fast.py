"""The fast torch path of the Lorenzo format: the headers and payload bytes of
:func:`~lightning_act.formats.lorenzo.lorenzo_encode_reference` (the specification, kept as the test oracle) and
the values of its decode, in far fewer whole-tensor passes. The codec runs it wherever the kernels do not: CPU
tensors, float64, CUDA without CuPy.

What the specification spends its time on, and what replaces it here:

- **Prequantization** (about 30 whole-tensor ops): the common case in about 8. ``q0 = rint(x * inv)`` is
  accepted where ``|x - r(q0)| < eb`` (which gives 0 for every ``|x| < eb``); one min/max of ``t`` over the chunk
  proves every ``|t| < TMAX`` (else that test runs per element). The other elements (their ``q1`` and escapes:
  rare, and none in most tensors) go through the specification's own ``prequantize``, which is elementwise.
- **Bit planes** (a byte per lane and plane, then bit packing): 8 x 8 bit-matrix transposes of int64 words. Eight
  lanes' byte ``B`` of ``|v|`` in one word become that word's 8 plane bytes (planes ``8B .. 8B + 7``), 18 integer
  ops on an eighth of the elements per 8 planes. Sign and nonzero-lane words take one multiplication per 8 lanes.
- **The sparse stream** (a scatter of every bit): the block's nonzero codes moved to its first lanes (one
  scatter), so each plane word of them is the stream's ``k`` bits at bit ``p * k``; a dense block's stream is the
  same with ``k = 32``. One scatter per block and plane, none per bit.
- **Assembly**: a block's bytes are one bit stream (the prefix first: a Lorenzo block's lead value in its bytes,
  a sparse block's nonzero-lane word; then the planes), built in 32-bit words in a row of the chunk's widest
  block; one ``index_select`` at offsets from the block sizes takes every block's bytes in order, verbatim blocks'
  values (escapes, incompressible data) appended to the rows it reads from.

Decode reverses each step: the payload scattered into rows at the headers' offsets, plane words cut from each
stream by shifts, the same transposes (an 8 x 8 transpose is its own inverse), nonzero codes spread back to their
lanes, Lorenzo deltas summed. Chunks of whole blocks bound the temporaries (:func:`chunk_elements`). Byte views
assume a little-endian host, as torch does everywhere. On CPU, ``torch.where`` with a broadcast condition,
advanced indexing, ``index_put_`` and int64 cumsums cost several times their alternatives here (arithmetic
selects, ``index_select``, ``scatter_``, int32 cumsums): ``benchmarks/results/torch_path.md``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .lorenzo import (
    BLOCK,
    MODE_LORENZO,
    MODE_SPARSE,
    MODE_VERBATIM,
    TMAX,
    bit_length,
    block_sizes,
    checked_float,
    choose_modes,
    lead_magnitude,
    prequantize,
    working_bound,
)

# Elements per chunk on CPU, per torch thread: about 50 bytes of temporaries each (tests/test_transients.py), so a
# chunk outgrows a core's L2, but its dozens of per-block ops (on 1/32 of the elements, mostly per-op overhead)
# cost less per element than at 2**17: 8-12% faster encode and decode, measured on a ReLU'd float32 activation.
# On a GPU (no CuPy, or float64) 2**20: about 50 MiB of temporaries beside the activations being saved, while each
# of the chunk's ~70 launches still moves megabytes.
CHUNK_ELEMENTS = 1 << 18
GPU_CHUNK_ELEMENTS = 1 << 20
_WORD = 0xFFFFFFFF
# 8 bytes of 0 or 1 in an int64 word -> their 8 bits in its top byte (formats._bitpack's 1-bit multiplier)
_GATHER_BITS = 0x0102040810204080
# the three delta swaps of an 8 x 8 bit-matrix transpose (bit 8 * row + col <-> bit 8 * col + row); each mask
# is clear in the top bits the right shift fills, so int64's arithmetic shift is as good as a logical one
_TRANSPOSE_SWAPS = ((7, 0x00AA00AA00AA00AA), (14, 0x0000CCCC0000CCCC), (28, 0x00000000F0F0F0F0))


def chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS * torch.get_num_threads() if device.type == "cpu" else GPU_CHUNK_ELEMENTS


def _transpose8_(x: torch.Tensor) -> torch.Tensor:
    """Transpose the 8 x 8 bit matrix in each int64 of ``x``, in place."""
    for shift, mask in _TRANSPOSE_SWAPS:
        t = (x >> shift).bitwise_xor_(x).bitwise_and_(mask)
        x ^= t
        x ^= t << shift
    return x


def _lane_words(flags: torch.Tensor) -> torch.Tensor:
    """(blocks, 32) bool -> (blocks,) int64 32-bit words, bit ``l`` = ``flags[:, l]``."""
    eights = flags.contiguous().view(torch.uint8).view(-1, 8).view(torch.int64)
    low_bytes = ((eights * _GATHER_BITS) >> 56).to(torch.uint8)  # narrowing keeps the gathered byte
    return low_bytes.view(-1, 4).view(torch.int32).view(-1).to(torch.int64) & _WORD


def _magnitude_planes(magnitudes: torch.Tensor, nbytes: int) -> torch.Tensor:
    """(blocks, 32) int32 magnitudes below 2**(8 * nbytes) -> (blocks, 8 * nbytes) int64 32-bit plane words:
    word ``p`` bit ``l`` = bit ``p`` of lane ``l``."""
    blocks = magnitudes.shape[0]
    lane_bytes = torch.empty(blocks, nbytes, BLOCK, dtype=torch.uint8, device=magnitudes.device)
    for byte in range(nbytes):  # the int32 -> uint8 conversion keeps the low byte (a strided byte copy is slower)
        lane_bytes[:, byte] = magnitudes >> 8 * byte if byte else magnitudes
    words = _transpose8_(lane_bytes.view(torch.int64))  # (blocks, B, group of 8 lanes)
    # (blocks, B, plane, group): plane 8B + r is its 4 group bytes, a little-endian 32-bit word
    planes = words.view(torch.uint8).view(blocks, nbytes, 4, 8).transpose(2, 3).contiguous()
    return planes.view(torch.int32).view(blocks, 8 * nbytes).to(torch.int64) & _WORD


def _lane_magnitudes(planes: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Inverse of :func:`_magnitude_planes`: (blocks, 8 * nbytes) plane words -> (blocks, 32) int32."""
    blocks = planes.shape[0]
    plane_bytes = planes.to(torch.int32).view(torch.uint8).view(blocks, nbytes, 8, 4).transpose(2, 3).contiguous()
    words = _transpose8_(plane_bytes.view(torch.int64))  # (blocks, B, group): byte i = byte B of lane 8 * group + i
    lane_bytes = words.view(torch.uint8).view(blocks, nbytes, BLOCK)
    magnitudes = lane_bytes[:, 0].to(torch.int32)
    for byte in range(1, nbytes):
        magnitudes |= lane_bytes[:, byte].to(torch.int32) << 8 * byte
    return magnitudes


def _abs(v: torch.Tensor) -> torch.Tensor:
    """|v| of int32 values above -2**31 (torch's integer abs is several times slower on CPU)."""
    sign = v >> 31
    return (v ^ sign).sub_(sign)


def _prequantize(x: torch.Tensor, eb: float, step: float, inv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification's ``prequantize`` of a flat chunk as int32 codes and the escapes' indices."""
    x32 = x.float()
    xc = x if x.dtype == torch.float64 else x32
    t = x32 * inv
    q = torch.round(t)
    r = q * step
    if x.dtype != torch.float32:
        r = r.to(x.dtype).to(xc.dtype)
    # Zero preservation needs no test of its own: an |x| <= eb passes the error test only with q0 = 0 (or fails it,
    # and the specification stores 0). |x| < eb gives |t| < 0.5 in float32, so q0 = 0; |x| = eb may give q0 = +-1,
    # whose decode is at least 2 * eb in magnitude: exact in float32 and float64, and for a 16-bit x = eb, 2 * eb
    # is representable too or rounds up to infinity. Either way it is at least eb away (tests/test_lorenzo_fast.py,
    # the 16-bit bound corners).
    error = r.sub_(xc).abs_()
    lo, hi = torch.aminmax(t)
    codes = q.to(torch.int32)
    # one host read: every |t| < TMAX (no NaN or Inf either), and every error below eb (NaN fails this too)
    inside, close = torch.stack([torch.maximum(-lo, hi) < TMAX, error.amax() < eb]).tolist()
    if inside and close:
        return codes, codes.new_zeros(0, dtype=torch.int64)
    accepted = error < eb
    if not inside:
        accepted &= t.abs() < TMAX
    rest = (~accepted).nonzero().view(-1)
    codes[rest], escape = prequantize(x[rest], eb, step, inv)
    return codes, rest[escape]


def _byte_positions(base: torch.Tensor, sizes: torch.Tensor, total: int) -> torch.Tensor:
    """``base[b] + i`` for ``i < sizes[b]``, block after block (``total``: the sum of ``sizes``): where each payload
    byte sits in rows that start at ``base``."""
    offsets = sizes.cumsum(0) - sizes
    start = torch.repeat_interleave(base - offsets, sizes, output_size=total)
    return start.add_(torch.arange(total, device=base.device))


def _stream_bits(prefix_bits: torch.Tensor, k: torch.Tensor, rmax: int) -> torch.Tensor:
    """(blocks, rmax) int64: the bit of the block's bytes where plane p's ``k`` bits start, after the prefix."""
    return prefix_bits[:, None] + torch.arange(rmax, device=k.device)[None, :] * k[:, None]


def _encode_chunk(x: torch.Tensor, eb: float, step: float, inv: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Headers and payload of a flat chunk, as the specification's ``encode_blocks`` stores them."""
    device, pad = x.device, -x.numel() % BLOCK
    if pad:  # zeros: code 0, and +0.0 in a verbatim block, as the specification pads
        x = torch.cat([x, x.new_zeros(pad)])
    blocks = x.numel() // BLOCK
    q, escapes = _prequantize(x, eb, step, inv)
    codes = q.view(blocks, BLOCK)
    deltas = torch.empty_like(codes)
    deltas[:, 0] = 0  # lane 0 holds no delta: its code is the block's lead value
    torch.sub(codes[:, 1:], codes[:, :-1], out=deltas[:, 1:])
    nonzero = codes != 0
    ranks = nonzero.view(torch.uint8).cumsum(dim=1, dtype=torch.int32)  # 1 + rank of a nonzero code in its block
    k = ranks[:, -1].to(torch.int64)
    escaped = torch.zeros(blocks, dtype=torch.bool, device=device)
    escaped[escapes // BLOCK] = True
    verbatim_bytes = BLOCK * x.element_size()
    codes_lo, deltas_lo = codes.amin(dim=1), deltas.amin(dim=1)
    w_raw, w_delta, lead = bit_length(torch.stack([  # the largest magnitude: max(max, -min)
        torch.maximum(codes.amax(dim=1), -codes_lo), torch.maximum(deltas.amax(dim=1), -deltas_lo),
        lead_magnitude(codes[:, 0])]))  # one bit_length call for the three
    lead = lead // 8 + 1  # as _lead_bytes
    sizes, mode, w, s, header = choose_modes(w_raw, codes_lo < 0, w_delta, deltas_lo < 0, k, lead, escaped,
                                             verbatim_bytes)
    total, rmax, wmax, any_sparse, any_verbatim = torch.stack([
        sizes.sum(), (w + s).max(), w.max(), (mode == MODE_SPARSE).any(), (mode == MODE_VERBATIM).any()]).tolist()
    if not total:
        return header, torch.empty(0, dtype=torch.uint8, device=device)

    use_delta, sparse = mode == MODE_LORENZO, mode == MODE_SPARSE
    values = codes.clone()  # Lorenzo blocks store their deltas, 0 in lane 0 (the lead value is the prefix)
    values[:, 1:] -= codes[:, :-1] * use_delta[:, None]
    values[:, 0] *= ~use_delta
    if any_sparse:  # sparse blocks: nonzero codes to the first lanes, in lane order (other blocks: lanes stay)
        lane = torch.arange(BLOCK, dtype=torch.int32, device=device)
        # sparse rows: a code's rank (a zero lane adds 0 where it lands); other rows: its lane. Arithmetic, not
        # torch.where, which broadcasts slowly on CPU
        slot = ranks.sub(lane + 1).mul_(sparse.to(torch.int32)[:, None]).add_(lane).clamp_(min=0)
        values = torch.zeros_like(values).scatter_add_(1, slot.to(torch.int64), values)
    # the prefix: a Lorenzo block's lead value in its `lead` bytes, a sparse block's nonzero-lane word
    prefix_bits = torch.where(use_delta, 8 * lead, torch.where(sparse, 32, 0))
    prefix = torch.where(use_delta, codes[:, 0].to(torch.int64), _lane_words(nonzero))
    prefix &= (torch.ones_like(prefix_bits) << prefix_bits) - 1

    # plane p: the sign word first in signed blocks, then magnitude bits from the lowest; its k bits (k = 32 in
    # dense blocks) at bit prefix + p * k of the block's bytes, spanning at most two 32-bit words
    nbytes = -(-wmax // 8)
    magnitude = _magnitude_planes(_abs(values), nbytes) if nbytes else values.new_zeros(blocks, 0, dtype=torch.int64)
    magnitude = F.pad(magnitude, (0, max(rmax - magnitude.shape[1], 0)))[:, :rmax]
    signed = torch.cat([_lane_words(values < 0)[:, None], magnitude[:, : rmax - 1]], dim=1)[:, :rmax]
    planes = signed.sub_(magnitude).mul_(s[:, None]).add_(magnitude)  # where signed (broadcast where is slow)
    bit = _stream_bits(prefix_bits, torch.where(sparse, k, BLOCK), rmax)
    shifted, word = planes << (bit & 31), bit >> 5
    stream = torch.zeros(blocks, rmax + 2, dtype=torch.int64, device=device)
    stream[:, 0] = prefix
    stream.scatter_add_(1, word, shifted & _WORD).scatter_add_(1, word + 1, shifted >> 32)

    rows = stream.to(torch.int32).view(torch.uint8)  # each block's bytes from the start of its row
    source, base = rows.view(-1), torch.arange(blocks, device=device) * rows.shape[1]
    if any_verbatim:  # their 32 values, |xc| <= eb as +0.0, after the rows
        verbatim_rows = (mode == MODE_VERBATIM).nonzero().view(-1)
        raw = x.view(blocks, BLOCK)[verbatim_rows]
        raw = torch.where(checked_float(raw).abs() <= eb, 0, raw)
        base[verbatim_rows] = source.numel() + verbatim_bytes * torch.arange(verbatim_rows.numel(), device=device)
        source = torch.cat([source, raw.view(torch.uint8).view(-1)])
    return header, source.index_select(0, _byte_positions(base, sizes, total))


def _decode_chunk(header: torch.Tensor, payload: torch.Tensor, out: torch.Tensor, step: float) -> None:
    """Decode a chunk's whole blocks (``header``, exactly their ``payload``) into ``out`` (its flat elements)."""
    device, blocks, itemsize = header.device, header.numel(), out.element_size()
    sizes, w, s, mode, k, lead = block_sizes(header, itemsize)
    use_delta, sparse, verbatim = mode == MODE_LORENZO, mode == MODE_SPARSE, mode == MODE_VERBATIM
    offsets = sizes.cumsum(0) - sizes
    rmax, wmax, any_sparse, any_delta = torch.stack([(w + s).max(), w.max(), sparse.any(), use_delta.any()]).tolist()
    total = payload.numel()
    if total:
        # each block's bytes to the start of its zeroed row (verbatim blocks: to a scratch row after them, read
        # below): the bits past a block's planes read as zero planes
        width = 4 * (rmax + 2)
        base = torch.arange(blocks, device=device) * width
        base.masked_fill_(verbatim, blocks * width)
        rows = torch.zeros(blocks * width + BLOCK * itemsize, dtype=torch.uint8, device=device)
        rows.scatter_(0, _byte_positions(base, sizes, total), payload)
        words = rows[: blocks * width].view(torch.int32).view(blocks, rmax + 2).to(torch.int64) & _WORD
        prefix_bits = torch.where(use_delta, 8 * lead, torch.where(sparse, 32, 0))
        prefix = words[:, 0] & ((torch.ones_like(prefix_bits) << prefix_bits) - 1)
        k_eff = torch.where(sparse, k, BLOCK)
        bit = _stream_bits(prefix_bits, k_eff, rmax)
        word = bit >> 5
        two_words = words.gather(1, word) | (words.gather(1, word + 1) << 32)
        planes = (two_words >> (bit & 31)) & ((torch.ones_like(k_eff) << k_eff) - 1)[:, None]
        planes = torch.cat([planes, planes.new_zeros(blocks, 1)], dim=1)  # a zero plane past every block's last
        nbytes = -(-wmax // 8)
        if nbytes:
            magnitude_index = (torch.arange(8 * nbytes, device=device)[None, :] + s[:, None]).clamp_(max=rmax)
            values = _lane_magnitudes(planes.gather(1, magnitude_index), nbytes)
        else:
            values = torch.zeros(blocks, BLOCK, dtype=torch.int32, device=device)
        lane = torch.arange(BLOCK, dtype=torch.int32, device=device)
        negative = ((planes[:, 0] * s).to(torch.int32)[:, None] >> lane) & 1
        values = (values ^ -negative) + negative  # two's complement negation where the sign bit is set
        if any_sparse:  # the nonzero codes back to their lanes (other blocks: every lane present, none moves)
            present = (torch.where(sparse, prefix, _WORD).to(torch.int32)[:, None] >> lane) & 1
            slot = present.cumsum(dim=1, dtype=torch.int32).sub_(1).mul_(present)
            values = values.gather(1, slot.to(torch.int64)).mul_(present)
        if any_delta:  # lead value (two's complement in its bytes) plus the deltas' prefix sums
            lead_range = torch.ones_like(lead) << 8 * lead.clamp(min=1)  # 2**bits of the lead value's bytes
            lead_value = prefix - (2 * prefix >= lead_range) * lead_range
            summed = values.cumsum(dim=1, dtype=torch.int32).add_(lead_value.to(torch.int32)[:, None])
            values += (summed - values) * use_delta[:, None]
        codes = values
    else:
        codes = torch.zeros(blocks, BLOCK, dtype=torch.int32, device=device)
    whole = out.numel() == blocks * BLOCK  # all but a tensor's last chunk: decoded straight into `out`
    decoded = out if whole else torch.empty(blocks * BLOCK, dtype=out.dtype, device=device)
    if out.dtype == torch.float32:
        torch.mul(codes.view(-1), step, out=decoded)  # int32 * float -> float32, as float32(q) * step
    else:
        decoded.copy_(codes.view(-1).float().mul_(step))
    verbatim_rows = verbatim.nonzero().view(-1)
    if verbatim_rows.numel():
        byte = torch.arange(BLOCK * itemsize, device=device)
        stored = payload[offsets[verbatim_rows, None] + byte].view(out.dtype)
        decoded.view(blocks, BLOCK)[verbatim_rows] = stored
    if not whole:
        out.copy_(decoded[: out.numel()])


def lorenzo_encode_fast(flat: torch.Tensor, error_bound: float) -> dict[str, torch.Tensor]:
    """Buffers ``header`` and ``payload`` of a flat tensor, byte for byte :func:`lorenzo_encode_reference`'s."""
    eb, step, inv = working_bound(error_bound)
    chunk = chunk_elements(flat.device)  # a multiple of the block
    parts = [_encode_chunk(flat[e0: e0 + chunk], eb, step, inv) for e0 in range(0, flat.numel(), chunk)]
    if not parts:
        return {"header": torch.empty(0, dtype=torch.int16, device=flat.device),
                "payload": torch.empty(0, dtype=torch.uint8, device=flat.device)}
    return {"header": torch.cat([h for h, _ in parts]), "payload": torch.cat([p for _, p in parts])}


def lorenzo_decode_fast(buffers: dict[str, torch.Tensor], numel: int, error_bound: float,
                        dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``numel`` elements in ``dtype``, bit for bit :func:`lorenzo_decode_reference`'s; the
    payload may be longer than the headers' total (the CUDA encode's reservation)."""
    _, step, _ = working_bound(error_bound)
    header, payload = buffers["header"], buffers["payload"]
    out = torch.empty(numel, dtype=dtype, device=header.device)
    chunk = chunk_elements(header.device)
    per_chunk = chunk // BLOCK
    ends = block_sizes(header, out.element_size())[0].cumsum(0)
    starts = [0] + ends[per_chunk - 1:: per_chunk].tolist()  # payload offset of each chunk's first block
    for i, e0 in enumerate(range(0, numel, chunk)):
        b0 = i * per_chunk
        end = starts[i + 1] if i + 1 < len(starts) else int(ends[-1])
        _decode_chunk(header[b0: b0 + per_chunk], payload[starts[i]: end], out[e0: e0 + chunk], step)
    return out
