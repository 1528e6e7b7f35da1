// Kernels of the `quantize` codec. lightning_act/formats/quantize.py (quantize_reference, dequantize_reference,
// _round_stats), lightning_act/rng.py and lightning_act/formats/_bitpack.py are the specification, bit for bit.
//
// Compiled at run time by NVRTC (CuPy RawModule): no #include, builtin types only, extern "C" names.
// Every float32 operation the spec does as one IEEE operation is an explicit __f*_rn intrinsic, so no
// multiply-add is ever contracted. Element offsets are 64-bit (long long) everywhere.
// Dtype codes (x_dtype, stats_dtype, out_dtype): 0 float32, 1 float16, 2 bfloat16 (16-bit types as raw bits),
// 3 float64 (inputs rounded to float32 once, outputs widened exactly); statistics are float32 or bfloat16.
// The launcher prepends common.cuh (RNG, 16-bit float conversions, statistics rounding, quantize_one, chunks).
//
// Layout (benchmarks/results/roofline_cuda.md has the traffic and the expected bandwidth):
// - A thread owns CHUNK = 8 consecutive elements of a group (group_size is a multiple of 32, so a group is
//   group_size / 8 whole chunks): it reads them with 16-byte vector loads into registers (common.cuh
//   load_chunk), and its 8 codes are exactly `bits` whole payload bytes, which it writes with one 1-, 2-, 4- or
//   8-byte store; a warp's stores cover 32 * bits consecutive bytes (fully coalesced sectors, no shuffles
//   needed to pack).
// - A group is handled by a team of threads, one chunk each: group_size 32..256 (4, 8, 16 or 32 chunks) by
//   part of one warp, 32 / chunks groups per warp, min/max reduced with xor shuffles inside the team; larger
//   groups by ceil(chunks / 32) warps, each reducing with shuffles and then once through shared memory (the
//   only use of it). Group sizes whose chunk count neither divides 32 nor is a multiple of it (96, 160, 288,
//   ...) leave the last warp of the team partly idle.
// - Each thread handles SLOTS = 2 groups per iteration (both loads in flight before either is reduced), and the
//   grid (a few blocks per multiprocessor, from the launcher) strides over the groups. (4 in the decode measured
//   no faster on an H200 in bfloat16 and 18% slower in float32: kernel_sweep_gpu.md, second run.)
// - No branch per element: codes are computed for the 8 elements of every chunk (quantize_one is branch-free)
//   and the missing elements' are masked after, so ptxas interleaves the 8 independent hash-and-round chains.
//   With a branch per element (the first version), each element ran as its own serial chain: the encode reached
//   about one element per SM clock on an H200 whatever the grid, group size or bits (kernel_sweep_gpu.md).
// - Encode reads x once; decode reads each payload byte and statistic once; each writes each output once.
// - One instantiation per (bits, dtype), each a __noinline__ function: inlined into one kernel they make ptxas
//   spill at the 64-register cap of 1024-thread blocks; called once per thread, each fits without spilling.

#define SLOTS 2

// A thread's place: its team (one group per slot) and its chunk in the group. team_threads: chunks when a
// warp holds whole teams (chunks divides 32), else whole warps; blockDim.x is a multiple of it (the launcher).
struct QuantizeTeam {
    int chunks;        // chunks per group
    int team_threads;  // threads per team
    int team_lanes;    // lanes of a team inside one warp: the xor-shuffle width
    int team_warps;    // warps per team (1 when a warp holds one or more teams)
    int teams;         // teams per block
    int team;          // this thread's team in the block
    int chunk;         // this thread's chunk in its group (>= chunks: idle)
};

__device__ __forceinline__ QuantizeTeam quantize_team(int group_size) {
    QuantizeTeam q;
    q.chunks = group_size / CHUNK;
    const bool subwarp = q.chunks <= 32 && (32 % q.chunks) == 0;
    q.team_threads = subwarp ? q.chunks : (q.chunks + 31) & ~31;
    q.team_lanes = subwarp ? q.chunks : 32;
    q.team_warps = subwarp ? 1 : q.team_threads >> 5;
    q.teams = blockDim.x / q.team_threads;
    q.team = threadIdx.x / q.team_threads;
    q.chunk = threadIdx.x - q.team * q.team_threads;
    return q;
}

// elements of chunk `chunk` of `group` inside the tensor (0 for idle threads and groups past the end)
__device__ __forceinline__ int chunk_count(const QuantizeTeam& q, long long group, long long groups, long long e0,
                                           long long numel) {
    if (group >= groups || q.chunk >= q.chunks || e0 >= numel) return 0;
    return numel - e0 >= CHUNK ? CHUNK : (int)(numel - e0);
}

template <int BITS, int DTYPE>
__device__ __noinline__ void encode_groups(const void* __restrict__ x, long long numel, int group_size,
                                              unsigned int rng_base, unsigned char* __restrict__ payload,
                                              void* __restrict__ mn_out, void* __restrict__ step_out,
                                              int stats_dtype, float (*share_lo)[SLOTS][32],
                                              float (*share_hi)[SLOTS][32]) {
    const int levels = (1 << BITS) - 1;
    const QuantizeTeam q = quantize_team(group_size);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long groups = (numel + group_size - 1) / group_size;
    const long long payload_bytes = (numel * BITS + 7) >> 3;
    const bool x_vector = aligned16(x), payload_vector = ((unsigned long long)payload & 7ull) == 0;
    const long long per_block = (long long)q.teams * SLOTS;
    int parity = 0;
    // block-uniform loop condition: every thread of a block runs the same iterations (__syncthreads inside)
    for (long long base = (long long)blockIdx.x * per_block; base < groups; base += (long long)gridDim.x * per_block) {
        float v[SLOTS][CHUNK], lo[SLOTS], hi[SLOTS];
        long long e0[SLOTS];
        int count[SLOTS];
        // the only read of x, both slots' loads issued before any reduction
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            const long long group = base + (long long)s * q.teams + q.team;
            e0[s] = group * group_size + (long long)q.chunk * CHUNK;
            count[s] = chunk_count(q, group, groups, e0[s], numel);
            load_chunk<DTYPE, true>(x, e0[s], x_vector && count[s] == CHUNK, count[s], v[s]);
        }
        // min and max with fminf / fmaxf (one instruction each, NaN ignored) and a NaN flag (torch.amin / amax
        // propagate NaN: a group holding one gets NaN for both, below). The spec pads the short last group with
        // copies of its last element, which leave min and max unchanged; here a short chunk's missing elements
        // stand in as its first (load_chunk's element path pads them so: a whole chunk pays no select), and a
        // thread with none contributes the identities.
        bool nan[SLOTS];
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            lo[s] = __uint_as_float(0x7f800000u);
            hi[s] = __uint_as_float(0xff800000u);
            nan[s] = false;
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                lo[s] = fminf(lo[s], v[s][j]);
                hi[s] = fmaxf(hi[s], v[s][j]);
                nan[s] = nan[s] || v[s][j] != v[s][j];
            }
            if (count[s] == 0) {
                lo[s] = __uint_as_float(0x7f800000u);
                hi[s] = __uint_as_float(0xff800000u);
                nan[s] = false;
            }
        }
        // inside the warp: xor shuffles over the team's lanes, one vote for the NaN flags
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            if (offset < q.team_lanes) {
#pragma unroll
                for (int s = 0; s < SLOTS; ++s) {
                    lo[s] = fminf(lo[s], __shfl_xor_sync(FULL_WARP, lo[s], offset));
                    hi[s] = fmaxf(hi[s], __shfl_xor_sync(FULL_WARP, hi[s], offset));
                }
            }
        }
        const int first_lane = lane & ~(q.team_lanes - 1);
        const unsigned int team_mask = q.team_lanes == 32 ? FULL_WARP : ((1u << q.team_lanes) - 1u) << first_lane;
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            if (__ballot_sync(FULL_WARP, nan[s]) & team_mask) lo[s] = hi[s] = __uint_as_float(CANONICAL_NAN_F32);
        }
        // lanes may differ in which signed zero won: the team uses its first lane's, which is stored
        if (q.team_warps > 1) {
            if (lane == 0) {
#pragma unroll
                for (int s = 0; s < SLOTS; ++s) {
                    share_lo[parity][s][warp] = lo[s];
                    share_hi[parity][s][warp] = hi[s];
                }
            }
            __syncthreads();
            const int first = q.team * q.team_warps;
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) {
                lo[s] = share_lo[parity][s][first];
                hi[s] = share_hi[parity][s][first];
                for (int w = 1; w < q.team_warps; ++w) {  // the same order in every thread: the same result
                    lo[s] = nan_min(lo[s], share_lo[parity][s][first + w]);
                    hi[s] = nan_max(hi[s], share_hi[parity][s][first + w]);
                }
            }
            parity ^= 1;
        } else {
#pragma unroll
            for (int s = 0; s < SLOTS; ++s) {
                lo[s] = __shfl_sync(FULL_WARP, lo[s], first_lane);
                hi[s] = __shfl_sync(FULL_WARP, hi[s], first_lane);
            }
        }
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            const long long group = base + (long long)s * q.teams + q.team;
            float mn, step;
            round_stats(lo[s], hi[s], levels, stats_dtype, mn_out, step_out, group,
                        q.chunk == 0 && group < groups, &mn, &step);
            if (count[s] == 0) continue;
            const float inv = step > 0.0f ? __frcp_rn(step) : 0.0f;
            // 8 codes = BITS whole bytes (element i at bit (i % (32 / BITS)) * BITS of its 32-bit word), all 8
            // computed with no per-element condition; the codes of the last chunk's missing elements are then
            // cleared to 0, as the spec's packing pads
            const unsigned int noise = uniform24_chunk(uniform24_key(rng_base, e0[s]), e0[s]);
            unsigned int word[2] = {0u, 0u};
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                const unsigned int code = quantize_one(v[s][j], mn, inv, uniform24_element(noise, j), levels);
                word[(j * BITS) >> 5] |= code << ((j * BITS) & 31);
            }
            if (count[s] < CHUNK) {
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int kept = count[s] * BITS - 32 * k;  // code bits of this word that are elements
                    word[k] &= kept >= 32 ? 0xffffffffu : kept <= 0 ? 0u : (1u << kept) - 1u;
                }
            }
            const long long byte = (e0[s] >> 3) * BITS;  // e0 is a multiple of CHUNK = 8
            if (count[s] == CHUNK && payload_vector) {
                if (BITS == 8) {
                    uint2 w;
                    w.x = word[0];
                    w.y = word[1];
                    *(uint2*)(payload + byte) = w;
                } else if (BITS == 4) {
                    *(unsigned int*)(payload + byte) = word[0];
                } else if (BITS == 2) {
                    *(unsigned short*)(payload + byte) = (unsigned short)word[0];
                } else {
                    payload[byte] = (unsigned char)word[0];
                }
            } else {  // byte by byte, never past the payload's last byte
#pragma unroll
                for (int k = 0; k < BITS; ++k)
                    if (byte + k < payload_bytes) payload[byte + k] = (unsigned char)(word[k >> 2] >> (8 * (k & 3)));
            }
        }
    }
}

#define ENCODE_ARGS x, numel, group_size, rng_base, payload, mn_out, step_out, stats_dtype, lo, hi
#define ENCODE_BITS_ARGS x, x_dtype, numel, group_size, rng_base, payload, mn_out, step_out, stats_dtype, lo, hi
template <int BITS>
__device__ __forceinline__ void encode_bits(const void* x, int x_dtype, long long numel, int group_size,
                                            unsigned int rng_base, unsigned char* payload, void* mn_out,
                                            void* step_out, int stats_dtype, float (*lo)[SLOTS][32],
                                            float (*hi)[SLOTS][32]) {
    switch (x_dtype) {
        case DTYPE_FLOAT32: encode_groups<BITS, DTYPE_FLOAT32>(ENCODE_ARGS); break;
        case DTYPE_FLOAT16: encode_groups<BITS, DTYPE_FLOAT16>(ENCODE_ARGS); break;
        case DTYPE_BFLOAT16: encode_groups<BITS, DTYPE_BFLOAT16>(ENCODE_ARGS); break;
        default: encode_groups<BITS, DTYPE_FLOAT64>(ENCODE_ARGS);
    }
}

// Encode. Block and grid: lightning_act/cuda/quantize.py _launch_config (no dynamic shared memory); at most
// 1024 threads a block (a group of 8192), so that many threads' registers fit in a multiprocessor.
extern "C" __global__ void __launch_bounds__(1024)
    quantize_encode(const void* __restrict__ x, int x_dtype, long long numel, int bits, int group_size,
                    unsigned int rng_base, unsigned char* __restrict__ payload, void* __restrict__ mn_out,
                    void* __restrict__ step_out, int stats_dtype) {
    // per-warp partial min/max of teams spanning several warps (the only shared memory); two copies, alternating
    // between iterations, so one __syncthreads per iteration suffices
    __shared__ float lo[2][SLOTS][32], hi[2][SLOTS][32];
    switch (bits) {
        case 1: encode_bits<1>(ENCODE_BITS_ARGS); break;
        case 2: encode_bits<2>(ENCODE_BITS_ARGS); break;
        case 4: encode_bits<4>(ENCODE_BITS_ARGS); break;
        default: encode_bits<8>(ENCODE_BITS_ARGS);
    }
}

// Decode: x' = mn + q * step in float32, each thread its chunks, no communication (the teams only save the
// division of a chunk index by the group's chunk count).
template <int BITS, int DTYPE>
__device__ __noinline__ void decode_groups(const unsigned char* __restrict__ payload,
                                              const void* __restrict__ mn_in, const void* __restrict__ step_in,
                                              int stats_dtype, long long numel, int group_size,
                                              void* __restrict__ out) {
    const QuantizeTeam q = quantize_team(group_size);
    const long long groups = (numel + group_size - 1) / group_size;
    const long long payload_bytes = (numel * BITS + 7) >> 3;
    const bool out_vector = aligned16(out), payload_vector = ((unsigned long long)payload & 7ull) == 0;
    const long long per_block = (long long)q.teams * SLOTS;
    const unsigned int code_mask = (1u << BITS) - 1u;
    for (long long base = (long long)blockIdx.x * per_block; base < groups; base += (long long)gridDim.x * per_block) {
        unsigned int word[SLOTS][2];
        float mn[SLOTS], step[SLOTS];
        long long e0[SLOTS];
        int count[SLOTS];
        // every load of both slots first
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            const long long group = base + (long long)s * q.teams + q.team;
            e0[s] = group * group_size + (long long)q.chunk * CHUNK;
            count[s] = chunk_count(q, group, groups, e0[s], numel);
            word[s][0] = word[s][1] = 0u;
            mn[s] = step[s] = 0.0f;
            if (count[s] == 0) continue;
            mn[s] = load_float(mn_in, group, stats_dtype);
            step[s] = load_float(step_in, group, stats_dtype);
            const long long byte = (e0[s] >> 3) * BITS;  // e0 is a multiple of CHUNK = 8
            if (count[s] == CHUNK && payload_vector) {
                if (BITS == 8) {
                    const uint2 w = *(const uint2*)(payload + byte);
                    word[s][0] = w.x;
                    word[s][1] = w.y;
                } else if (BITS == 4) {
                    word[s][0] = *(const unsigned int*)(payload + byte);
                } else if (BITS == 2) {
                    word[s][0] = *(const unsigned short*)(payload + byte);
                } else {
                    word[s][0] = payload[byte];
                }
            } else {
#pragma unroll
                for (int k = 0; k < BITS; ++k)
                    if (byte + k < payload_bytes) word[s][k >> 2] |= (unsigned int)payload[byte + k] << (8 * (k & 3));
            }
        }
#pragma unroll
        for (int s = 0; s < SLOTS; ++s) {
            if (count[s] == 0) continue;
            float v[CHUNK];
#pragma unroll
            for (int j = 0; j < CHUNK; ++j) {
                const unsigned int code = (word[s][(j * BITS) >> 5] >> ((j * BITS) & 31)) & code_mask;
                v[j] = __fadd_rn(__fmul_rn((float)code, step[s]), mn[s]);
            }
            // mn + q * step is NaN only when mn or step is NaN or infinite (q * step overflows to an infinity of
            // step's sign at most): a group of finite statistics stores without the per-element NaN tests
            const bool vector = out_vector && count[s] == CHUNK;
            if (fabsf(mn[s]) <= FLOAT32_MAX && fabsf(step[s]) <= FLOAT32_MAX)
                store_chunk<DTYPE, true>(out, e0[s], vector, count[s], v);
            else
                store_chunk<DTYPE>(out, e0[s], vector, count[s], v);
        }
    }
}

#define DECODE_ARGS payload, mn_in, step_in, stats_dtype, numel, group_size, out
template <int BITS>
__device__ __forceinline__ void decode_bits(const unsigned char* payload, const void* mn_in, const void* step_in,
                                            int stats_dtype, long long numel, int group_size, void* out,
                                            int out_dtype) {
    switch (out_dtype) {
        case DTYPE_FLOAT32: decode_groups<BITS, DTYPE_FLOAT32>(DECODE_ARGS); break;
        case DTYPE_FLOAT16: decode_groups<BITS, DTYPE_FLOAT16>(DECODE_ARGS); break;
        case DTYPE_BFLOAT16: decode_groups<BITS, DTYPE_BFLOAT16>(DECODE_ARGS); break;
        default: decode_groups<BITS, DTYPE_FLOAT64>(DECODE_ARGS);
    }
}

// Decode. Block and grid: as encode's.
extern "C" __global__ void __launch_bounds__(1024)
    quantize_decode(const unsigned char* __restrict__ payload, const void* __restrict__ mn_in,
                    const void* __restrict__ step_in, int stats_dtype, long long numel, int bits, int group_size,
                    void* __restrict__ out, int out_dtype) {
    switch (bits) {
        case 1: decode_bits<1>(DECODE_ARGS, out_dtype); break;
        case 2: decode_bits<2>(DECODE_ARGS, out_dtype); break;
        case 4: decode_bits<4>(DECODE_ARGS, out_dtype); break;
        default: decode_bits<8>(DECODE_ARGS, out_dtype);
    }
}
