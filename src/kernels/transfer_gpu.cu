#include "gpu.h"
#include "gpu_compat.h"

#include <atomic>
#include <map>
#include <mutex>

namespace pointerdomain::gpu {
namespace {

// Sets the device for the scope of a launch or runtime call; restores the
// caller's device on every exit path (nanobind turns C++ exceptions into
// Python ones, so a guard, not a set/reset pair).
class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        status_ = gpuGetDevice(&previous_);
        if (status_ == gpuSuccess && previous_ != device) status_ = gpuSetDevice(device);
    }
    ~DeviceGuard() {
        int now = -1;
        if (gpuGetDevice(&now) == gpuSuccess && now != previous_) gpuSetDevice(previous_);
    }
    gpuError_t status() const { return status_; }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;

  private:
    int previous_ = 0;
    gpuError_t status_;
};

// A failed runtime call can leave an error that the next, unrelated call
// reports; clear it so the caller sees the real one once.
int finish(gpuError_t e) {
    if (e != gpuSuccess) gpuGetLastError();
    return static_cast<int>(e);
}

template <int VEC> struct Vec;
template <> struct Vec<16> { using T = uint4; };
template <> struct Vec<8> { using T = uint2; };
template <> struct Vec<4> { using T = unsigned int; };
template <> struct Vec<1> { using T = unsigned char; };

// Cache hints. HINT 1: L1::no_allocate loads and stores (each byte is touched once, so
// keeping it in L1 only evicts the pointer tables, which every worker re-reads).
// HIP builds (and HINT 0) use plain accesses.
template <int HINT, class V> __device__ __forceinline__ V load_word(const V *p) {
#if !defined(POINTERDOMAIN_HIP) && !defined(__HIP_PLATFORM_AMD__)
    if constexpr (HINT == 1 && sizeof(V) == 16) {
        uint4 v;
        asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
        return v;
    } else if constexpr (HINT == 1 && sizeof(V) == 8) {
        uint2 v;
        asm volatile("ld.global.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        return v;
    } else if constexpr (HINT == 1 && sizeof(V) == 4) {
        unsigned int v;
        asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
        return v;
    }
#endif
    return *p;
}

template <int HINT, class V> __device__ __forceinline__ void store_word(V *p, const V &v) {
#if !defined(POINTERDOMAIN_HIP) && !defined(__HIP_PLATFORM_AMD__)
    if constexpr (HINT == 1 && sizeof(V) == 16) {
        asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};"
                     ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
        return;
    } else if constexpr (HINT == 1 && sizeof(V) == 8) {
        asm volatile("st.global.L1::no_allocate.v2.u32 [%0], {%1,%2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
        return;
    } else if constexpr (HINT == 1 && sizeof(V) == 4) {
        asm volatile("st.global.L1::no_allocate.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
        return;
    }
#endif
    *p = v;
}

constexpr int kThreads = 1024;  // per CTA: the most memory parallelism one CTA of the budget can hold

// Table entries are re-read by every worker for every item: a read-only, cached load.
__device__ __forceinline__ std::uint64_t item_ptr(const Side &s, const SlotBase &b, std::int64_t kv,
                                                  std::int64_t layer) {
    return __ldg(s.table + item_entry(s, b, kv, layer)) + item_offset(s, b, kv, layer);
}

__device__ __forceinline__ bool pair_ok(const Transfer &t, std::int64_t s, std::int64_t d) {
    if (slot_ok(s, t.src.num_slots) && slot_ok(d, t.dst.num_slots)) return true;
    if (t.oob != nullptr) *t.oob = 1u;
    return false;
}

// Specialised kernel: the item size is a compile-time constant. A worker of LANES
// lanes owns one slot pair at a time (pairs strided over the grid): it reads the two
// slot indices once (the next pair's indices are fetched while this pair's items
// move), splits them into page/token once, then steps through the pair's
// num_kv x layer_count items U at a time. Each lane moves WORDS words of VEC bytes
// per item; all U * WORDS loads are issued before the first store, so a CTA keeps
// (1024 / LANES) * U * ITEM bytes in flight - with a small CTA budget only that
// memory-level parallelism hides the microseconds of a PCIe round trip.
// Needs num_kv <= 2 (K/V or MLA) and VEC-aligned addresses and strides.
template <int ITEM, int LANES, int VEC, int U, int HINT>
__global__ void __launch_bounds__(kThreads) item_kernel(const __grid_constant__ Transfer t) {
    using V = typename Vec<VEC>::T;
    static_assert(ITEM % (LANES * VEC) == 0, "an item must be whole words on every lane");
    static_assert(32 % LANES == 0, "a worker lies inside one warp");
    constexpr int WORDS = ITEM / (LANES * VEC);
    constexpr int WORKERS = kThreads / LANES;
    const int lane = static_cast<int>(threadIdx.x) % LANES;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * WORKERS;
    std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * WORKERS + static_cast<int>(threadIdx.x) / LANES;
    if (i >= t.n) return;
    const int lc = static_cast<int>(t.layer_count);
    const int q_count = static_cast<int>(t.num_kv) * lc;
    std::int64_t s = __ldg(t.src_idx + i), d = __ldg(t.dst_idx + i);
    for (;;) {
        const std::int64_t next = i + stride;
        const bool more = next < t.n;
        std::int64_t s_next = 0, d_next = 0;
        if (more) {
            s_next = __ldg(t.src_idx + next);
            d_next = __ldg(t.dst_idx + next);
        }
        if (pair_ok(t, s, d)) {
            const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
            for (int q = 0; q < q_count; q += U) {
                // Source addresses and loads first, destination addresses after: the
                // destination's table reads overlap the loads in flight and no register
                // holds a destination pointer while the loads are issued.
                V r[U][WORDS];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int qq = q + u;
                    if (U == 1 || qq < q_count) {
                        const int kv = qq >= lc ? 1 : 0;
                        const V *sp = reinterpret_cast<const V *>(
                                          item_ptr(t.src, sb, kv, t.layer_begin + (qq - kv * lc))) + lane;
#pragma unroll
                        for (int w = 0; w < WORDS; ++w) r[u][w] = load_word<HINT>(sp + w * LANES);
                    }
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int qq = q + u;
                    if (U == 1 || qq < q_count) {
                        const int kv = qq >= lc ? 1 : 0;
                        V *dp = reinterpret_cast<V *>(item_ptr(t.dst, db, kv, t.layer_begin + (qq - kv * lc))) + lane;
#pragma unroll
                        for (int w = 0; w < WORDS; ++w) store_word<HINT>(dp + w * LANES, r[u][w]);
                    }
                }
            }
        }
        if (!more) break;
        i = next;
        s = s_next;
        d = d_next;
    }
}

// Fallback for any item size, word width and num_kv: a warp per slot pair, each
// item moved in steps of 32 * WORDS words with the tail predicated.
template <int VEC, int WORDS, int HINT>
__global__ void __launch_bounds__(kThreads) generic_kernel(const __grid_constant__ Transfer t) {
    using V = typename Vec<VEC>::T;
    constexpr int WORKERS = kThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * WORKERS;
    const std::int64_t words = t.item_bytes / VEC;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * WORKERS + static_cast<int>(threadIdx.x) / 32;
         i < t.n; i += stride) {
        const std::int64_t s = __ldg(t.src_idx + i), d = __ldg(t.dst_idx + i);
        if (!pair_ok(t, s, d)) continue;
        const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
        for (std::int64_t kv = 0; kv < t.num_kv; ++kv) {
            for (std::int64_t l = t.layer_begin; l < t.layer_begin + t.layer_count; ++l) {
                const V *sp = reinterpret_cast<const V *>(item_ptr(t.src, sb, kv, l));
                V *dp = reinterpret_cast<V *>(item_ptr(t.dst, db, kv, l));
                for (std::int64_t base = lane; base < words; base += 32 * WORDS) {
                    V r[WORDS];
#pragma unroll
                    for (int w = 0; w < WORDS; ++w)
                        if (base + 32 * w < words) r[w] = load_word<HINT>(sp + base + 32 * w);
#pragma unroll
                    for (int w = 0; w < WORDS; ++w)
                        if (base + 32 * w < words) store_word<HINT>(dp + base + 32 * w, r[w]);
                }
            }
        }
    }
}

// CTAs resident at once on the whole GPU for `kernel` (runtime occupancy query,
// cached per kernel and device): no second wave arrives late and idles SMs at the tail.
template <class Kernel> int whole_gpu_ctas(Kernel kernel, int device, int *ctas) {
    static std::atomic<int> cache[64];
    if (device >= 0 && device < 64) {
        const int c = cache[device].load(std::memory_order_relaxed);
        if (c > 0) {
            *ctas = c;
            return 0;
        }
    }
    int sms = 0, per_sm = 0;
    if (const gpuError_t e = gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device)) return finish(e);
    if (const gpuError_t e = gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0))
        return finish(e);
    *ctas = sms * (per_sm > 0 ? per_sm : 1);
    if (device >= 0 && device < 64) cache[device].store(*ctas, std::memory_order_relaxed);
    return 0;
}

template <class Kernel>
int launch(Kernel kernel, int workers_per_cta, const Transfer &t, int device, int max_ctas, gpuStream_t s) {
    int ctas = max_ctas;
    if (ctas <= 0) {
        if (const int e = whole_gpu_ctas(kernel, device, &ctas)) return e;
    }
    const std::int64_t needed = (t.n + workers_per_cta - 1) / workers_per_cta;
    if (needed < ctas) ctas = static_cast<int>(needed);
    kernel<<<ctas, kThreads, 0, s>>>(t);
    return finish(gpuGetLastError());
}

template <int ITEM, int LANES, int VEC, int U, int HINT = 1>
int launch_item(const Transfer &t, int device, int max_ctas, gpuStream_t s) {
    return launch(item_kernel<ITEM, LANES, VEC, U, HINT>, kThreads / LANES, t, device, max_ctas, s);
}

template <int VEC, int WORDS, int HINT = 1>
int launch_generic(const Transfer &t, int device, int max_ctas, gpuStream_t s) {
    return launch(generic_kernel<VEC, WORDS, HINT>, kThreads / 32, t, device, max_ctas, s);
}

// The shape for each specialised item size, from the sweep on an H200
// (benchmarks/kernel_sweep.cu, docs/performance.md): one item in flight per worker
// (U = 1; two items per worker lost up to 10 % per-layer) and 128 bytes per lane
// (8 words of 16 bytes, so LANES = ITEM / 128), i.e. 128 KiB of loads in flight per
// 1024-thread CTA whatever the item size. 1152 B (MLA 576 x bf16): 8 lanes x 9 words.
int launch_best(const Transfer &t, int device, int max_ctas, int vec_bytes, gpuStream_t s) {
    if (t.num_kv <= 2) {
        if (vec_bytes >= 16) {
            switch (t.item_bytes) {
                case 512: return launch_item<512, 4, 16, 1>(t, device, max_ctas, s);
                case 1024: return launch_item<1024, 8, 16, 1>(t, device, max_ctas, s);
                case 1152: return launch_item<1152, 8, 16, 1>(t, device, max_ctas, s);
                case 2048: return launch_item<2048, 16, 16, 1>(t, device, max_ctas, s);
                case 4096: return launch_item<4096, 32, 16, 1>(t, device, max_ctas, s);
                default: break;
            }
        }
        if (vec_bytes >= 8) {  // 8-byte words: 16 per lane (1152 B: 9 per lane over 16 lanes)
            switch (t.item_bytes) {
                case 512: return launch_item<512, 4, 8, 1>(t, device, max_ctas, s);
                case 1024: return launch_item<1024, 8, 8, 1>(t, device, max_ctas, s);
                case 1152: return launch_item<1152, 16, 8, 1>(t, device, max_ctas, s);
                case 2048: return launch_item<2048, 16, 8, 1>(t, device, max_ctas, s);
                case 4096: return launch_item<4096, 32, 8, 1>(t, device, max_ctas, s);
                default: break;
            }
        }
    }
    switch (vec_bytes) {
        case 16: return launch_generic<16, 4>(t, device, max_ctas, s);
        case 8: return launch_generic<8, 8>(t, device, max_ctas, s);
        case 4: return launch_generic<4, 8>(t, device, max_ctas, s);
        default: return launch_generic<1, 8, 0>(t, device, max_ctas, s);
    }
}

}  // namespace

const char *runtime_name() { return PD_RUNTIME_NAME; }

int runtime_version(int *version) { return finish(gpuRuntimeGetVersion(version)); }

int device_count(int *count) {
    *count = 0;
    return finish(gpuGetDeviceCount(count));
}

int host_register(std::uint64_t va, std::uint64_t nbytes, int device) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    return finish(gpuHostRegister(reinterpret_cast<void *>(va), nbytes,
                                  gpuHostRegisterPortable | gpuHostRegisterMapped));
}

int host_unregister(std::uint64_t va, int device) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    return finish(gpuHostUnregister(reinterpret_cast<void *>(va)));
}

int host_get_device_pointer(std::uint64_t va, int device, std::uint64_t *alias) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    void *p = nullptr;
    const gpuError_t e = gpuHostGetDevicePointer(&p, reinterpret_cast<void *>(va), 0);
    *alias = reinterpret_cast<std::uint64_t>(p);
    return finish(e);
}

int can_use_host_pointer_for_registered_mem(int device, int *value) {
    *value = 0;
    return finish(gpuDeviceGetAttribute(value, gpuDevAttrCanUseHostPointerForRegisteredMem, device));
}

int pointer_is_host(std::uint64_t ptr, int *is_host) {
    gpuPointerAttributes attr{};
    const gpuError_t e = gpuPointerGetAttributes(&attr, reinterpret_cast<void *>(ptr));
    *is_host = (e == gpuSuccess && attr.type == gpuMemoryTypeHost) ? 1 : 0;
    return finish(e);
}

int multiprocessor_count(int device, int *count) {
    *count = 0;
    return finish(gpuDeviceGetAttribute(count, gpuDevAttrMultiProcessorCount, device));
}

int transfer(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes) {
    if (t.n <= 0 || t.num_kv <= 0 || t.layer_count <= 0 || t.item_bytes <= 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    return launch_best(t, device, max_ctas, vec_bytes, reinterpret_cast<gpuStream_t>(stream));
}

int copy_runs(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes, std::size_t count,
              int device, std::uint64_t stream, bool use_batch) {
    if (count == 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
#if !defined(POINTERDOMAIN_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    if (use_batch && s == nullptr) {
        // cudaMemcpyBatchAsync rejects the legacy default stream. A blocking stream
        // is ordered with the legacy stream both ways, so the copies keep its order.
        static std::mutex mu;
        static std::map<int, gpuStream_t> blocking;
        std::lock_guard<std::mutex> lock(mu);
        auto it = blocking.find(device);
        if (it == blocking.end()) {
            gpuStream_t created = nullptr;
            if (const gpuError_t e = cudaStreamCreate(&created)) return finish(e);
            it = blocking.emplace(device, created).first;
        }
        s = it->second;
    }
    if (use_batch) {
        cudaMemcpyAttributes attr{};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        std::size_t attr_idx = 0;
        auto d = reinterpret_cast<void *const *>(dsts);
        auto src = reinterpret_cast<const void *const *>(srcs);
        auto n = reinterpret_cast<const std::size_t *>(sizes);
#if CUDART_VERSION >= 13000
        return finish(cudaMemcpyBatchAsync(d, src, n, count, &attr, &attr_idx, 1, s));
#else
        std::size_t fail_idx = 0;
        return finish(cudaMemcpyBatchAsync(const_cast<void **>(d), const_cast<void **>(src),
                                           const_cast<std::size_t *>(n), count, &attr, &attr_idx, 1, &fail_idx, s));
#endif
    }
#else
    (void)use_batch;
#endif
    for (std::size_t i = 0; i < count; ++i) {
        const gpuError_t e = gpuMemcpyAsync(reinterpret_cast<void *>(dsts[i]), reinterpret_cast<const void *>(srcs[i]),
                                            sizes[i], gpuMemcpyDefault, s);
        if (e != gpuSuccess) return finish(e);
    }
    return 0;
}

bool has_batch_copy() {
#if !defined(POINTERDOMAIN_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    return true;
#else
    return false;
#endif
}

const char *error_string(int code) { return gpuGetErrorString(static_cast<gpuError_t>(code)); }

}  // namespace pointerdomain::gpu
