// Kernels of the `division` codec. lightning_act/codecs/division.py (low_frequency_copy, upsample_nearest,
// division_encode_reference, division_decode_reference) is the specification, bit for bit, with the
// quantization rule of lightning_act/codecs/quantize.py (one group per plane, bfloat16 statistics).
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names; every
// float32 operation is an explicit __f*_rn intrinsic (no contracted multiply-add); 64-bit element offsets.
// The launcher prepends common.cuh (RNG, 16-bit floats, round_stats, quantize_one). x_dtype / out_dtype: any
// DTYPE_* of common.cuh (float64 read as float32, rounded once; written exactly); NaN stored canonical.
//
// A tensor is `planes` planes of d0 x d1 x d2 elements (1D and 2D layouts have leading dims of size 1, whose
// block size b is 1, so they add no padding and no term to any sum). Four kernels, no host synchronisation:
//   division_lfc     one thread per pooled cell: the block's sum in the spec's order, / count, -> bfloat16
//   division_stats   one block per plane: min/max of the residual x - upsampled lfc, rounded statistics
//   division_encode  one thread per payload byte: the codes of the elements that byte holds
//   division_decode  one thread per element: mn + q * step + upsampled lfc, in the output dtype
// Residual values are recomputed from x and the lfc where needed instead of being stored.

struct DivisionLayout {
    long long plane;            // elements per plane: d0 * d1 * d2
    long long cells;            // pooled cells per plane: n0 * n1 * n2
    int d0, d1, d2;             // spatial sizes
    int b0, b1, b2;             // block size per spatial dim
    int n0, n1, n2;             // blocks per spatial dim
};

__device__ __forceinline__ DivisionLayout division_layout(int d0, int d1, int d2, int b0, int b1, int b2) {
    DivisionLayout l;
    l.d0 = d0; l.d1 = d1; l.d2 = d2;
    l.b0 = b0; l.b1 = b1; l.b2 = b2;
    l.n0 = (d0 + b0 - 1) / b0; l.n1 = (d1 + b1 - 1) / b1; l.n2 = (d2 + b2 - 1) / b2;
    l.plane = (long long)d0 * d1 * d2;
    l.cells = (long long)l.n0 * l.n1 * l.n2;
    return l;
}

// Index of the pooled cell holding element e (row-major over planes x d0 x d1 x d2).
__device__ __forceinline__ long long division_cell(const DivisionLayout& l, long long e) {
    const long long plane = e / l.plane, k = e - plane * l.plane;
    const int i2 = (int)(k % l.d2);
    const long long rest = k / l.d2;
    const int i1 = (int)(rest % l.d1), i0 = (int)(rest / l.d1);
    return plane * l.cells + ((long long)(i0 / l.b0) * l.n1 + i1 / l.b1) * l.n2 + i2 / l.b2;
}

// x - nearest-upsampled lfc, one float32 subtraction (division_encode_reference's residual)
__device__ __forceinline__ float division_residual(const void* x, int x_dtype, const unsigned short* lfc,
                                                   const DivisionLayout& l, long long e) {
    return __fsub_rn(load_float(x, e, x_dtype), bf16_to_float(lfc[division_cell(l, e)]));
}

// Sums of one block: the last spatial dim is folded first, each fold a left-to-right chain starting from its
// first term; elements beyond the tensor are the zeros of the spec's padding (they matter: -0 + 0 = +0).
extern "C" __global__ void division_lfc(const void* __restrict__ x, int x_dtype, long long planes, int d0, int d1,
                                        int d2, int b0, int b1, int b2, unsigned short* __restrict__ lfc) {
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
    const long long total = planes * l.cells;
    for (long long cell = (long long)blockIdx.x * blockDim.x + threadIdx.x; cell < total;
         cell += (long long)gridDim.x * blockDim.x) {
        const long long plane = cell / l.cells;
        const long long c = cell - plane * l.cells;
        const int c2 = (int)(c % l.n2), c1 = (int)((c / l.n2) % l.n1), c0 = (int)(c / ((long long)l.n2 * l.n1));
        const long long base = plane * l.plane;
        float sum0 = 0.0f;
        for (int j0 = 0; j0 < b0; ++j0) {
            const int i0 = c0 * b0 + j0;
            float sum1 = 0.0f;
            for (int j1 = 0; j1 < b1; ++j1) {
                const int i1 = c1 * b1 + j1;
                float sum2 = 0.0f;
                for (int j2 = 0; j2 < b2; ++j2) {
                    const int i2 = c2 * b2 + j2;
                    const float v = (i0 < d0 && i1 < d1 && i2 < d2)
                        ? load_float(x, base + ((long long)i0 * d1 + i1) * d2 + i2, x_dtype) : 0.0f;
                    sum2 = j2 == 0 ? v : __fadd_rn(sum2, v);
                }
                sum1 = j1 == 0 ? sum2 : __fadd_rn(sum1, sum2);
            }
            sum0 = j0 == 0 ? sum1 : __fadd_rn(sum0, sum1);
        }
        // elements of the block inside the tensor, multiplied dim by dim like the spec's count (exact)
        const float e0 = (float)min(b0, d0 - c0 * b0), e1 = (float)min(b1, d1 - c1 * b1);
        const float e2 = (float)min(b2, d2 - c2 * b2);
        lfc[cell] = float_to_bf16(__fdiv_rn(sum0, __fmul_rn(__fmul_rn(e0, e1), e2)));
    }
}

// Block: 256 threads (8 warps) per plane, grid-stride over planes.
extern "C" __global__ void division_stats(const void* __restrict__ x, int x_dtype,
                                          const unsigned short* __restrict__ lfc, long long planes, int d0, int d1,
                                          int d2, int b0, int b1, int b2, int bits,
                                          unsigned short* __restrict__ mn_out, unsigned short* __restrict__ step_out) {
    __shared__ float warp_lo[32], warp_hi[32];
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (long long plane = blockIdx.x; plane < planes; plane += gridDim.x) {
        const long long first = plane * l.plane;
        float lo = __uint_as_float(0x7f800000u), hi = __uint_as_float(0xff800000u);
        for (long long k = threadIdx.x; k < l.plane; k += blockDim.x) {
            const float r = division_residual(x, x_dtype, lfc, l, first + k);
            lo = nan_min(lo, r);
            hi = nan_max(hi, r);
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            lo = nan_min(lo, __shfl_xor_sync(FULL_WARP, lo, offset));
            hi = nan_max(hi, __shfl_xor_sync(FULL_WARP, hi, offset));
        }
        if (lane == 0) {
            warp_lo[warp] = lo;
            warp_hi[warp] = hi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < warps; ++w) {
                lo = nan_min(lo, warp_lo[w]);
                hi = nan_max(hi, warp_hi[w]);
            }
            float mn, step;
            round_stats(lo, hi, (1 << bits) - 1, DTYPE_BFLOAT16, mn_out, step_out, plane, true, &mn, &step);
        }
        __syncthreads();  // warp_lo/hi are reused by the next plane
    }
}

// One thread per payload byte: element e sits at bit (e * bits) of the little-endian byte stream, planes
// packed back to back (a byte may hold the end of one plane and the start of the next).
extern "C" __global__ void division_encode(const void* __restrict__ x, int x_dtype,
                                           const unsigned short* __restrict__ lfc,
                                           const unsigned short* __restrict__ mn_in,
                                           const unsigned short* __restrict__ step_in, long long numel, int d0,
                                           int d1, int d2, int b0, int b1, int b2, int bits, unsigned int rng_base,
                                           unsigned char* __restrict__ payload) {
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
    const int per_byte = 8 / bits, levels = (1 << bits) - 1;
    const long long bytes = (numel * bits + 7) >> 3;
    for (long long byte = (long long)blockIdx.x * blockDim.x + threadIdx.x; byte < bytes;
         byte += (long long)gridDim.x * blockDim.x) {
        unsigned int packed = 0;
        for (int j = 0; j < per_byte; ++j) {
            const long long e = byte * per_byte + j;
            if (e >= numel) break;
            const long long plane = e / l.plane;
            const float mn = bf16_to_float(mn_in[plane]), step = bf16_to_float(step_in[plane]);
            const float inv = step > 0.0f ? __frcp_rn(step) : 0.0f;
            const float r = division_residual(x, x_dtype, lfc, l, e);
            packed |= quantize_one(r, mn, inv, uniform24(rng_base, e), levels) << (j * bits);
        }
        payload[byte] = (unsigned char)packed;
    }
}

extern "C" __global__ void division_decode(const unsigned char* __restrict__ payload,
                                           const unsigned short* __restrict__ lfc,
                                           const unsigned short* __restrict__ mn_in,
                                           const unsigned short* __restrict__ step_in, long long numel, int d0,
                                           int d1, int d2, int b0, int b1, int b2, int bits, void* __restrict__ out,
                                           int out_dtype) {
    const DivisionLayout l = division_layout(d0, d1, d2, b0, b1, b2);
    const unsigned int code_mask = (1u << bits) - 1u;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < numel;
         e += (long long)gridDim.x * blockDim.x) {
        const long long plane = e / l.plane, bit = e * bits;
        const unsigned int code = ((unsigned int)payload[bit >> 3] >> (bit & 7)) & code_mask;
        const float residual = __fadd_rn(__fmul_rn((float)code, bf16_to_float(step_in[plane])),
                                         bf16_to_float(mn_in[plane]));
        store_float(out, e, out_dtype, __fadd_rn(residual, bf16_to_float(lfc[division_cell(l, e)])));
    }
}
