// Kernels of the `lorenzo` codec. lightning_act/formats/lorenzo.py (prequantize, encode_blocks, block_sizes,
// decode_blocks, decode_values, lorenzo_encode_reference, lorenzo_decode_reference) is the specification, bit
// for bit: its module docstring defines the codes, the four block modes, the uint16 headers and the payload.
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names; every
// float32 operation is an explicit __f*_rn intrinsic (no contracted multiply-add); 64-bit element and byte
// offsets. The launcher prepends common.cuh (16-bit floats, load/store_float). dtype: float32, float16 or
// bfloat16 (verbatim blocks copy 4- or 2-byte words); the codec runs float64 tensors on its torch path.
//
// One kernel a direction, one read of the input. A block's payload starts where the blocks before it end, so
// each kernel runs a single-pass prefix sum with decoupled look-back (Merrill & Garland, 2016) over tiles of
// LORENZO_TILE_BLOCKS blocks (a warp a block of 32 codes, lane i element 32 * block + i):
//   lorenzo_encode  per tile: prequantize, choose each block's mode, write its header (the blocks' state stays in
//                   registers); the tile's payload bytes -> its offset (look-back); write the payloads there, into
//                   a buffer of the most the tensor can store; the last tile writes the payload's size
//   lorenzo_decode  per tile: each block's payload bytes from its header -> the tile's offset (look-back); header
//                   + offset -> codes -> float32(q) * step in the output dtype, or the verbatim bits
// The scan state is `scan` (int64, zeroed by the launcher): [0] the payload's size, [1] the next tile to claim,
// [2 + t] tile t's flag: 0 until published, then SCAN_AGGREGATE | its own bytes, then SCAN_PREFIX | the bytes of
// tiles 0..t. A flag carries its value in one 64-bit word, so no other memory is ordered between blocks. Tiles
// are claimed in order from the counter, so every tile before a claimed one belongs to a running thread block,
// which publishes its aggregate before it looks back: every look-back ends, whatever order blocks run in.
// Nothing here is read back by the host: sizes and offsets stay on the device.

#define LORENZO_TMAX 536870912.0f  // 2**29: |codes| <= 2**29 + 1, deltas below 2**31
#define MODE_RAW 0
#define MODE_LORENZO 1
#define MODE_SPARSE 2
#define MODE_VERBATIM 3

// _reconstruct: dtype(float32(q) * step), read back as float32
__device__ __forceinline__ float lorenzo_reconstruct(int q, float step, int dtype) {
    const float r = __fmul_rn((float)q, step);
    if (dtype == DTYPE_FLOAT32) return r;
    return dtype == DTYPE_FLOAT16 ? half_to_float(float_to_half(r)) : bf16_to_float(float_to_bf16(r));
}

// prequantize for one element: its code, whether it escapes (its block is stored verbatim) and whether
// |x| <= eb (a verbatim block stores it as +0.0)
__device__ __forceinline__ int lorenzo_code(float x32, int dtype, float eb, float step, float inv, bool* escape,
                                            bool* zero) {
    const float t = __fmul_rn(x32, inv);
    const bool inside = fabsf(t) < LORENZO_TMAX;  // false for NaN and Inf
    const int q0 = inside ? (int)rintf(t) : 0;    // ties to even, like torch.round
    const float r0 = lorenzo_reconstruct(q0, step, dtype);
    const bool ok0 = fabsf(__fsub_rn(x32, r0)) < eb;
    const int q1 = q0 + (x32 > r0 ? 1 : -1);
    const bool ok1 = fabsf(__fsub_rn(x32, lorenzo_reconstruct(q1, step, dtype))) < eb;
    *zero = fabsf(x32) <= eb;
    *escape = !*zero && !(inside && (ok0 || ok1));
    return (*zero || *escape) ? 0 : (ok0 ? q0 : q1);
}

__device__ __forceinline__ int bit_length(unsigned int m) { return 32 - __clz((int)m); }

__device__ __forceinline__ int warp_max(int v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(FULL_WARP, v, offset));
    return v;
}

__device__ __forceinline__ int lorenzo_itemsize(int dtype) { return dtype == DTYPE_FLOAT32 ? 4 : 2; }

// block_sizes: payload bytes of a block from its header
__device__ __forceinline__ int lorenzo_block_size(unsigned int h, int itemsize) {
    const int w = h & 31, s = (h >> 5) & 1, mode = (h >> 6) & 3, k = (h >> 8) & 63;
    if (mode == MODE_VERBATIM) return 32 * itemsize;
    if (mode == MODE_SPARSE) return 4 + (k * (w + s) + 7) / 8;
    return (mode == MODE_LORENZO ? (int)(h >> 14) + 1 : 0) + 4 * (w + s);
}

struct LorenzoBlock {
    int code, value;         // this lane's code and the value its mode stores (code, or delta in Lorenzo mode)
    int lead_code;           // lane 0's code: the lead value of Lorenzo mode
    bool escape, zero;       // this lane escapes; |x| <= eb
    int mode, w, s, k, lead;  // lead: bytes of the lead value (Lorenzo mode), else 0
    int size;                 // payload bytes
    unsigned int nonzero;     // lanes with a nonzero code
};

// Everything the encode decides for the block holding element `first + lane` (all lanes call it).
__device__ __forceinline__ LorenzoBlock lorenzo_block(const void* x, int dtype, long long numel, long long first,
                                                      int lane, float eb, float step, float inv) {
    LorenzoBlock b;
    const long long e = first + lane;
    b.escape = false;
    b.zero = true;
    // lanes past the end hold the zero codes of the spec's padding
    b.code = e < numel ? lorenzo_code(load_float(x, e, dtype), dtype, eb, step, inv, &b.escape, &b.zero) : 0;
    const int previous = __shfl_up_sync(FULL_WARP, b.code, 1);
    const int delta = lane == 0 ? 0 : b.code - previous;
    b.nonzero = __ballot_sync(FULL_WARP, b.code != 0);
    b.k = __popc(b.nonzero);
    const int w_raw = bit_length((unsigned int)warp_max(abs(b.code)));
    const int w_delta = bit_length((unsigned int)warp_max(abs(delta)));
    const int s_raw = __ballot_sync(FULL_WARP, b.code < 0) != 0, s_delta = __ballot_sync(FULL_WARP, delta < 0) != 0;
    b.lead_code = __shfl_sync(FULL_WARP, b.code, 0);
    const int lead = bit_length((unsigned int)(b.lead_code < 0 ? -(b.lead_code + 1) : b.lead_code)) / 8 + 1;
    const int cost_raw = 4 * (w_raw + s_raw), cost_delta = lead + 4 * (w_delta + s_delta);
    const int cost_sparse = b.k > 0 ? 4 + (b.k * (w_raw + s_raw) + 7) / 8 : 1 << 30;
    b.mode = MODE_RAW;  // the first minimum: ties go to the lower mode
    b.size = cost_raw;
    if (cost_delta < b.size) { b.mode = MODE_LORENZO; b.size = cost_delta; }
    if (cost_sparse < b.size) { b.mode = MODE_SPARSE; b.size = cost_sparse; }
    const int cost_verbatim = 32 * lorenzo_itemsize(dtype);  // a block holding an escape is always verbatim
    if (__ballot_sync(FULL_WARP, b.escape) != 0 || cost_verbatim < b.size) {
        b.mode = MODE_VERBATIM;
        b.size = cost_verbatim;
    }
    const bool use_delta = b.mode == MODE_LORENZO, verbatim = b.mode == MODE_VERBATIM;
    b.w = use_delta ? w_delta : (verbatim ? 0 : w_raw);
    b.s = use_delta ? s_delta : (verbatim ? 0 : s_raw);
    b.lead = use_delta ? lead : 0;
    b.value = use_delta ? delta : b.code;
    return b;
}

// Bit p of a stored value's planes: the sign first when the block is signed, then magnitude bits from the lowest.
__device__ __forceinline__ unsigned int plane_bit(int value, int s, int p) {
    if (s && p == 0) return value < 0 ? 1u : 0u;
    return ((unsigned int)abs(value) >> (p - s)) & 1u;
}

__device__ __forceinline__ unsigned short lorenzo_header_bits(const LorenzoBlock& b) {
    return (unsigned short)(b.w | b.s << 5 | b.mode << 6 | (b.mode == MODE_SPARSE ? b.k : 0) << 8
                            | (b.mode == MODE_LORENZO ? b.lead - 1 : 0) << 14);
}

// The payload of block `b` (elements first..first + 31) at `out`; `compact`: the warp's row of shared memory.
__device__ __forceinline__ void lorenzo_write_block(const LorenzoBlock& b, const void* __restrict__ x, int dtype,
                                                    long long first, int lane, unsigned char* __restrict__ out,
                                                    int* compact) {
    const int rows = b.w + b.s;
    if (b.mode == MODE_VERBATIM) {  // the value's bytes, +0.0 for |x| <= eb and for padding lanes
        const long long e = first + lane;
        if (dtype == DTYPE_FLOAT32) {
            const unsigned int bits = b.zero ? 0u : ((const unsigned int*)x)[e];
            for (int j = 0; j < 4; ++j) out[4 * lane + j] = (unsigned char)(bits >> (8 * j));
        } else {
            const unsigned int bits = b.zero ? 0u : ((const unsigned short*)x)[e];
            for (int j = 0; j < 2; ++j) out[2 * lane + j] = (unsigned char)(bits >> (8 * j));
        }
    } else if (b.mode == MODE_SPARSE) {
        if (lane < 4) out[lane] = (unsigned char)(b.nonzero >> (8 * lane));
        if (b.code != 0) compact[__popc(b.nonzero & ((1u << lane) - 1u))] = b.code;
        __syncwarp();
        // stream bit p * k + j is bit p of the j-th nonzero code
        const int stream_bits = b.k * rows, stream_bytes = (stream_bits + 7) / 8;
        for (int byte = lane; byte < stream_bytes; byte += 32) {
            unsigned int bits = 0;
            for (int t = 0; t < 8; ++t) {
                const int bit = 8 * byte + t;
                if (bit < stream_bits) bits |= plane_bit(compact[bit % b.k], b.s, bit / b.k) << t;
            }
            out[4 + byte] = (unsigned char)bits;
        }
        __syncwarp();  // compact is reused by the next block
    } else {
        if (lane < b.lead) out[lane] = (unsigned char)((unsigned int)b.lead_code >> (8 * lane));
        for (int p = 0; p < rows; ++p) {  // rows is the same in every lane
            const unsigned int word = __ballot_sync(FULL_WARP, plane_bit(b.value, b.s, p));
            if (lane < 4) out[b.lead + 4 * p + lane] = (unsigned char)(word >> (8 * lane));
        }
    }
}

// Element e = 32 * block + lane of the block with header h, whose payload is at `in` (the whole warp calls it).
__device__ __forceinline__ void lorenzo_decode_block(unsigned int h, const unsigned char* __restrict__ in,
                                                     long long e, int lane, long long numel, float step,
                                                     void* __restrict__ out, int dtype) {
    const int w = h & 31, s = (h >> 5) & 1, mode = (h >> 6) & 3, k = (h >> 8) & 63;
    const int lead = mode == MODE_LORENZO ? (int)(h >> 14) + 1 : 0, rows = w + s;
    if (mode == MODE_VERBATIM) {  // the stored bits, as they are
        if (e < numel) {
            if (dtype == DTYPE_FLOAT32)
                ((unsigned int*)out)[e] = in[4 * lane] | in[4 * lane + 1] << 8 | in[4 * lane + 2] << 16
                                          | (unsigned int)in[4 * lane + 3] << 24;
            else ((unsigned short*)out)[e] = (unsigned short)(in[2 * lane] | in[2 * lane + 1] << 8);
        }
        return;  // the mode is the same in every lane of the warp
    }
    int value = 0;
    if (mode == MODE_SPARSE) {
        const unsigned int nonzero = in[0] | in[1] << 8 | in[2] << 16 | (unsigned int)in[3] << 24;
        if ((nonzero >> lane) & 1u) {
            const int rank = __popc(nonzero & ((1u << lane) - 1u));
            unsigned int magnitude = 0;
            bool negative = false;
            for (int p = 0; p < rows; ++p) {
                const int bit = p * k + rank;
                const unsigned int b = (in[4 + bit / 8] >> (bit % 8)) & 1u;
                if (s && p == 0) negative = b != 0;
                else magnitude |= b << (p - s);
            }
            value = negative ? -(int)magnitude : (int)magnitude;
        }
    } else {
        unsigned int magnitude = 0;
        bool negative = false;
        for (int p = 0; p < rows; ++p) {
            const unsigned int b = (in[lead + 4 * p + lane / 8] >> (lane % 8)) & 1u;
            if (s && p == 0) negative = b != 0;
            else magnitude |= b << (p - s);
        }
        value = negative ? -(int)magnitude : (int)magnitude;
    }
    if (mode == MODE_LORENZO) {  // the lead value plus the inclusive prefix sum of the deltas
        unsigned int lead_bits = 0;
        for (int j = 0; j < lead; ++j) lead_bits |= (unsigned int)in[j] << (8 * j);
        const int shift = 32 - 8 * lead;  // sign-extend from 8 * lead bits
        const int lead_value = (int)(lead_bits << shift) >> shift;
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int other = __shfl_up_sync(FULL_WARP, value, offset);
            if (lane >= offset) value += other;
        }
        value += lead_value;
    }
    if (e < numel) store_float(out, e, dtype, __fmul_rn((float)value, step));
}

// ---- the single-pass prefix sum of payload bytes over tiles (see the top of this file) ----
#define LORENZO_WARPS 8            // warps of a thread block
#define LORENZO_BLOCKS_PER_WARP 4  // blocks a warp takes a tile (the encode keeps their state in registers)
#define LORENZO_TILE_BLOCKS 32     // LORENZO_WARPS * LORENZO_BLOCKS_PER_WARP
#define SCAN_AGGREGATE 0x4000000000000000ull
#define SCAN_PREFIX 0x8000000000000000ull
#define SCAN_VALUE 0x3fffffffffffffffull

// The thread block's next tile, claimed from the counter by thread 0 (all threads call it).
__device__ __forceinline__ long long lorenzo_claim_tile(unsigned long long* scan) {
    __shared__ long long claimed;
    if (threadIdx.x == 0) claimed = (long long)atomicAdd(scan + 1, 1ull);
    __syncthreads();
    const long long tile = claimed;
    __syncthreads();  // read by every thread before the next claim writes it
    return tile;
}

// Warp 0 of the block holding `tile` (tiles before it: published by running blocks): publishes the tile's
// `aggregate`, sums what the tiles before it published, nearest first and 32 at a time, until a tile holding its
// inclusive prefix; publishes this tile's. Returns the bytes of every tile before this one.
__device__ __forceinline__ unsigned long long lorenzo_look_back(unsigned long long* flags, long long tile,
                                                                unsigned long long aggregate, int lane) {
    volatile unsigned long long* const published = flags;  // written by other blocks while this one reads
    if (tile == 0) {
        if (lane == 0) published[0] = SCAN_PREFIX | aggregate;
        return 0;
    }
    if (lane == 0) {
        published[tile] = SCAN_AGGREGATE | aggregate;
        __threadfence();  // visible to the device before this warp starts waiting on others
    }
    unsigned long long exclusive = 0;
    for (long long nearest = tile - 1;; nearest -= 32) {
        const long long t = nearest - lane;  // lane 0 reads the nearest tile of the window
        unsigned long long flag;
        do flag = t >= 0 ? published[t] : SCAN_PREFIX;  // tile 0 always holds its prefix: t < 0 is never summed
        while (__ballot_sync(FULL_WARP, flag == 0) != 0);
        const unsigned int prefixes = __ballot_sync(FULL_WARP, flag >= SCAN_PREFIX);
        // the window's tiles up to its nearest prefix (the lowest lane holding one), or all 32
        const int last = prefixes != 0 ? __popc((prefixes & (0u - prefixes)) - 1u) : 31;
        unsigned long long sum = lane <= last ? flag & SCAN_VALUE : 0ull;
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(FULL_WARP, sum, offset);
        exclusive += sum;
        if (prefixes != 0) break;
    }
    if (lane == 0) published[tile] = SCAN_PREFIX | (exclusive + aggregate);
    return exclusive;
}

// Where this warp's first payload byte of `tile` goes: the tile's offset (warp 0 looks back) plus the bytes of the
// warps before this one. `bytes`: this warp's payload bytes in the tile (every lane the same). All threads call it.
__device__ __forceinline__ unsigned long long lorenzo_warp_offset(unsigned long long* scan, long long tile,
                                                                  long long tiles, unsigned long long bytes,
                                                                  int warp, int lane) {
    __shared__ unsigned long long warp_bytes[LORENZO_WARPS];
    __shared__ unsigned long long tile_offset;
    if (lane == 0) warp_bytes[warp] = bytes;
    __syncthreads();
    if (warp == 0) {
        unsigned long long aggregate = 0;
        for (int w = 0; w < LORENZO_WARPS; ++w) aggregate += warp_bytes[w];
        const unsigned long long exclusive = lorenzo_look_back(scan + 2, tile, aggregate, lane);
        if (lane == 0) {
            tile_offset = exclusive;
            if (tile == tiles - 1) scan[0] = exclusive + aggregate;  // the payload's size
        }
    }
    __syncthreads();
    unsigned long long offset = tile_offset;
    for (int w = 0; w < warp; ++w) offset += warp_bytes[w];
    __syncthreads();  // read by every warp before the next tile writes them
    return offset;
}

// Block: LORENZO_WARPS * 32 threads; any grid (each block claims tiles until none is left).
extern "C" __global__ void __launch_bounds__(LORENZO_WARPS * 32)
lorenzo_encode(const void* __restrict__ x, int dtype, long long numel, float eb, float step, float inv,
               unsigned short* __restrict__ header, unsigned char* __restrict__ payload, unsigned long long* scan) {
    __shared__ int compact[LORENZO_WARPS][32];  // each warp's nonzero codes by rank (sparse blocks)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long blocks = (numel + 31) / 32, tiles = (blocks + LORENZO_TILE_BLOCKS - 1) / LORENZO_TILE_BLOCKS;
    for (long long tile = lorenzo_claim_tile(scan); tile < tiles; tile = lorenzo_claim_tile(scan)) {
        const long long first = tile * LORENZO_TILE_BLOCKS + warp * LORENZO_BLOCKS_PER_WARP;
        LorenzoBlock b[LORENZO_BLOCKS_PER_WARP];
        unsigned long long bytes = 0;
#pragma unroll
        for (int j = 0; j < LORENZO_BLOCKS_PER_WARP; ++j) {
            if (first + j < blocks) {  // the same in every lane
                b[j] = lorenzo_block(x, dtype, numel, (first + j) * 32, lane, eb, step, inv);
                if (lane == 0) header[first + j] = lorenzo_header_bits(b[j]);
                bytes += b[j].size;
            }
        }
        unsigned long long offset = lorenzo_warp_offset(scan, tile, tiles, bytes, warp, lane);
#pragma unroll
        for (int j = 0; j < LORENZO_BLOCKS_PER_WARP; ++j) {
            if (first + j < blocks) {
                lorenzo_write_block(b[j], x, dtype, (first + j) * 32, lane, payload + offset, compact[warp]);
                offset += b[j].size;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(LORENZO_WARPS * 32)
lorenzo_decode(const unsigned short* __restrict__ header, const unsigned char* __restrict__ payload, long long numel,
               float step, void* __restrict__ out, int dtype, unsigned long long* scan) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, itemsize = lorenzo_itemsize(dtype);
    const long long blocks = (numel + 31) / 32, tiles = (blocks + LORENZO_TILE_BLOCKS - 1) / LORENZO_TILE_BLOCKS;
    for (long long tile = lorenzo_claim_tile(scan); tile < tiles; tile = lorenzo_claim_tile(scan)) {
        const long long first = tile * LORENZO_TILE_BLOCKS + warp * LORENZO_BLOCKS_PER_WARP;
        unsigned int h[LORENZO_BLOCKS_PER_WARP];
        int size[LORENZO_BLOCKS_PER_WARP];
        unsigned long long bytes = 0;
#pragma unroll
        for (int j = 0; j < LORENZO_BLOCKS_PER_WARP; ++j) {
            h[j] = first + j < blocks ? header[first + j] : 0u;  // 0: a raw block of no plane, 0 bytes
            size[j] = lorenzo_block_size(h[j], itemsize);
            bytes += size[j];
        }
        unsigned long long offset = lorenzo_warp_offset(scan, tile, tiles, bytes, warp, lane);
#pragma unroll
        for (int j = 0; j < LORENZO_BLOCKS_PER_WARP; ++j) {
            if (first + j < blocks) {
                lorenzo_decode_block(h[j], payload + offset, (first + j) * 32 + lane, lane, numel, step, out, dtype);
                offset += size[j];
            }
        }
    }
}
