// Kernels of the `quantize` codec. lightning_act/codecs/quantize.py (quantize_reference, dequantize_reference,
// _round_stats), lightning_act/rng.py and lightning_act/codecs/_bitpack.py are the specification, bit for bit.
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names.
// Every float32 operation the spec does as one IEEE operation is an explicit __f*_rn intrinsic, so no
// multiply-add is ever contracted. Element offsets are 64-bit (long long) everywhere.
//
// Layout: one warp per group (group_size is a multiple of 32, so every group starts on a 32-bit word of
// the payload). Encode reads the group once (coalesced, 32 consecutive elements per warp load) into shared
// memory while reducing min/max, then quantizes from shared memory and writes whole 32-bit words.
// Decode reads each payload byte and statistic once from DRAM and writes each output element once.
// Dtype codes (x_dtype, stats_dtype, out_dtype): 0 float32, 1 float16, 2 bfloat16 (16-bit types as raw bits),
// 3 float64 (inputs rounded to float32 once, outputs widened exactly); statistics are float32 or bfloat16.
// The launcher prepends common.cuh (RNG, 16-bit float conversions, statistics rounding, quantize_one).

// Encode. Block: warps_per_block * 32 threads, dynamic shared memory warps_per_block * group_size floats.
extern "C" __global__ void quantize_encode(const void* __restrict__ x, int x_dtype, long long numel, int bits,
                                           int group_size, unsigned int rng_base,
                                           unsigned char* __restrict__ payload, void* __restrict__ mn_out,
                                           void* __restrict__ step_out, int stats_dtype) {
    DYNAMIC_SHARED(float, stage);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float* const group_stage = stage + warp * group_size;
    const int levels = (1 << bits) - 1;
    const int codes_per_word = 32 / bits;
    const long long groups = (numel + group_size - 1) / group_size;
    const long long payload_bytes = (numel * bits + 7) >> 3;
    // grid-stride over groups; the loop condition is the same for every lane of a warp
    for (long long group = (long long)blockIdx.x * warps + warp; group < groups;
         group += (long long)gridDim.x * warps) {
        const long long first = group * group_size;
        // pass 1: the only read of x; the short last group simply skips missing elements (the spec pads
        // with copies of its last element, which leaves min and max unchanged)
        float lo = __uint_as_float(0x7f800000u), hi = __uint_as_float(0xff800000u);
        for (int k = lane; k < group_size; k += 32) {
            if (first + k < numel) {
                const float v = load_float(x, first + k, x_dtype);
                group_stage[k] = v;
                lo = nan_min(lo, v);
                hi = nan_max(hi, v);
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            lo = nan_min(lo, __shfl_xor_sync(FULL_WARP, lo, offset));
            hi = nan_max(hi, __shfl_xor_sync(FULL_WARP, hi, offset));
        }
        // lanes may differ in which NaN or which signed zero won: everyone uses lane 0's, which is stored
        lo = __shfl_sync(FULL_WARP, lo, 0);
        hi = __shfl_sync(FULL_WARP, hi, 0);
        float mn, step;
        round_stats(lo, hi, levels, stats_dtype, mn_out, step_out, group, lane == 0, &mn, &step);
        const float inv = step > 0.0f ? __frcp_rn(step) : 0.0f;
        __syncwarp();  // group_stage was written by the other lanes
        // pass 2: 32 codes per round, packed into 32-bit words (element i at bit (i % codes_per_word) * bits)
        for (int k0 = 0; k0 < group_size; k0 += 32) {
            const long long e = first + k0 + lane;
            const unsigned int code =
                e < numel ? quantize_one(group_stage[k0 + lane], mn, inv, uniform24(rng_base, e), levels) : 0u;
            unsigned int word;
            if (bits == 1) {
                word = __ballot_sync(FULL_WARP, code);
            } else {
                word = code << ((lane * bits) & 31);
                for (int offset = 1; offset < codes_per_word; offset <<= 1)
                    word |= __shfl_xor_sync(FULL_WARP, word, offset);
            }
            if ((lane & (codes_per_word - 1)) == 0 && e < numel) {
                const long long byte = (e * bits) >> 3;  // multiple of 4: e is a multiple of codes_per_word
                if (byte + 4 <= payload_bytes) {
                    *(unsigned int*)(payload + byte) = word;
                } else {  // the payload's last, partial word
                    for (long long b = byte; b < payload_bytes; ++b) payload[b] = (unsigned char)(word >> (8 * (b - byte)));
                }
            }
        }
        __syncwarp();  // the next group overwrites group_stage
    }
}

// Decode. Block: warps_per_block * 32 threads, no shared memory; x' = mn + q * step in float32.
extern "C" __global__ void quantize_decode(const unsigned char* __restrict__ payload, const void* __restrict__ mn_in,
                                           const void* __restrict__ step_in, int stats_dtype, long long numel,
                                           int bits, int group_size, void* __restrict__ out, int out_dtype) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned int code_mask = (1u << bits) - 1u;
    const long long groups = (numel + group_size - 1) / group_size;
    for (long long group = (long long)blockIdx.x * warps + warp; group < groups;
         group += (long long)gridDim.x * warps) {
        const float mn = load_float(mn_in, group, stats_dtype);
        const float step = load_float(step_in, group, stats_dtype);
        const long long first = group * group_size;
        for (int k = lane; k < group_size; k += 32) {
            const long long e = first + k;
            if (e < numel) {
                const long long bit = e * bits;
                const unsigned int code = ((unsigned int)payload[bit >> 3] >> (bit & 7)) & code_mask;
                store_float(out, e, out_dtype, __fadd_rn(__fmul_rn((float)code, step), mn));
            }
        }
    }
}
