// Exercises the shim's primitives on their own (static __shared__, __syncthreads, atomics, atomicCAS loops,
// __shfl_sync from lane 0 of a 2-D block, the builtin vector types, __launch_bounds__ and __noinline__) and its
// float operations on NaN; tests/test_cuda_quantize.py checks them against NumPy, and tests/test_nvcc_compile.py
// compiles it for sm_80/sm_90 so it stays real CUDA.
extern "C" __global__ void block_reduce(const int* x, long long n, int* block_sums, int* total, int* maximum,
                                        unsigned int* positive_ballots, int* lane0_values) {
    __shared__ int warp_sums[32];
    const int tid = threadIdx.x + blockDim.x * threadIdx.y;
    const int threads = blockDim.x * blockDim.y;
    const long long i = (long long)blockIdx.x * threads + tid;
    const int v = i < n ? x[i] : 0;
    const unsigned int positive = __ballot_sync(0xffffffffu, v > 0);
    const int lane0 = __shfl_sync(0xffffffffu, v, 0);
    int sum = v;
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if ((tid & 31) == 0) {
        warp_sums[tid >> 5] = sum;
        positive_ballots[i >> 5] = positive;
    }
    lane0_values[i] = lane0;
    atomicAdd(total, v);
    atomicMax(maximum, v);
    __syncthreads();
    if (tid == 0) {
        int block_sum = 0;
        for (int w = 0; w < threads / 32; ++w) block_sum += warp_sums[w];
        block_sums[blockIdx.x] = block_sum;
    }
}

// The float operations the package's kernels compute with, eight results per element: the emulator must give
// a GPU's bits, NaN results included (0x7fffffff whatever the operands' payloads).
extern "C" __global__ void float_ops(const float* a, const float* b, const double* d, long long n, float* out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float* const o = out + 8 * i;
        o[0] = __fadd_rn(a[i], b[i]);
        o[1] = __fsub_rn(a[i], b[i]);
        o[2] = __fmul_rn(a[i], b[i]);
        o[3] = __fdiv_rn(a[i], b[i]);
        o[4] = __frcp_rn(a[i]);
        o[5] = floorf(a[i]);
        o[6] = rintf(a[i]);
        o[7] = __double2float_rn(d[i]);
    }
}

// The builtin vector types the package's kernels move data with (16-byte float4 / uint4 / double2, 8-byte uint2),
// in a __launch_bounds__ kernel calling a __noinline__ function: each thread copies its 48 bytes of `in` to `out`
// (as float4, uint4 and double2) and adds the halves of one uint2.
__device__ __noinline__ void copy_vectors(const float4* a, const uint4* b, const double2* c, float4* a_out,
                                          uint4* b_out, double2* c_out, long long i) {
    a_out[i] = a[i];
    b_out[i] = b[i];
    c_out[i] = c[i];
}

extern "C" __global__ void __launch_bounds__(64) vector_types(const float4* a, const uint4* b, const double2* c,
                                                              const uint2* d, long long n, float4* a_out,
                                                              uint4* b_out, double2* c_out, unsigned int* d_out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        copy_vectors(a, b, c, a_out, b_out, c_out, i);
        const uint2 v = d[i];
        d_out[i] = v.x + v.y;
    }
}

// atomicCAS, as division.cu's masked stores use it: every thread of the grid sets its own bit of a shared word
// with a compare-and-swap loop (all 32 lanes of a warp race on one word), leaving the word's other bits alone.
extern "C" __global__ void masked_swaps(unsigned int* words, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned int* word = words + (i >> 4);  // 16 threads a word: bits 2 * (i % 16) are theirs
        const unsigned int mask = 1u << (2 * (i & 15));
        unsigned int assumed, old = *word;
        do {
            assumed = old;
            old = atomicCAS(word, assumed, (assumed & ~mask) | mask);
        } while (old != assumed);
    }
}
