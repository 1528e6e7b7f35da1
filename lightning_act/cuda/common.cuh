// Device code shared by every kernel source in this package. NVRTC has no headers, so the launcher
// (launcher.kernel_source) prepends this text to each .cu file before compiling it; the nvcc compile test
// and the CPU emulator build the very same concatenation.
//
// lightning_act/rng.py (counter-based RNG) and lightning_act/codecs/quantize.py (_round_stats, the
// stochastic-rounding rule, CANONICAL_NAN) are the specification, bit for bit.
//
// NaN: a GPU's arithmetic returns 0x7fffffff for any NaN result, CPUs keep an operand's payload, so computed
// values never reach memory as they are: store_float, float_to_half and float_to_bf16 write the one canonical
// NaN of each dtype (quantize.py's CANONICAL_NAN). Kernels that store raw input bits (lorenzo's escapes) are
// the exception, by contract.

#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

#define FULL_WARP 0xffffffffu
#define DTYPE_FLOAT32 0
#define DTYPE_FLOAT16 1
#define DTYPE_BFLOAT16 2
#define DTYPE_FLOAT64 3
#define CANONICAL_NAN_F32 0x7fc00000u
#define CANONICAL_NAN_F16 0x7e00u
#define CANONICAL_NAN_BF16 0x7fc0u
#define CANONICAL_NAN_F64 0x7ff8000000000000ll
#define TWO_POW_MINUS_24 5.9604644775390625e-08f
#define FLOAT32_MAX 3.40282346638528859812e+38f

// ---- counter-based RNG (rng.py) ----
// mix32 after its first xor-shift (uniform24_chunk does that step once for a chunk's elements)
__device__ __forceinline__ unsigned int mix32_rest(unsigned int x) {
    x *= 0x21F0AAADu;
    x ^= x >> 15;
    x *= 0x735A2D97u;
    x ^= x >> 15;
    return x;
}
__device__ __forceinline__ unsigned int mix32(unsigned int x) { return mix32_rest(x ^ (x >> 16)); }

// rng.uniform24: mix32(lo32(i) ^ mix32(base ^ hi32(i))) >> 8, times 2**-24 (exact). Kernels draw it a chunk of 8
// elements at a time, index0 a multiple of 8 and j < 8:
// - the inner hash depends on hi32(i) only, the same for the whole chunk: uniform24_key, once a chunk;
// - lo32(index0 + j) ^ key = X ^ j with X = lo32(index0) ^ key (index0 + j = index0 | j), and mix32's first step
//   gives (X ^ j) ^ ((X ^ j) >> 16) = (X ^ (X >> 16)) ^ j: uniform24_chunk does it once a chunk, and each element
//   pays one xor and mix32_rest (uniform24_element), bit for bit rng.uniform24.
__device__ __forceinline__ unsigned int uniform24_key(unsigned int base, long long index0) {
    return mix32(base ^ (unsigned int)((unsigned long long)index0 >> 32));
}
__device__ __forceinline__ unsigned int uniform24_chunk(unsigned int key, long long index0) {
    const unsigned int x = (unsigned int)(unsigned long long)index0 ^ key;
    return x ^ (x >> 16);
}
__device__ __forceinline__ float uniform24_element(unsigned int chunk, int j) {
    return __fmul_rn((float)(mix32_rest(chunk ^ (unsigned int)j) >> 8), TWO_POW_MINUS_24);
}

// ---- 16-bit floats as raw bits, converted exactly like torch on CPU (NaN aside: canonical) ----
__device__ __forceinline__ float bf16_to_float(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }

// round to nearest even (c10::BFloat16); NaN -> the canonical NaN (NOT_NAN: f is known not to be NaN, and the
// test is left out)
template <bool NOT_NAN = false>
__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    if (!NOT_NAN && (u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)CANONICAL_NAN_BF16;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// torch.nextafter toward -inf / +inf (c10 BFloat16 nextafter); never called on NaN or on the target infinity
__device__ __forceinline__ unsigned short bf16_next_down(unsigned short b) {
    if ((b & 0x7fffu) == 0) return (unsigned short)0x8001u;
    return (unsigned short)((b & 0x8000u) ? b + 1 : b - 1);
}
__device__ __forceinline__ unsigned short bf16_next_up(unsigned short b) {
    if ((b & 0x7fffu) == 0) return (unsigned short)0x0001u;
    return (unsigned short)((b & 0x8000u) ? b - 1 : b + 1);
}

// exact: normals, subnormals, signed zeros, inf, NaN (payload kept)
__device__ __forceinline__ float half_to_float(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent != 0) return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    // zero or subnormal: mantissa * 2**-24 is exact in float32
    return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)mantissa, TWO_POW_MINUS_24)));
}

// round to nearest even, subnormals included, overflow to inf; NaN -> the canonical NaN (NOT_NAN: f is known not
// to be NaN, and the test is left out)
template <bool NOT_NAN = false>
__device__ __forceinline__ unsigned short float_to_half(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (!NOT_NAN && a > 0x7f800000u) return (unsigned short)CANONICAL_NAN_F16;
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to inf
    if (a >= 0x38800000u) {                                           // normal half: >= 2**-14
        const unsigned int rebiased = a - 0x38000000u;                // exponent bias 127 -> 15
        return (unsigned short)(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
    }
    const unsigned int exponent = a >> 23;
    if (exponent < 102u) return (unsigned short)sign;                 // below 2**-25: rounds to zero
    // subnormal half: value / 2**-24 = m * 2**(exponent - 126), m the 24-bit significand
    const unsigned int m = (a & 0x7fffffu) | 0x800000u, shift = 126u - exponent;  // 14 <= shift <= 24
    const unsigned int kept = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    return (unsigned short)(sign | (kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u)));
}

// element i as float32: float64 rounded to nearest even (torch's .float()), the others exactly
__device__ __forceinline__ float load_float(const void* p, long long i, int dtype) {
    if (dtype == DTYPE_FLOAT32) return ((const float*)p)[i];
    if (dtype == DTYPE_FLOAT64) return __double2float_rn(((const double*)p)[i]);
    const unsigned short h = ((const unsigned short*)p)[i];
    return dtype == DTYPE_FLOAT16 ? half_to_float(h) : bf16_to_float(h);
}

// v rounded into element i's dtype (float64: exact), NaN as the canonical NaN of that dtype
__device__ __forceinline__ void store_float(void* p, long long i, int dtype, float v) {
    const bool nan = v != v;
    if (dtype == DTYPE_FLOAT32) ((unsigned int*)p)[i] = nan ? CANONICAL_NAN_F32 : __float_as_uint(v);
    else if (dtype == DTYPE_FLOAT64) ((double*)p)[i] = nan ? __longlong_as_double(CANONICAL_NAN_F64) : (double)v;
    else ((unsigned short*)p)[i] = dtype == DTYPE_FLOAT16 ? float_to_half(v) : float_to_bf16(v);
}

// torch.amin / amax propagate NaN; fminf / fmaxf would drop it
__device__ __forceinline__ float nan_min(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// _round_stats: the stored statistics (NaN canonical), returned as the float32 values encode computes with
__device__ __forceinline__ void round_stats(float mn, float mx, int levels, int stats_dtype, void* mn_out,
                                            void* step_out, long long group, bool store, float* mn32,
                                            float* step32) {
    if (stats_dtype == DTYPE_FLOAT32) {
        *mn32 = mn;
        *step32 = __fdiv_rn(__fsub_rn(mx, mn), (float)levels);
        if (store) {
            store_float(mn_out, group, DTYPE_FLOAT32, *mn32);
            store_float(step_out, group, DTYPE_FLOAT32, *step32);
        }
        return;
    }
    // bfloat16: mn rounded down and step up, so the grid still covers the group
    unsigned short mn_bits = float_to_bf16(mn);
    if (bf16_to_float(mn_bits) > mn) mn_bits = bf16_next_down(mn_bits);
    *mn32 = bf16_to_float(mn_bits);
    const float step = __fdiv_rn(__fsub_rn(mx, *mn32), (float)levels);
    unsigned short step_bits = float_to_bf16(step);
    if (bf16_to_float(step_bits) < step) step_bits = bf16_next_up(step_bits);
    *step32 = bf16_to_float(step_bits);
    if (store) {
        ((unsigned short*)mn_out)[group] = mn_bits;
        ((unsigned short*)step_out)[group] = step_bits;
    }
}

// clamp(floor((x - mn) * inv + u), 0, levels), NaN -> 0, without a branch: fmaxf drops NaN and negatives to 0,
// fminf caps at levels (floor(min(t, L)) = min(floor(t), L) for an integer L), then one round-down conversion.
// Branch-free, so the compiler interleaves a chunk's elements (with the clamp as branches, each element ran as
// its own serial chain); the clamps are float instructions, which issue at twice the integer rate.
__device__ __forceinline__ unsigned int quantize_one(float x, float mn, float inv, float u, int levels) {
    const float t = __fadd_rn(__fmul_rn(__fsub_rn(x, mn), inv), u);
    return __float2uint_rd(fminf(fmaxf(t, 0.0f), (float)levels));
}

// ---- chunks of 8 consecutive elements: 16-byte vector loads and stores ----
// Chunks start at a multiple of 8 in the flat tensor (so hi32 of their indices is one, see uniform24_key). A
// chunk moves as 16-byte vectors (float32: 2, 16-bit: 1, float64: 4) when the address of its first element is
// 16-byte aligned and the chunk lies wholly inside the tensor (the caller decides: `vector`); otherwise one
// element at a time (views at odd offsets, the tensor's last chunk).
#define CHUNK 8

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

template <int DTYPE>
__device__ __forceinline__ float bits16_to_float(unsigned int h) {
    return DTYPE == DTYPE_FLOAT16 ? half_to_float((unsigned short)h) : bf16_to_float((unsigned short)h);
}

// elements e0 .. e0 + 7 as float32 (float64 rounded to nearest even); vector: the 16-byte path (element e0's
// address aligned, chunk whole), else the first `count` elements one by one and 0 for the rest (PAD_FIRST: copies
// of the first element, when there is one)
template <int DTYPE, bool PAD_FIRST = false>
__device__ __forceinline__ void load_chunk(const void* __restrict__ x, long long e0, bool vector, int count,
                                           float v[CHUNK]) {
    if (vector) {
        if (DTYPE == DTYPE_FLOAT32) {
            const float4* p = (const float4*)((const float*)x + e0);
            const float4 a = p[0], b = p[1];
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else if (DTYPE == DTYPE_FLOAT64) {
            const double2* p = (const double2*)((const double*)x + e0);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const double2 d = p[k];
                v[2 * k] = __double2float_rn(d.x);
                v[2 * k + 1] = __double2float_rn(d.y);
            }
        } else {  // 16-bit: element e0 + 2k is the low half of word k (little-endian)
            const uint4 r = *(const uint4*)((const unsigned short*)x + e0);
            const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                v[2 * k] = bits16_to_float<DTYPE>(w[k] & 0xffffu);
                v[2 * k + 1] = bits16_to_float<DTYPE>(w[k] >> 16);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < CHUNK; ++j)
            v[j] = j < count ? load_float(x, e0 + j, DTYPE) : PAD_FIRST && j > 0 ? v[0] : 0.0f;
    }
}

// float32 results rounded into DTYPE (float64: exact), NaN canonical, as store_float; vector: as load_chunk,
// else only the first `count` elements are written. NOT_NAN: the caller knows no value is NaN, and the vector path
// leaves out the per-element NaN tests (the same bits for every other value).
template <int DTYPE, bool NOT_NAN = false>
__device__ __forceinline__ void store_chunk(void* __restrict__ out, long long e0, bool vector, int count,
                                            const float v[CHUNK]) {
    if (vector) {
        if (DTYPE == DTYPE_FLOAT32) {
            unsigned int u[CHUNK];
#pragma unroll
            for (int j = 0; j < CHUNK; ++j)
                u[j] = !NOT_NAN && v[j] != v[j] ? CANONICAL_NAN_F32 : __float_as_uint(v[j]);
            uint4* p = (uint4*)((float*)out + e0);
            uint4 a, b;
            a.x = u[0]; a.y = u[1]; a.z = u[2]; a.w = u[3];
            b.x = u[4]; b.y = u[5]; b.z = u[6]; b.w = u[7];
            p[0] = a;
            p[1] = b;
        } else if (DTYPE == DTYPE_FLOAT64) {
            double2* p = (double2*)((double*)out + e0);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                double2 d;
                d.x = !NOT_NAN && v[2 * k] != v[2 * k] ? __longlong_as_double(CANONICAL_NAN_F64) : (double)v[2 * k];
                d.y = !NOT_NAN && v[2 * k + 1] != v[2 * k + 1] ? __longlong_as_double(CANONICAL_NAN_F64)
                                                               : (double)v[2 * k + 1];
                p[k] = d;
            }
        } else {
            unsigned int w[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned int a = DTYPE == DTYPE_FLOAT16 ? float_to_half<NOT_NAN>(v[2 * k])
                                                              : float_to_bf16<NOT_NAN>(v[2 * k]);
                const unsigned int b = DTYPE == DTYPE_FLOAT16 ? float_to_half<NOT_NAN>(v[2 * k + 1])
                                                              : float_to_bf16<NOT_NAN>(v[2 * k + 1]);
                w[k] = a | (b << 16);
            }
            uint4 r;
            r.x = w[0]; r.y = w[1]; r.z = w[2]; r.w = w[3];
            *(uint4*)((unsigned short*)out + e0) = r;
        }
    } else {
#pragma unroll
        for (int j = 0; j < CHUNK; ++j)
            if (j < count) store_float(out, e0 + j, DTYPE, v[j]);
    }
}
