// Exercises the shim's primitives the quantize kernels do not use (static __shared__, __syncthreads, atomics,
// __shfl_sync from lane 0 of a 2-D block) and its float operations on NaN; tests/test_cuda_quantize.py checks
// them against NumPy, and
// tests/test_nvcc_compile.py compiles it for sm_80/sm_90 so it stays real CUDA.
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
