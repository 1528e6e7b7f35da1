// Runs CUDA kernels on CPU threads, for bit-exact tests without a GPU (see README.md beside this file).
//
// Each block's threads are real std::threads; blocks run one after another, the same threads looping over
// them. __syncthreads() is a std::barrier over the block; warp primitives exchange values through a per-block
// slot array between two waits on a per-warp barrier; __shared__ is a function-static (blocks never overlap);
// dynamic shared memory is a per-launch buffer reached through DYNAMIC_SHARED(type, name).
// Float intrinsics __f*_rn are plain IEEE operations (compile with -ffp-contract=off so none is fused) with a
// GPU's NaN results (see gpu_nan below).
// Limits: blockDim must be a multiple of 32 and warp primitives must be called by the full warp with a full
// mask (what the project's kernels do); a violation aborts with a message rather than returning garbage.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// CUDA's builtin vector types the kernels load and store (16-byte ones aligned like on a GPU)
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) double2 {
    double x, y;
};

namespace cuda_emu {
inline thread_local dim3 thread_idx, block_idx;
inline dim3 block_dim, grid_dim;
inline std::barrier<>* block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline std::vector<std::uint64_t> warp_slots;  // one exchange slot per thread of the block
inline unsigned char* dynamic_smem;

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cuda_shim: %s\n", what);
    std::abort();
}
inline unsigned linear_tid() { return thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z); }
inline void check_full_mask(unsigned mask) {
    if (mask != 0xffffffffu) fail("warp primitive with a partial mask is not emulated");
}
inline void warp_wait() { warp_barriers[linear_tid() / 32]->arrive_and_wait(); }

// every lane publishes v, then reads the slot of lane src(lane); the second wait keeps slots until all read
template <class T, class SourceLane>
T warp_exchange(T v, SourceLane src) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>);
    const unsigned t = linear_tid();
    std::uint64_t slot = 0;
    std::memcpy(&slot, &v, sizeof(T));
    warp_slots[t] = slot;
    warp_wait();
    T r;
    std::memcpy(&r, &warp_slots[(t & ~31u) | (src(t & 31u) & 31u)], sizeof(T));
    warp_wait();
    return r;
}

// Runs kernel(args...) over the grid; the thread pool lives for one launch.
template <class... Params>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
            std::type_identity_t<Params>... args) {
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads % 32 != 0) fail("blockDim must be a positive multiple of 32");
    grid_dim = grid;
    block_dim = block;
    std::barrier<> barrier(threads);
    block_barrier = &barrier;
    warp_barriers.clear();
    for (unsigned w = 0; w < threads / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    warp_slots.assign(threads, 0);
    // 0xff bytes read as NaN floats: a kernel reading shared memory it never wrote shows up in the results
    std::vector<unsigned char> smem(shared_bytes, 0xff);
    dynamic_smem = smem.data();
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (unsigned bz = 0; bz < grid.z; ++bz)
                for (unsigned by = 0; by < grid.y; ++by)
                    for (unsigned bx = 0; bx < grid.x; ++bx) {
                        block_idx = {bx, by, bz};
                        kernel(args...);
                        barrier.arrive_and_wait();  // the next block starts when this one has finished
                    }
        });
    }
    for (auto& th : pool) th.join();
}

// The ABI a Python launcher calls: kernel parameters as an array of pointers to their values (as in
// cuLaunchKernel), and a per-parameter description "<kind><bytes>" (p pointer, i signed, u unsigned, f float)
// so the caller can check its packing before the launch.
template <class T>
constexpr char param_kind() {
    return std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f' : std::is_signed_v<T> ? 'i' : 'u';
}
template <class... Params>
int describe_params(void (*)(Params...), char* kinds, int* sizes, int capacity) {
    constexpr int n = sizeof...(Params);
    if (n <= capacity) {
        const char k[] = {param_kind<Params>()..., 0};
        const int s[] = {int(sizeof(Params))..., 0};
        std::memcpy(kinds, k, n);
        std::memcpy(sizes, s, n * sizeof(int));
    }
    return n;
}
template <class... Params, std::size_t... I>
void launch_packed_impl(void (*kernel)(Params...), const unsigned* grid, const unsigned* block,
                        std::size_t shared_bytes, void** args, std::index_sequence<I...>) {
    launch(kernel, dim3{grid[0], grid[1], grid[2]}, dim3{block[0], block[1], block[2]}, shared_bytes,
           *static_cast<Params*>(args[I])...);
}
template <class... Params>
void launch_packed(void (*kernel)(Params...), const unsigned* grid, const unsigned* block, std::size_t shared_bytes,
                   void** args) {
    launch_packed_impl(kernel, grid, block, shared_bytes, args, std::index_sequence_for<Params...>{});
}
}  // namespace cuda_emu

// ---- CUDA names used by kernel sources ----
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(cuda_emu::dynamic_smem)
#define threadIdx cuda_emu::thread_idx
#define blockIdx cuda_emu::block_idx
#define blockDim cuda_emu::block_dim
#define gridDim cuda_emu::grid_dim

inline void __syncthreads() { cuda_emu::block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cuda_emu::check_full_mask(mask);
    cuda_emu::warp_wait();
}
template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
    cuda_emu::check_full_mask(mask);
    return cuda_emu::warp_exchange(v, [=](unsigned) { return unsigned(src_lane); });
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    cuda_emu::check_full_mask(mask);
    return cuda_emu::warp_exchange(v, [=](unsigned lane) { return lane ^ unsigned(lane_mask); });
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    cuda_emu::check_full_mask(mask);
    const unsigned t = cuda_emu::linear_tid();
    cuda_emu::warp_slots[t] = predicate != 0;
    cuda_emu::warp_wait();
    unsigned bits = 0;
    for (unsigned lane = 0; lane < 32; ++lane) bits |= unsigned(cuda_emu::warp_slots[(t & ~31u) | lane]) << lane;
    cuda_emu::warp_wait();
    return bits;
}
template <class T>
T atomicAdd(T* address, T v) {
    return std::atomic_ref<T>(*address).fetch_add(v);
}
template <class T>
T atomicCAS(T* address, T compare, T value) {
    std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
    return compare;  // the old value, whether or not it was swapped
}
template <class T>
T atomicMax(T* address, T v) {
    std::atomic_ref<T> a(*address);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// CUDA's integer min/max overloads
using std::max;
using std::min;

// NaN results: a GPU's float arithmetic and conversions (add, sub, mul, div, rcp; cvt: floorf, rintf,
// double -> float) return the canonical NaN 0x7fffffff whatever the operands' payloads, where x86 propagates
// an operand's payload (quieted). Loads, stores, selects, comparisons and shuffles move bits unchanged on both.
// fabsf is left to the host: the kernels only compare its result.
namespace cuda_emu {
inline float gpu_nan(float r) { return r != r ? std::bit_cast<float>(0x7fffffffu) : r; }
}  // namespace cuda_emu

inline float __fadd_rn(float a, float b) { return cuda_emu::gpu_nan(a + b); }
inline float __fsub_rn(float a, float b) { return cuda_emu::gpu_nan(a - b); }
inline float __fmul_rn(float a, float b) { return cuda_emu::gpu_nan(a * b); }
inline float __fdiv_rn(float a, float b) { return cuda_emu::gpu_nan(a / b); }
inline float __frcp_rn(float a) { return cuda_emu::gpu_nan(1.0f / a); }
inline float __double2float_rn(double d) { return cuda_emu::gpu_nan(static_cast<float>(d)); }
// after <cmath>: only the kernel sources see these
#define floorf(x) cuda_emu::gpu_nan(std::floor(static_cast<float>(x)))
#define rintf(x) cuda_emu::gpu_nan(std::rint(static_cast<float>(x)))
// cvt.rmi.u32.f32: round down, saturating to [0, 2**32 - 1], NaN -> 0
inline unsigned __float2uint_rd(float x) {
    if (x != x) return 0u;
    const float f = std::floor(x);
    if (f <= 0.0f) return 0u;
    return f >= 4294967296.0f ? 0xffffffffu : static_cast<unsigned>(f);
}
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline double __longlong_as_double(long long v) { return std::bit_cast<double>(v); }

// lorenzo kernels need:
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
    cuda_emu::check_full_mask(mask);
    return cuda_emu::warp_exchange(v, [=](unsigned lane) { return lane >= delta ? lane - delta : lane; });
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
