// Kernels of the `division` codec. lightning_act/formats/division.py (low_frequency_copy, upsample_nearest,
// division_encode_reference, division_decode_reference) is the specification, bit for bit, with the
// quantization rule of lightning_act/formats/quantize.py (one group per plane, bfloat16 statistics).
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names; every
// float32 operation is an explicit __f*_rn intrinsic (no contracted multiply-add); 64-bit element offsets,
// 32-bit offsets inside a plane (the launcher refuses planes of 2**31 elements or more).
// The launcher prepends common.cuh (RNG, 16-bit floats, round_stats, quantize_one, chunks). x_dtype /
// out_dtype: any DTYPE_* of common.cuh (float64 read as float32, rounded once; written exactly); NaN stored
// canonical.
//
// A tensor is `planes` planes of d0 x d1 x d2 elements (1D and 2D layouts have leading dims of size 1, whose
// block size b is 1, so they add no padding and no term to any sum). Two kernels, one block per plane
// (grid-stride over planes, the grid sized to the SM count by the launcher), no host synchronisation:
//   division_encode  the whole encode in one pass over DRAM: the plane is read once with 16-byte loads into
//                    shared memory (when it fits: `stage`), then, from there, the block means (lfc, one thread a
//                    cell, the spec's order of adds), the residual's min/max (shuffles, then shared memory
//                    across warps) and rounded statistics, and the codes
//   division_decode  mn + q * step + upsampled lfc in the output dtype, 16-byte stores
// Codes are packed per 8-element chunk of the flat tensor (a chunk's codes are `bits` whole payload bytes).
// A chunk inside one plane is written with one plain store; a chunk shared by two planes (plane sizes that are
// not multiples of 8) is written by each plane's block with a masked compare-and-swap on the 32-bit words
// holding it, so neither overwrites the other's bits. Those words may extend past the payload's last byte: the
// launcher allocates the payload 16-byte aligned with its padding (launcher.one_buffer), and a masked swap
// leaves the bytes outside the mask as they are.

struct DivisionLayout {
    int plane;                  // elements per plane: d0 * d1 * d2
    int cells;                  // pooled cells per plane: n0 * n1 * n2
    int d0, d1, d2;             // spatial sizes
    int b0, b1, b2;             // block size per spatial dim
    int n0, n1, n2;             // blocks per spatial dim
};

__device__ __forceinline__ DivisionLayout division_layout(int d0, int d1, int d2, int b0, int b1, int b2) {
    DivisionLayout l;
    l.d0 = d0; l.d1 = d1; l.d2 = d2;
    l.b0 = b0; l.b1 = b1; l.b2 = b2;
    l.n0 = (d0 + b0 - 1) / b0; l.n1 = (d1 + b1 - 1) / b1; l.n2 = (d2 + b2 - 1) / b2;
    l.plane = d0 * d1 * d2;
    l.cells = l.n0 * l.n1 * l.n2;
    return l;
}

// Walks a plane in memory order from element k, keeping the pooled cell of the current element without a
// division per element: (i, j) = index and offset inside the block per dim, `cell` the cell's index.
struct PlaneWalk {
    int i0, i1, i2, j0, j1, j2, row_cell, cell;
};

__device__ __forceinline__ PlaneWalk plane_walk(const DivisionLayout& l, int k) {
    PlaneWalk w;
    w.i2 = k % l.d2;
    const int rest = k / l.d2;
    w.i1 = rest % l.d1;
    w.i0 = rest / l.d1;
    w.j0 = w.i0 % l.b0; w.j1 = w.i1 % l.b1; w.j2 = w.i2 % l.b2;
    w.row_cell = ((w.i0 / l.b0) * l.n1 + w.i1 / l.b1) * l.n2;
    w.cell = w.row_cell + w.i2 / l.b2;
    return w;
}

__device__ __forceinline__ void plane_step(const DivisionLayout& l, PlaneWalk& w) {
    if (++w.i2 < l.d2) {
        if (++w.j2 == l.b2) {
            w.j2 = 0;
            ++w.cell;
        }
        return;
    }
    w.i2 = w.j2 = 0;
    if (++w.i1 < l.d1) {
        if (++w.j1 == l.b1) {
            w.j1 = 0;
            w.row_cell += l.n2;
        }
    } else {
        w.i1 = w.j1 = 0;
        ++w.i0;
        if (++w.j0 == l.b0) w.j0 = 0;
        w.row_cell = ((w.i0 / l.b0) * l.n1) * l.n2;
    }
    w.cell = w.row_cell;
}

// (assumed & ~mask) | (value & mask) into *word, atomically: bits outside the mask are never changed
__device__ __forceinline__ void store_bits_masked(unsigned int* word, unsigned int value, unsigned int mask) {
    unsigned int assumed, old = *word;
    do {
        assumed = old;
        old = atomicCAS(word, assumed, (assumed & ~mask) | (value & mask));
    } while (old != assumed);
}

// The codes of chunk `c` (8 elements from 8c: `bits` bytes at byte c * bits), `mask` the bits this block owns.
__device__ __forceinline__ void store_chunk_codes(unsigned char* payload, long long c, int bits, bool whole,
                                                  bool vector, const unsigned int word[2],
                                                  const unsigned int mask[2]) {
    const long long byte = c * bits;
    if (whole) {
        if (vector && bits == 8) {
            uint2 w;
            w.x = word[0];
            w.y = word[1];
            *(uint2*)(payload + byte) = w;
        } else if (vector && bits == 4) {
            *(unsigned int*)(payload + byte) = word[0];
        } else if (vector && bits == 2) {
            *(unsigned short*)(payload + byte) = (unsigned short)word[0];
        } else {
            for (int k = 0; k < bits; ++k) payload[byte + k] = (unsigned char)(word[k >> 2] >> (8 * (k & 3)));
        }
        return;
    }
    // shared with another plane's block: masked swaps on the aligned words holding the chunk's bytes (bits <= 4:
    // one word, the chunk's bytes sit at byte & 3; bits == 8: two words)
    unsigned int* words = (unsigned int*)(payload + (byte & ~3ll));
    const int shift = 8 * (int)(byte & 3);
    if (mask[0]) store_bits_masked(words, word[0] << shift, mask[0] << shift);
    if (bits == 8 && mask[1]) store_bits_masked(words + 1, word[1], mask[1]);
}

// The largest plane staged in shared memory (float32), within the 48 KiB a block gets without opting in.
#define DIVISION_STAGE_MAX 12288

template <int DTYPE>
__device__ __noinline__ void encode_planes(const void* __restrict__ x, long long planes, const DivisionLayout l,
                                           int bits, unsigned int rng_base, unsigned short* __restrict__ lfc,
                                           unsigned char* __restrict__ payload,
                                           unsigned short* __restrict__ mn_out,
                                           unsigned short* __restrict__ step_out, bool stage, float* staged,
                                           float* warp_lo, float* warp_hi) {
    const int levels = (1 << bits) - 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const long long numel = planes * l.plane;
    const long long payload_bytes = (numel * bits + 7) >> 3;
    const bool payload_vector = ((unsigned long long)payload & 7ull) == 0;
    const int itemsize = DTYPE == DTYPE_FLOAT64 ? 8 : DTYPE == DTYPE_FLOAT32 ? 4 : 2;
    for (long long p = blockIdx.x; p < planes; p += gridDim.x) {
        const long long base = p * l.plane;
        unsigned short* const plane_lfc = lfc + p * l.cells;
        // the plane's only read from DRAM: 16-byte loads of whole chunks when the plane starts aligned
        if (stage) {
            const bool vector = aligned16((const char*)x + base * itemsize);
            for (int k = CHUNK * threadIdx.x; k < l.plane; k += CHUNK * blockDim.x) {
                const int count = min(CHUNK, l.plane - k);
                float v[CHUNK];
                load_chunk<DTYPE>(x, base + k, vector && count == CHUNK, count, v);
                for (int j = 0; j < count; ++j) staged[k + j] = v[j];
            }
            __syncthreads();
        }
#define PLANE_VALUE(k) (stage ? staged[k] : load_float(x, base + (k), DTYPE))
        // block means: one thread a cell; the last spatial dim is folded first, each fold a left-to-right chain
        // from its first term; elements beyond the tensor are the zeros of the spec's padding (-0 + 0 = +0)
        for (int c = threadIdx.x; c < l.cells; c += blockDim.x) {
            const int c2 = c % l.n2, c1 = (c / l.n2) % l.n1, c0 = c / (l.n2 * l.n1);
            float sum0 = 0.0f;
            for (int j0 = 0; j0 < l.b0; ++j0) {
                const int i0 = c0 * l.b0 + j0;
                float sum1 = 0.0f;
                for (int j1 = 0; j1 < l.b1; ++j1) {
                    const int i1 = c1 * l.b1 + j1;
                    float sum2 = 0.0f;
                    for (int j2 = 0; j2 < l.b2; ++j2) {
                        const int i2 = c2 * l.b2 + j2;
                        const float v = (i0 < l.d0 && i1 < l.d1 && i2 < l.d2)
                            ? PLANE_VALUE((i0 * l.d1 + i1) * l.d2 + i2) : 0.0f;
                        sum2 = j2 == 0 ? v : __fadd_rn(sum2, v);
                    }
                    sum1 = j1 == 0 ? sum2 : __fadd_rn(sum1, sum2);
                }
                sum0 = j0 == 0 ? sum1 : __fadd_rn(sum0, sum1);
            }
            // elements of the block inside the tensor, multiplied dim by dim like the spec's count (exact)
            const float e0 = (float)min(l.b0, l.d0 - c0 * l.b0), e1 = (float)min(l.b1, l.d1 - c1 * l.b1);
            const float e2 = (float)min(l.b2, l.d2 - c2 * l.b2);
            plane_lfc[c] = float_to_bf16(__fdiv_rn(sum0, __fmul_rn(__fmul_rn(e0, e1), e2)));
        }
        __syncthreads();  // the block's lfc stores are visible to the whole block
        // min / max of the residual x - upsampled lfc: 8 consecutive elements a thread (fminf / fmaxf and a NaN
        // flag: torch.amin / amax propagate NaN), then shuffles and one vote, then shared memory across warps,
        // reduced in the same order by every thread
        float lo = __uint_as_float(0x7f800000u), hi = __uint_as_float(0xff800000u);
        bool nan = false;
        for (int k0 = CHUNK * threadIdx.x; k0 < l.plane; k0 += CHUNK * blockDim.x) {
            PlaneWalk w = plane_walk(l, k0);
            const int count = min(CHUNK, l.plane - k0);
            for (int j = 0; j < count; ++j) {
                const float r = __fsub_rn(PLANE_VALUE(k0 + j), bf16_to_float(plane_lfc[w.cell]));
                lo = fminf(lo, r);
                hi = fmaxf(hi, r);
                nan = nan || r != r;
                plane_step(l, w);
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            lo = fminf(lo, __shfl_xor_sync(FULL_WARP, lo, offset));
            hi = fmaxf(hi, __shfl_xor_sync(FULL_WARP, hi, offset));
        }
        if (__ballot_sync(FULL_WARP, nan)) lo = hi = __uint_as_float(CANONICAL_NAN_F32);
        if (lane == 0) {
            warp_lo[warp] = lo;
            warp_hi[warp] = hi;
        }
        __syncthreads();
        lo = warp_lo[0];
        hi = warp_hi[0];
        for (int i = 1; i < warps; ++i) {
            lo = nan_min(lo, warp_lo[i]);
            hi = nan_max(hi, warp_hi[i]);
        }
        float mn, step;
        round_stats(lo, hi, levels, DTYPE_BFLOAT16, mn_out, step_out, p, threadIdx.x == 0, &mn, &step);
        const float inv = step > 0.0f ? __frcp_rn(step) : 0.0f;
        // codes, per 8-element chunk of the flat tensor that meets this plane; the block of the plane holding the
        // tensor's last element also writes the zero codes that pad the payload's last byte
        const long long first_chunk = base >> 3, last_chunk = (base + l.plane - 1) >> 3;
        const bool last_plane = p == planes - 1;
        for (long long c = first_chunk + threadIdx.x; c <= last_chunk; c += blockDim.x) {
            const long long e0 = c * CHUNK;
            const bool whole = e0 >= base && e0 + CHUNK <= base + l.plane;
            const int k_first = (int)(max(e0, base) - base);
            PlaneWalk w = plane_walk(l, k_first);
            const unsigned int noise = uniform24_chunk(uniform24_key(rng_base, e0), e0);
            unsigned int word[2] = {0u, 0u}, mask[2] = {0u, 0u};
            for (int j = 0; j < CHUNK; ++j) {
                const long long e = e0 + j;
                const int shift = (j * bits) & 31, half = (j * bits) >> 5;
                if (e >= base && e < base + l.plane) {
                    const int k = (int)(e - base);
                    const float r = __fsub_rn(PLANE_VALUE(k), bf16_to_float(plane_lfc[w.cell]));
                    word[half] |= quantize_one(r, mn, inv, uniform24_element(noise, j), levels) << shift;
                    mask[half] |= (unsigned int)levels << shift;
                    plane_step(l, w);
                } else if (last_plane && e >= numel && ((e * bits) >> 3) < payload_bytes) {
                    mask[half] |= (unsigned int)levels << shift;  // padding: code 0
                }
            }
            store_chunk_codes(payload, c, bits, whole, payload_vector, word, mask);
        }
#undef PLANE_VALUE
        __syncthreads();  // the next plane reuses `staged` and warp_lo / warp_hi
    }
}

// Block: 32 to 256 threads (a thread per 8 elements of a plane; __launch_bounds__ keeps 4 blocks of 256, 64
// registers a thread, resident an SM), dynamic shared memory plane * 4 bytes when
// `stage` (plane <= DIVISION_STAGE_MAX), else 0 and the plane is read from global memory (L2) in each phase.
extern "C" __global__ void __launch_bounds__(256, 4)
    division_encode(const void* __restrict__ x, int x_dtype, long long planes, int d0, int d1, int d2, int b0,
                    int b1, int b2, int bits, unsigned int rng_base, int stage, unsigned short* __restrict__ lfc,
                    unsigned char* __restrict__ payload, unsigned short* __restrict__ mn_out,
                    unsigned short* __restrict__ step_out) {
    DYNAMIC_SHARED(float, staged);
    __shared__ float warp_lo[32], warp_hi[32];
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
#define DIVISION_ENCODE_ARGS x, planes, l, bits, rng_base, lfc, payload, mn_out, step_out, stage != 0, staged, \
                             warp_lo, warp_hi
    switch (x_dtype) {
        case DTYPE_FLOAT32: encode_planes<DTYPE_FLOAT32>(DIVISION_ENCODE_ARGS); break;
        case DTYPE_FLOAT16: encode_planes<DTYPE_FLOAT16>(DIVISION_ENCODE_ARGS); break;
        case DTYPE_BFLOAT16: encode_planes<DTYPE_BFLOAT16>(DIVISION_ENCODE_ARGS); break;
        default: encode_planes<DTYPE_FLOAT64>(DIVISION_ENCODE_ARGS);
    }
}

// Decode: one block a plane, a thread per 8-element chunk of the flat tensor meeting it (its codes: `bits` bytes,
// one load), 16-byte stores of whole chunks.
template <int DTYPE>
__device__ __noinline__ void decode_planes(const unsigned char* __restrict__ payload,
                                           const unsigned short* __restrict__ lfc,
                                           const unsigned short* __restrict__ mn_in,
                                           const unsigned short* __restrict__ step_in, long long planes,
                                           const DivisionLayout l, int bits, void* __restrict__ out) {
    const unsigned int code_mask = (1u << bits) - 1u;
    const long long numel = planes * l.plane;
    const long long payload_bytes = (numel * bits + 7) >> 3;
    const bool payload_vector = ((unsigned long long)payload & 7ull) == 0, out_vector = aligned16(out);
    for (long long p = blockIdx.x; p < planes; p += gridDim.x) {
        const long long base = p * l.plane;
        const unsigned short* const plane_lfc = lfc + p * l.cells;
        const float mn = bf16_to_float(mn_in[p]), step = bf16_to_float(step_in[p]);
        const long long first_chunk = base >> 3, last_chunk = (base + l.plane - 1) >> 3;
        for (long long c = first_chunk + threadIdx.x; c <= last_chunk; c += blockDim.x) {
            const long long e0 = c * CHUNK, byte = c * bits;
            const bool whole = e0 >= base && e0 + CHUNK <= base + l.plane;
            unsigned int word[2] = {0u, 0u};
            if (e0 + CHUNK <= numel && payload_vector) {
                if (bits == 8) {
                    const uint2 v = *(const uint2*)(payload + byte);
                    word[0] = v.x;
                    word[1] = v.y;
                } else if (bits == 4) {
                    word[0] = *(const unsigned int*)(payload + byte);
                } else if (bits == 2) {
                    word[0] = *(const unsigned short*)(payload + byte);
                } else {
                    word[0] = payload[byte];
                }
            } else {
                for (int k = 0; k < bits; ++k)
                    if (byte + k < payload_bytes) word[k >> 2] |= (unsigned int)payload[byte + k] << (8 * (k & 3));
            }
            const int k_first = (int)(max(e0, base) - base);
            PlaneWalk w = plane_walk(l, k_first);
            float v[CHUNK];
            for (int j = 0; j < CHUNK; ++j) {
                const long long e = e0 + j;
                v[j] = 0.0f;
                if (e >= base && e < base + l.plane) {
                    const unsigned int code = (word[(j * bits) >> 5] >> ((j * bits) & 31)) & code_mask;
                    const float residual = __fadd_rn(__fmul_rn((float)code, step), mn);
                    v[j] = __fadd_rn(residual, bf16_to_float(plane_lfc[w.cell]));
                    plane_step(l, w);
                }
            }
            if (whole) {
                store_chunk<DTYPE>(out, e0, out_vector, CHUNK, v);
            } else {
                for (int j = 0; j < CHUNK; ++j)
                    if (e0 + j >= base && e0 + j < base + l.plane) store_float(out, e0 + j, DTYPE, v[j]);
            }
        }
    }
}

// Block and grid: as encode's, no shared memory.
extern "C" __global__ void __launch_bounds__(256, 4)
    division_decode(const unsigned char* __restrict__ payload, const unsigned short* __restrict__ lfc,
                    const unsigned short* __restrict__ mn_in, const unsigned short* __restrict__ step_in,
                    long long planes, int d0, int d1, int d2, int b0, int b1, int b2, int bits,
                    void* __restrict__ out, int out_dtype) {
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
#define DIVISION_DECODE_ARGS payload, lfc, mn_in, step_in, planes, l, bits, out
    switch (out_dtype) {
        case DTYPE_FLOAT32: decode_planes<DTYPE_FLOAT32>(DIVISION_DECODE_ARGS); break;
        case DTYPE_FLOAT16: decode_planes<DTYPE_FLOAT16>(DIVISION_DECODE_ARGS); break;
        case DTYPE_BFLOAT16: decode_planes<DTYPE_BFLOAT16>(DIVISION_DECODE_ARGS); break;
        default: decode_planes<DTYPE_FLOAT64>(DIVISION_DECODE_ARGS);
    }
}
