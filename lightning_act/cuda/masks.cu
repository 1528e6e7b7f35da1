// Kernels of the 1-bit mask codecs (`bitmask`, `positive_mask`, `scaled_mask`, lightning_act/codecs/bitmask.py and
// masks.py). lightning_act/formats/_bitpack.py (pack_bits / unpack_bits) is the specification, bit for bit: element
// i at bit i % 8 of byte i // 8, the bits past the last element 0.
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names. Element
// offsets are 64-bit (long long) everywhere. The launcher prepends common.cuh (dtype codes, FULL_WARP).
//
// Dtype codes: common.cuh's DTYPE_FLOAT32 / FLOAT16 / BFLOAT16 / FLOAT64, and MASK_BYTES for bool and uint8.
// Flags are decided on the raw bits, never through a float conversion (a float64 1e-320 is non-zero although it
// rounds to a float32 zero):
// - non-zero (`x != 0`, as `x.bool()`): any bit but the sign bit set; NaN is non-zero, -0.0 is zero;
// - positive (`x > 0`): sign bit clear and 0 < bits <= the bits of +inf (NaN is not positive, +inf is).
//
// Layout (benchmarks/results/roofline_cuda.md has the traffic and the expected bandwidth):
// - A warp handles a tile of MASK_WORDS = 8 words of 32 flags (256 consecutive elements) per iteration; lane l
//   reads elements tile + 32k + l, k = 0..7 (each a coalesced warp-wide load: 32 consecutive elements; the 8
//   loads are independent, so all are in flight before the first vote), and `__ballot_sync` turns each row of 32
//   flags into its word: bit l of word k is element 32k + l, exactly the little-endian byte order of the format.
//   Every lane holds the 8 words; lane 0 stores the tile's 32 payload bytes (one sector) as two 16-byte vectors.
// - Decode is the mirror image: every lane reads the tile's 8 words (two 16-byte loads of one address, served as
//   a broadcast), lane l writes element 32k + l (a coalesced warp-wide store). The value written for a set bit is
//   1 of the output dtype, or `*scale` (a device scalar of the output dtype, copied bit for bit) when scale is not
//   null.
// - Whole tiles (all but the last) run without bounds checks. The last tile, and every tile of a payload not
//   16-byte aligned (a view the caller made; the codecs' payloads are allocations), take the general path: lane k
//   handles word k, as a 32-bit word when the payload pointer is 4-byte aligned and the word lies wholly inside
//   the payload, else byte by byte, never past its last byte (shuffles hand the words to every lane in decode).
// - Warps stride over the tiles (the grid is at most one wave of resident blocks, from the launcher); the loop
//   condition is warp-uniform, so every vote and shuffle has the whole warp.
// - Encode reads x once and writes each payload byte once; decode reads each payload byte once and writes each
//   output element once.

#define MASK_BYTES 4
#define MASK_WORDS 8
#define MASK_TILE (32 * MASK_WORDS)

// the flag of element i, from its raw bits (see above)
template <int DTYPE, bool POSITIVE>
__device__ __forceinline__ bool mask_flag(const void* __restrict__ x, long long i) {
    if (DTYPE == MASK_BYTES) return ((const unsigned char*)x)[i] != 0;
    if (DTYPE == DTYPE_FLOAT64) {
        const unsigned long long v = ((const unsigned long long*)x)[i];
        return POSITIVE ? v - 1ull < 0x7ff0000000000000ull : (v << 1) != 0ull;
    }
    if (DTYPE == DTYPE_FLOAT32) {
        const unsigned int v = ((const unsigned int*)x)[i];
        return POSITIVE ? v - 1u < 0x7f800000u : (v << 1) != 0u;
    }
    const unsigned int v = ((const unsigned short*)x)[i];
    return POSITIVE ? v - 1u < (DTYPE == DTYPE_FLOAT16 ? 0x7c00u : 0x7f80u) : (v & 0x7fffu) != 0u;
}

// the tile's 8 words at `byte` of the payload: whole tiles of a 16-byte aligned payload as two 16-byte vectors, else
// lane k its word k, as a word when it lies wholly inside the payload and is aligned, else byte by byte, never past
// the payload's last byte
__device__ __forceinline__ void store_tile(unsigned char* __restrict__ bits, long long byte, long long nbytes,
                                          bool vector, bool words, int lane, const unsigned int word[MASK_WORDS]) {
    if (vector) {
        if (lane == 0) {
            uint4 a, b;
            a.x = word[0]; a.y = word[1]; a.z = word[2]; a.w = word[3];
            b.x = word[4]; b.y = word[5]; b.z = word[6]; b.w = word[7];
            ((uint4*)(bits + byte))[0] = a;
            ((uint4*)(bits + byte))[1] = b;
        }
        return;
    }
    unsigned int mine = 0u;
#pragma unroll
    for (int k = 0; k < MASK_WORDS; ++k)
        if (lane == k) mine = word[k];
    byte += 4 * lane;
    if (lane >= MASK_WORDS || byte >= nbytes) return;
    if (words && byte + 4 <= nbytes) {
        *(unsigned int*)(bits + byte) = mine;
    } else {
#pragma unroll
        for (int b = 0; b < 4; ++b)
            if (byte + b < nbytes) bits[byte + b] = (unsigned char)(mine >> (8 * b));
    }
}

template <int DTYPE, bool POSITIVE>
__device__ __noinline__ void encode_tiles(const void* __restrict__ x, long long numel,
                                          unsigned char* __restrict__ bits) {
    const int lane = threadIdx.x & 31;
    const long long nbytes = (numel + 7) >> 3;
    const long long tiles = (numel + MASK_TILE - 1) / MASK_TILE;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const bool words = ((unsigned long long)bits & 3ull) == 0, vectors = aligned16(bits);
    for (long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tile < tiles;
         tile += warps) {
        const long long first = tile * MASK_TILE;
        const bool whole = first + MASK_TILE <= numel;  // warp-uniform: every element of the tile is inside x
        bool flag[MASK_WORDS];
        if (whole) {
#pragma unroll
            for (int k = 0; k < MASK_WORDS; ++k) flag[k] = mask_flag<DTYPE, POSITIVE>(x, first + 32 * k + lane);
        } else {
#pragma unroll
            for (int k = 0; k < MASK_WORDS; ++k) {
                const long long i = first + 32 * k + lane;
                flag[k] = i < numel && mask_flag<DTYPE, POSITIVE>(x, i);
            }
        }
        unsigned int word[MASK_WORDS];
#pragma unroll
        for (int k = 0; k < MASK_WORDS; ++k) word[k] = __ballot_sync(FULL_WARP, flag[k]);
        store_tile(bits, tile * (4 * MASK_WORDS), nbytes, whole && vectors, words, lane, word);
    }
}

// Encode: the flags of x (numel elements of x_dtype) packed into (numel + 7) / 8 bytes. positive: x > 0 (floats),
// else x != 0. Block and grid: lightning_act/cuda/masks.py (whole warps, no shared memory); at most 256 threads a
// block and 32 registers a thread, so 8 blocks (2048 threads) fit on a multiprocessor.
extern "C" __global__ void __launch_bounds__(256, 8)
    mask_encode(const void* __restrict__ x, long long numel, int x_dtype, int positive,
                unsigned char* __restrict__ bits) {
    if (positive) {
        switch (x_dtype) {
            case DTYPE_FLOAT32: encode_tiles<DTYPE_FLOAT32, true>(x, numel, bits); break;
            case DTYPE_FLOAT16: encode_tiles<DTYPE_FLOAT16, true>(x, numel, bits); break;
            case DTYPE_BFLOAT16: encode_tiles<DTYPE_BFLOAT16, true>(x, numel, bits); break;
            case DTYPE_FLOAT64: encode_tiles<DTYPE_FLOAT64, true>(x, numel, bits); break;
            default: encode_tiles<MASK_BYTES, false>(x, numel, bits);  // bytes: positive is non-zero
        }
    } else {
        switch (x_dtype) {
            case DTYPE_FLOAT32: encode_tiles<DTYPE_FLOAT32, false>(x, numel, bits); break;
            case DTYPE_FLOAT16: encode_tiles<DTYPE_FLOAT16, false>(x, numel, bits); break;
            case DTYPE_BFLOAT16: encode_tiles<DTYPE_BFLOAT16, false>(x, numel, bits); break;
            case DTYPE_FLOAT64: encode_tiles<DTYPE_FLOAT64, false>(x, numel, bits); break;
            default: encode_tiles<MASK_BYTES, false>(x, numel, bits);
        }
    }
}

// the tile's 8 words at `byte` of the payload, in every lane: whole tiles of a 16-byte aligned payload as two 16-byte
// vectors each lane reads (one address: one broadcast transaction), else lane k reads word k as store_tile writes it
// and shuffles hand it out
__device__ __forceinline__ void load_tile(const unsigned char* __restrict__ bits, long long byte, long long nbytes,
                                          bool vector, bool words, int lane, unsigned int word[MASK_WORDS]) {
    if (vector) {
        const uint4 a = ((const uint4*)(bits + byte))[0], b = ((const uint4*)(bits + byte))[1];
        word[0] = a.x; word[1] = a.y; word[2] = a.z; word[3] = a.w;
        word[4] = b.x; word[5] = b.y; word[6] = b.z; word[7] = b.w;
        return;
    }
    unsigned int mine = 0u;
    byte += 4 * lane;
    if (lane < MASK_WORDS && byte < nbytes) {
        if (words && byte + 4 <= nbytes) {
            mine = *(const unsigned int*)(bits + byte);
        } else {
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (byte + b < nbytes) mine |= (unsigned int)bits[byte + b] << (8 * b);
        }
    }
#pragma unroll
    for (int k = 0; k < MASK_WORDS; ++k) word[k] = __shfl_sync(FULL_WARP, mine, k);
}

// T: the output's raw type (its size); one: the bits of 1 in the output dtype
template <typename T>
__device__ __noinline__ void decode_tiles(const unsigned char* __restrict__ bits, long long numel,
                                          const T* __restrict__ scale, T one, T* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const unsigned int lane_bit = 1u << lane;
    const long long nbytes = (numel + 7) >> 3;
    const long long tiles = (numel + MASK_TILE - 1) / MASK_TILE;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const bool words = ((unsigned long long)bits & 3ull) == 0, vectors = aligned16(bits);
    const T value = scale != 0 ? *scale : one;
    const T zero = (T)0;
    for (long long tile = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); tile < tiles;
         tile += warps) {
        const long long first = tile * MASK_TILE;
        const bool whole = first + MASK_TILE <= numel;  // warp-uniform
        unsigned int word[MASK_WORDS];
        load_tile(bits, tile * (4 * MASK_WORDS), nbytes, whole && vectors, words, lane, word);
        if (whole) {
#pragma unroll
            for (int k = 0; k < MASK_WORDS; ++k) out[first + 32 * k + lane] = (word[k] & lane_bit) ? value : zero;
        } else {
#pragma unroll
            for (int k = 0; k < MASK_WORDS; ++k) {
                const long long i = first + 32 * k + lane;
                if (i < numel) out[i] = (word[k] & lane_bit) ? value : zero;
            }
        }
    }
}

// Decode: numel elements of out_dtype, 1 (or *scale, when scale is not null: a scalar of out_dtype) where the bit
// is set, else 0. Block and grid: as encode's.
extern "C" __global__ void __launch_bounds__(256, 8)
    mask_decode(const unsigned char* __restrict__ bits, long long numel, const void* __restrict__ scale,
                int out_dtype, void* __restrict__ out) {
    switch (out_dtype) {
        case DTYPE_FLOAT32:
            decode_tiles<unsigned int>(bits, numel, (const unsigned int*)scale, 0x3f800000u, (unsigned int*)out);
            break;
        case DTYPE_FLOAT16:
            decode_tiles<unsigned short>(bits, numel, (const unsigned short*)scale, (unsigned short)0x3c00u,
                                         (unsigned short*)out);
            break;
        case DTYPE_BFLOAT16:
            decode_tiles<unsigned short>(bits, numel, (const unsigned short*)scale, (unsigned short)0x3f80u,
                                         (unsigned short*)out);
            break;
        case DTYPE_FLOAT64:
            decode_tiles<unsigned long long>(bits, numel, (const unsigned long long*)scale, 0x3ff0000000000000ull,
                                             (unsigned long long*)out);
            break;
        default:
            decode_tiles<unsigned char>(bits, numel, (const unsigned char*)scale, (unsigned char)1u,
                                        (unsigned char*)out);
    }
}
