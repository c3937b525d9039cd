#include "gpu.h"
#include "gpu_compat.h"

#include <atomic>
#if !defined(POINTERDOMAIN_HIP) && !defined(__HIP_PLATFORM_AMD__)
#include <cuda.h>  // the stream memory operations' types (the driver is reached through the runtime)
#endif
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
    if (t.oob != nullptr) atomicOr(t.oob, kOutOfRange);  // an or: a concurrent kDuplicate stays
    return false;
}

// The duplicate check's verdict (Transfer::marks): the validation pass before this kernel,
// on the same stream, found a destination slot twice, so the copy writes nothing.
__device__ __forceinline__ bool aborted(const Transfer &t) { return t.marks != nullptr && *t.marks != 0u; }

// The validation pass of the duplicate check: one thread per destination index marks its
// slot's bit; a bit already set means a second write to that slot. Slots out of range are
// left to the copy kernel (skipped and reported there). Runs on the zeroed scratch.
constexpr int kMarkThreads = 256;

__global__ void __launch_bounds__(kMarkThreads) mark_kernel(const __grid_constant__ Transfer t) {
    std::uint32_t *bits = t.marks + 1;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kMarkThreads;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kMarkThreads + threadIdx.x; i < t.n; i += stride) {
        const std::int64_t d = __ldg(t.dst_idx + i);
        if (!slot_ok(d, t.dst.num_slots)) continue;
        const std::uint32_t bit = 1u << (d & 31);
        if (atomicOr(bits + (d >> 5), bit) & bit) {
            t.marks[0] = 1u;  // plain store: idempotent, read by the next kernel only
            if (t.oob != nullptr) atomicOr(t.oob, kDuplicate);
        }
    }
}

// A slot pair's num_kv x layer_count items are cut into 2^shift parts of `per` items
// when there are fewer pairs than workers (a decode step moves a few tokens): then the
// parts move in parallel instead of one worker stepping through all of a pair's items.
struct Split {
    int shift, per;
};

// Specialised kernel: the item size is a compile-time constant. A worker of LANES
// lanes owns one part of a slot pair at a time (parts strided over the grid): it reads
// the two slot indices once (the next part's indices are fetched while this part's
// items move), splits them into page/token once, then steps through the part's items
// U at a time. Each lane moves WORDS words of VEC bytes per item; all U * WORDS loads
// are issued before the first store, so a CTA keeps (1024 / LANES) * U * ITEM bytes in
// flight - with a small CTA budget only that memory-level parallelism hides the
// microseconds of a PCIe round trip. LANES * VEC = 128 bytes: each load instruction of
// a worker reads whole 128-byte lines. Needs num_kv <= 2 (K/V or MLA) and VEC-aligned
// addresses and strides.
// SPLIT = false (at least as many pairs as workers, the bandwidth case): no split, so no
// registers go to it (they are all in use: one more spills).
// The body moves layers [layer_begin, layer_begin + lc) of t's slot pairs (item_kernel:
// t's own range; the layer pipeline's kernel: one layer at a time).
template <int ITEM, int LANES, int VEC, int U, int HINT, bool SPLIT, class Layer>
__device__ __forceinline__ void item_body(const Transfer &t, const Split split_in, const Layer layer_begin,
                                          const int lc) {
    using V = typename Vec<VEC>::T;
    static_assert(ITEM % (LANES * VEC) == 0, "an item must be whole words on every lane");
    static_assert(32 % LANES == 0, "a worker lies inside one warp");
    constexpr int WORDS = ITEM / (LANES * VEC);
    constexpr int WORKERS = kThreads / LANES;
    const int lane = static_cast<int>(threadIdx.x) % LANES;
    // 32-bit work indices (the launcher keeps n << shift below 2^31): registers are the
    // budget here, and every one spent on index arithmetic is one less word in flight.
    const Split split = SPLIT ? split_in : Split{0, 0};
    const unsigned stride = gridDim.x * WORKERS;
    const unsigned units = static_cast<unsigned>(t.n) << split.shift;
    unsigned u = blockIdx.x * WORKERS + threadIdx.x / LANES;
    if (u >= units || aborted(t)) return;
    const int q_count = static_cast<int>(t.num_kv) * lc;
    const int part_mask = (1 << split.shift) - 1;
    std::int64_t s = __ldg(t.src_idx + (u >> split.shift)), d = __ldg(t.dst_idx + (u >> split.shift));
    for (;;) {
        const unsigned next = u + stride;
        const bool more = next < units && next > u;
        std::int64_t s_next = 0, d_next = 0;
        if (!SPLIT && more) {  // split: at most two parts per worker, nothing to prefetch for
            s_next = __ldg(t.src_idx + (next >> split.shift));
            d_next = __ldg(t.dst_idx + (next >> split.shift));
        }
        const int q_begin = SPLIT ? static_cast<int>(u & static_cast<unsigned>(part_mask)) * split.per : 0;
        const int q_end = SPLIT ? min(q_count, q_begin + split.per) : q_count;
        if (q_begin < q_end && pair_ok(t, s, d)) {  // part 0 is never empty: every pair is checked
            const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
            for (int q = q_begin; q < q_end; q += U) {
                // Source addresses and loads first, destination addresses after: the
                // destination's table reads overlap the loads in flight and no register
                // holds a destination pointer while the loads are issued.
                V r[U][WORDS];
#pragma unroll
                for (int k = 0; k < U; ++k) {
                    const int qq = q + k;
                    if (U == 1 || qq < q_end) {
                        const int kv = qq >= lc ? 1 : 0;
                        const V *sp = reinterpret_cast<const V *>(
                                          item_ptr(t.src, sb, kv, layer_begin + (qq - kv * lc))) + lane;
#pragma unroll
                        for (int w = 0; w < WORDS; ++w) r[k][w] = load_word<HINT>(sp + w * LANES);
                    }
                }
#pragma unroll
                for (int k = 0; k < U; ++k) {
                    const int qq = q + k;
                    if (U == 1 || qq < q_end) {
                        const int kv = qq >= lc ? 1 : 0;
                        V *dp = reinterpret_cast<V *>(item_ptr(t.dst, db, kv, layer_begin + (qq - kv * lc))) + lane;
#pragma unroll
                        for (int w = 0; w < WORDS; ++w) store_word<HINT>(dp + w * LANES, r[k][w]);
                    }
                }
            }
        }
        if (!more) break;
        u = next;
        if (SPLIT) {
            s = __ldg(t.src_idx + (u >> split.shift));
            d = __ldg(t.dst_idx + (u >> split.shift));
        } else {
            s = s_next;
            d = d_next;
        }
    }
}

template <int ITEM, int LANES, int VEC, int U, int HINT, bool SPLIT>
__global__ void __launch_bounds__(kThreads) item_kernel(const __grid_constant__ Transfer t, Split split_in) {
    item_body<ITEM, LANES, VEC, U, HINT, SPLIT>(t, split_in, t.layer_begin, static_cast<int>(t.layer_count));
}

// Fallback for any item size, word width and num_kv: a warp per part of a slot pair,
// each item moved in steps of 32 * WORDS words with the tail predicated.
template <int VEC, int WORDS, int HINT>
__device__ __forceinline__ void generic_body(const Transfer &t, const Split split, const std::int64_t layer_begin,
                                             const int lc) {
    using V = typename Vec<VEC>::T;
    constexpr int WORKERS = kThreads / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * WORKERS;
    const std::int64_t words = t.item_bytes / VEC;
    const std::int64_t units = t.n << split.shift;
    const int q_count = static_cast<int>(t.num_kv) * lc;
    const int part_mask = (1 << split.shift) - 1;
    if (aborted(t)) return;
    for (std::int64_t u = static_cast<std::int64_t>(blockIdx.x) * WORKERS + static_cast<int>(threadIdx.x) / 32;
         u < units; u += stride) {
        const int q_begin = static_cast<int>(u & part_mask) * split.per;
        const int q_end = min(q_count, q_begin + split.per);
        if (q_begin >= q_end) continue;
        const std::int64_t s = __ldg(t.src_idx + (u >> split.shift)), d = __ldg(t.dst_idx + (u >> split.shift));
        if (!pair_ok(t, s, d)) continue;
        const SlotBase sb = slot_base(t.src, s, t.page_size), db = slot_base(t.dst, d, t.page_size);
        for (int q = q_begin; q < q_end; ++q) {
            const int kv = q / lc;
            const std::int64_t l = layer_begin + (q - kv * lc);
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

template <int VEC, int WORDS, int HINT>
__global__ void __launch_bounds__(kThreads) generic_kernel(const __grid_constant__ Transfer t, Split split) {
    generic_body<VEC, WORDS, HINT>(t, split, t.layer_begin, static_cast<int>(t.layer_count));
}

// The layer pipeline (one launch for every layer of a request, pointerdomain.transfer.layers):
// each CTA moves its share of layer 0, then of layer 1, ...; after each layer the CTA
// arrives on that layer's counter, and the last CTA to arrive publishes the layer: it
// writes `gen` to flags[l], the word a stream waits on (cuStreamWaitValue32 >= gen) and
// the host reads. No CTA ever waits for another, so nothing depends on which CTAs are
// resident. The last arriver also puts the counter back to 0 for the next launch on the
// buffer (launches on one buffer are ordered: one stream, or a graph's replays).
struct LayerFlags {
    std::uint32_t *flags;     // device address of one word per layer (host-mapped memory)
    std::uint32_t *counters;  // one word per layer, device memory, 0 between launches
    std::uint32_t gen;
    // 1, the layers the body moves per step: a launch argument, not the constant, because
    // the body compiled for a constant 1 needs registers it does not have at 1024 threads
    // (ptxas spills inside the item loop; as an argument it spills nothing but at 1152 B)
    int step;
};

// The arrival is the grid barrier's (cooperative groups' grid sync): the CTA barrier
// orders every thread's stores of the layer before thread 0's fence, which is cumulative,
// so they are ordered before the arrival; the last arriver's system fence then orders
// every CTA's stores before the flag for any observer (a stream wait, the host). The other
// warps go on to the next layer meanwhile.
__device__ __forceinline__ void publish_layer(const LayerFlags &f, int l) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(f.counters + l, 1u) == gridDim.x - 1) {
            __threadfence_system();
            f.counters[l] = 0u;
            *reinterpret_cast<volatile std::uint32_t *>(f.flags + l) = f.gen;
        }
    }
}

template <int ITEM, int LANES, int VEC, int U, int HINT, bool SPLIT>
__global__ void __launch_bounds__(kThreads) item_layers_kernel(const __grid_constant__ Transfer t, Split split,
                                                               const LayerFlags f) {
    // one 32-bit register lives across the body (layers < 2^24): the layer itself, its
    // bounds and flag index re-read from the launch arguments
#pragma unroll 1
    for (int layer = static_cast<int>(t.layer_begin); layer < static_cast<int>(t.layer_begin + t.layer_count);
         ++layer) {
        item_body<ITEM, LANES, VEC, U, HINT, SPLIT>(t, split, layer, f.step);
        publish_layer(f, layer - static_cast<int>(t.layer_begin));
    }
}

template <int VEC, int WORDS, int HINT>
__global__ void __launch_bounds__(kThreads) generic_layers_kernel(const __grid_constant__ Transfer t, Split split,
                                                                  const LayerFlags f) {
    const int count = static_cast<int>(t.layer_count);
#pragma unroll 1
    for (int l = 0; l < count; ++l) {
        generic_body<VEC, WORDS, HINT>(t, split, t.layer_begin + l, 1);
        publish_layer(f, l);
    }
}

// CTAs resident at once on the whole GPU for `Kernel` (runtime occupancy query, cached
// per kernel and device): no second wave arrives late and idles SMs at the tail.
template <auto Kernel> int whole_gpu_ctas(int device, int *ctas) {
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
    if (const gpuError_t e = gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0))
        return finish(e);
    *ctas = sms * (per_sm > 0 ? per_sm : 1);
    if (device >= 0 && device < 64) cache[device].store(*ctas, std::memory_order_relaxed);
    return 0;
}

// The split that fills the grid: fewer slot pairs than workers -> cut each pair's items
// into 2^shift parts (at most one item each).
inline Split split_for(const Transfer &t, std::int64_t workers) {
    const std::int64_t q_count = t.num_kv * t.layer_count;
    int shift = 0;
    while ((std::int64_t{1} << shift) < q_count && (t.n << shift) < workers && shift < 16) ++shift;
    return Split{shift, static_cast<int>((q_count + (std::int64_t{1} << shift) - 1) >> shift)};
}

template <class Kernel>
int launch(Kernel kernel, int workers_per_cta, const Transfer &t, const Split &split, int ctas, gpuStream_t s) {
    const std::int64_t needed = ((t.n << split.shift) + workers_per_cta - 1) / workers_per_cta;
    if (needed < ctas) ctas = static_cast<int>(needed);
    kernel<<<ctas, kThreads, 0, s>>>(t, split);
    return finish(gpuGetLastError());
}

template <int VEC, int WORDS, int HINT = 1>
int launch_generic(const Transfer &t, int device, int max_ctas, gpuStream_t s) {
    constexpr auto kernel = generic_kernel<VEC, WORDS, HINT>;
    int ctas = max_ctas;
    if (ctas <= 0) {
        if (const int e = whole_gpu_ctas<kernel>(device, &ctas)) return e;
    }
    const int wpc = kThreads / 32;
    return launch(kernel, wpc, t, split_for(t, static_cast<std::int64_t>(ctas) * wpc), ctas, s);
}

template <int ITEM, int LANES, int VEC, int U, int HINT = 1>
int launch_item(const Transfer &t, int device, int max_ctas, gpuStream_t s) {
    // 32-bit work indices in the kernel (n << shift stays below 2 * workers when shift > 0)
    if (t.n >= (std::int64_t{1} << 31)) return launch_generic<VEC, 4, HINT>(t, device, max_ctas, s);
    constexpr auto whole = item_kernel<ITEM, LANES, VEC, U, HINT, false>;
    constexpr auto split = item_kernel<ITEM, LANES, VEC, U, HINT, true>;
    constexpr int wpc = kThreads / LANES;
    int ctas = max_ctas;
    if (ctas <= 0) {
        if (const int e = whole_gpu_ctas<whole>(device, &ctas)) return e;
    }
    const Split sp = split_for(t, static_cast<std::int64_t>(ctas) * wpc);
    if (sp.shift == 0) return launch(whole, wpc, t, sp, ctas, s);
    return launch(split, wpc, t, sp, ctas, s);
}

// What to do with the kernel that `pick` chooses: launch it, or only load it.
struct Launch {
    const Transfer &t;
    int device, max_ctas;
    gpuStream_t s;
    template <int ITEM, int LANES, int VEC, int U, int HINT = 1> int item() const {
        return launch_item<ITEM, LANES, VEC, U, HINT>(t, device, max_ctas, s);
    }
    template <int VEC, int WORDS, int HINT = 1> int generic() const {
        return launch_generic<VEC, WORDS, HINT>(t, device, max_ctas, s);
    }
};

// The layer pipeline's launch: the kernel walks t's layers, one at a time, so each
// layer's split and CTA count are those of a one-layer launch. At least one CTA, so that
// every layer is published.
template <class Kernel>
int launch_layers(Kernel kernel, int workers_per_cta, const Transfer &t, const Split &split, int ctas, gpuStream_t s,
                  const LayerFlags &f) {
    const std::int64_t needed = ((t.n << split.shift) + workers_per_cta - 1) / workers_per_cta;
    if (needed < ctas) ctas = static_cast<int>(needed);
    if (ctas < 1) ctas = 1;
    kernel<<<ctas, kThreads, 0, s>>>(t, split, f);
    return finish(gpuGetLastError());
}

inline Transfer one_layer(const Transfer &t) {
    Transfer one = t;
    one.layer_count = 1;
    return one;
}

template <int VEC, int WORDS, int HINT = 1>
int launch_generic_layers(const Transfer &t, int device, int max_ctas, gpuStream_t s, const LayerFlags &f) {
    constexpr auto kernel = generic_layers_kernel<VEC, WORDS, HINT>;
    int ctas = max_ctas;
    if (ctas <= 0) {
        if (const int e = whole_gpu_ctas<kernel>(device, &ctas)) return e;
    }
    const int wpc = kThreads / 32;
    return launch_layers(kernel, wpc, t, split_for(one_layer(t), static_cast<std::int64_t>(ctas) * wpc), ctas, s, f);
}

template <int ITEM, int LANES, int VEC, int U, int HINT = 1>
int launch_item_layers(const Transfer &t, int device, int max_ctas, gpuStream_t s, const LayerFlags &f) {
    if (t.n >= (std::int64_t{1} << 31)) return launch_generic_layers<VEC, 4, HINT>(t, device, max_ctas, s, f);
    constexpr auto whole = item_layers_kernel<ITEM, LANES, VEC, U, HINT, false>;
    constexpr auto split = item_layers_kernel<ITEM, LANES, VEC, U, HINT, true>;
    constexpr int wpc = kThreads / LANES;
    int ctas = max_ctas;
    if (ctas <= 0) {
        if (const int e = whole_gpu_ctas<whole>(device, &ctas)) return e;
    }
    const Split sp = split_for(one_layer(t), static_cast<std::int64_t>(ctas) * wpc);
    if (sp.shift == 0) return launch_layers(whole, wpc, t, sp, ctas, s, f);
    return launch_layers(split, wpc, t, sp, ctas, s, f);
}

struct LaunchLayers {
    const Transfer &t;
    int device, max_ctas;
    gpuStream_t s;
    const LayerFlags &f;
    template <int ITEM, int LANES, int VEC, int U, int HINT = 1> int item() const {
        return launch_item_layers<ITEM, LANES, VEC, U, HINT>(t, device, max_ctas, s, f);
    }
    template <int VEC, int WORDS, int HINT = 1> int generic() const {
        return launch_generic_layers<VEC, WORDS, HINT>(t, device, max_ctas, s, f);
    }
};

// Lazy module loading (the default since CUDA 12.2) loads a kernel at its first launch,
// and loading may synchronise the context: a first launch queued behind other work would
// wait for all of it. cudaFuncGetAttributes loads the kernel ahead of that.
template <auto Kernel> int load() {
    gpuFuncAttributes attributes{};
    return finish(gpuFuncGetAttributes(&attributes, reinterpret_cast<const void *>(Kernel)));
}

struct Preload {
    template <int ITEM, int LANES, int VEC, int U, int HINT = 1> int item() const {
        if (const int e = load<item_kernel<ITEM, LANES, VEC, U, HINT, false>>()) return e;
        if (const int e = load<item_kernel<ITEM, LANES, VEC, U, HINT, true>>()) return e;
        if (const int e = load<item_layers_kernel<ITEM, LANES, VEC, U, HINT, false>>()) return e;
        if (const int e = load<item_layers_kernel<ITEM, LANES, VEC, U, HINT, true>>()) return e;
        return generic<VEC, 4, HINT>();  // launch_item's fallback at 2^31 pairs or more
    }
    template <int VEC, int WORDS, int HINT = 1> int generic() const {
        if (const int e = load<generic_layers_kernel<VEC, WORDS, HINT>>()) return e;
        return load<generic_kernel<VEC, WORDS, HINT>>();
    }
};

// The kernel for a transfer's shape. The shape for each specialised item size, from the
// sweeps on an H200 (benchmarks/kernel_sweep.cu, docs/performance.md): 128-byte lines per
// worker instruction (8 lanes x 16 bytes; 4-lane workers reading half lines lost 15-25 %),
// 128 bytes per lane in flight (one item of 1-4 KiB, two of 512 B), i.e. 128 KiB of
// loads in flight per 1024-thread CTA. Two items per worker at 1-4 KiB lost up to 10 %
// per-layer. 1152 B (MLA 576 x bf16): 8 lanes x 9 words.
constexpr std::int64_t kSpecialised[] = {512, 1024, 1152, 2048, 4096};  // the item sizes of the table below

template <class Act>
int pick(std::int64_t item_bytes, std::int64_t num_kv, std::int64_t layer_count, int vec_bytes, const Act &act) {
    if (num_kv <= 2 && layer_count <= (1 << 24)) {
        if (vec_bytes >= 16) {
            switch (item_bytes) {
                case 512: return act.template item<512, 8, 16, 2>();
                case 1024: return act.template item<1024, 8, 16, 1>();
                case 1152: return act.template item<1152, 8, 16, 1>();
                case 2048: return act.template item<2048, 16, 16, 1>();
                case 4096: return act.template item<4096, 32, 16, 1>();
                default: break;
            }
        }
        if (vec_bytes >= 8) {  // 8-byte words: 16 lanes x 8 bytes per line
            switch (item_bytes) {
                case 512: return act.template item<512, 16, 8, 2>();
                case 1024: return act.template item<1024, 16, 8, 2>();
                case 1152: return act.template item<1152, 16, 8, 2>();
                case 2048: return act.template item<2048, 32, 8, 2>();
                case 4096: return act.template item<4096, 32, 8, 1>();
                default: break;
            }
        }
    }
    switch (vec_bytes) {
        case 16: return act.template generic<16, 4>();
        case 8: return act.template generic<8, 8>();
        case 4: return act.template generic<4, 8>();
        default: return act.template generic<1, 8, 0>();
    }
}

int launch_copy(const Transfer &t, int device, int max_ctas, int vec_bytes, gpuStream_t s) {
    return pick(t.item_bytes, t.num_kv, t.layer_count, vec_bytes, Launch{t, device, max_ctas, s});
}

// The duplicate check (Transfer::marks) ahead of the copy, both on `s`: zero the scratch,
// mark every destination slot, then the copy, which reads the verdict first. Three nodes in
// a captured graph, no host sync. One index cannot repeat: no check (and no verdict read).
// The validation pass alone (zero the scratch, mark): run.marks dropped where one index
// cannot repeat, so the copy then reads no verdict.
int mark_pass(Transfer &run, int max_ctas, gpuStream_t s) {
    if (run.marks == nullptr) return 0;
    if (run.n < 2) {
        run.marks = nullptr;
        return 0;
    }
    const auto words = static_cast<std::size_t>(marks_words(run.dst.num_slots));
    if (const gpuError_t e = gpuMemsetAsync(run.marks, 0, words * sizeof(std::uint32_t), s)) return finish(e);
    // A short pass: at most four CTAs of the budget's worth of threads (1024 on the whole GPU).
    const std::int64_t cap = max_ctas > 0 ? std::int64_t{4} * max_ctas : 1024;
    std::int64_t ctas = (run.n + kMarkThreads - 1) / kMarkThreads;
    if (ctas > cap) ctas = cap;
    mark_kernel<<<static_cast<int>(ctas), kMarkThreads, 0, s>>>(run);
    return finish(gpuGetLastError());
}

int launch_best(const Transfer &t, int device, int max_ctas, int vec_bytes, gpuStream_t s) {
    Transfer run = t;
    if (const int e = mark_pass(run, max_ctas, s)) return e;
    return launch_copy(run, device, max_ctas, vec_bytes, s);
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

int preload_kernels(int device) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    for (const int vec : {16, 8, 4, 1}) {
        if (const int e = pick(0, 1, 1, vec, Preload{})) return e;  // the generic kernel of the width
        for (const std::int64_t item : kSpecialised)
            if (const int e = pick(item, 1, 1, vec, Preload{})) return e;
    }
    if (const int e = load<mark_kernel>()) return e;
    return staged_preload();
}


namespace {
// The capture state of `s` (the device current already): 1 capturing, 0 not; the query's
// status in *error (0 is returned when it failed).
int capturing_of(gpuStream_t s, gpuError_t *error) {
    gpuStreamCaptureStatus status = gpuStreamCaptureStatusNone;
    *error = gpuStreamIsCapturing(s, &status);
    return status != gpuStreamCaptureStatusNone ? 1 : 0;
}
}  // namespace

int transfer(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes, bool shared_marks) {
    if (t.n <= 0 || t.num_kv <= 0 || t.layer_count <= 0 || t.item_bytes <= 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
    if (shared_marks && t.marks != nullptr && t.n > 1) {
        gpuError_t e = gpuSuccess;
        const int capturing = capturing_of(s, &e);
        if (e != gpuSuccess) return finish(e);
        if (capturing) return kMarksPerCapture;
    }
    return launch_best(t, device, max_ctas, vec_bytes, s);
}

int event_create(int device, std::uint64_t *event) {
    *event = 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    gpuEvent_t e = nullptr;
    if (const gpuError_t err = gpuEventCreateWithFlags(&e, gpuEventDisableTiming)) return finish(err);
    *event = reinterpret_cast<std::uint64_t>(e);
    return 0;
}

int event_record(std::uint64_t event, int device, std::uint64_t stream) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
    gpuError_t e = gpuSuccess;
    const int capturing = capturing_of(s, &e);
    if (e != gpuSuccess) return finish(e);
    if (capturing) return kNotRecorded;
    return finish(gpuEventRecord(reinterpret_cast<gpuEvent_t>(event), s));
}

int event_query(std::uint64_t event) {
    const gpuError_t e = gpuEventQuery(reinterpret_cast<gpuEvent_t>(event));
    if (e == gpuErrorNotReady) {
        gpuGetLastError();  // not an error: leave nothing for the next call to report
        return static_cast<int>(e);
    }
    return finish(e);
}

int not_ready_status() { return static_cast<int>(gpuErrorNotReady); }

int transfer_recorded(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes,
                      std::uint64_t event, bool shared_marks) {
    if (t.n <= 0 || t.num_kv <= 0 || t.layer_count <= 0 || t.item_bytes <= 0) return kNotRecorded;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
    gpuError_t e = gpuSuccess;
    const int capturing = capturing_of(s, &e);
    if (e != gpuSuccess) return finish(e);
    if (capturing && shared_marks && t.marks != nullptr && t.n > 1) return kMarksPerCapture;
    if (const int status = launch_best(t, device, max_ctas, vec_bytes, s)) return status;
    if (capturing || event == 0) return kNotRecorded;
    return finish(gpuEventRecord(reinterpret_cast<gpuEvent_t>(event), s));
}

int stream_capturing(int device, std::uint64_t stream, int *capturing) {
    *capturing = 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    gpuError_t e = gpuSuccess;
    *capturing = capturing_of(reinterpret_cast<gpuStream_t>(stream), &e);
    return finish(e);
}

int transfer_layers(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes,
                    std::uint64_t flags, std::uint64_t counters, std::uint32_t gen, std::uint64_t event) {
    if (t.layer_count <= 0 || t.num_kv <= 0 || t.item_bytes <= 0 || t.n < 0 || t.layer_count >= (1 << 24) ||
        flags == 0 || counters == 0)
        return finish(gpuErrorInvalidValue);
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
    gpuError_t e = gpuSuccess;
    const int capturing = capturing_of(s, &e);
    if (e != gpuSuccess) return finish(e);
    // Never captured: in a graph the scheduler may put a stream wait on a flag ahead of
    // the kernel that sets it (the driver does not see that order), so the Python layer
    // queues captured loads as one launch per layer with events instead.
    if (capturing) return finish(gpuErrorInvalidValue);
    const LayerFlags f{reinterpret_cast<std::uint32_t *>(flags), reinterpret_cast<std::uint32_t *>(counters), gen, 1};
    // the duplicate check ahead of every layer's copy, as for a one-launch transfer (a
    // duplicate: no layer copied, every flag still published, error bit 2 set)
    Transfer run = t;
    if (const int e = mark_pass(run, max_ctas, s)) return e;
    if (const int status = pick(run.item_bytes, run.num_kv, 1, vec_bytes, LaunchLayers{run, device, max_ctas, s, f}))
        return status;
    if (event == 0) return kNotRecorded;
    return finish(gpuEventRecord(reinterpret_cast<gpuEvent_t>(event), s));
}

namespace {
#if !defined(POINTERDOMAIN_HIP) && !defined(__HIP_PLATFORM_AMD__)
// cuStreamWaitValue32 / cuStreamWriteValue32 (the driver's stream memory operations, no
// runtime spelling) through the runtime's driver entry points: nothing links libcuda.
using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

StreamValueFn driver_entry(const char *name) {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess) gpuGetLastError();
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<StreamValueFn>(fn) : nullptr;
}

int stream_value(bool wait, std::uint64_t stream, std::uint64_t addr, std::uint32_t value) {
    static const StreamValueFn wait_fn = driver_entry("cuStreamWaitValue32");
    static const StreamValueFn write_fn = driver_entry("cuStreamWriteValue32");
    const StreamValueFn fn = wait ? wait_fn : write_fn;
    if (fn == nullptr) return static_cast<int>(cudaErrorNotSupported);
    // GEQ: (int32_t)(*addr - value) >= 0, a cyclic compare, so generations may wrap
    return static_cast<int>(fn(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr), value,
                               wait ? static_cast<unsigned>(CU_STREAM_WAIT_VALUE_GEQ)
                                    : static_cast<unsigned>(CU_STREAM_WRITE_VALUE_DEFAULT)));
}
#else
int stream_value(bool wait, std::uint64_t stream, std::uint64_t addr, std::uint32_t value) {
    auto s = reinterpret_cast<hipStream_t>(stream);
    auto p = reinterpret_cast<void *>(addr);
    return static_cast<int>(wait ? hipStreamWaitValue32(s, p, value, hipStreamWaitValueGte, 0xFFFFFFFFu)
                                 : hipStreamWriteValue32(s, p, value, 0));
}
#endif
}  // namespace

int stream_wait_value(int device, std::uint64_t stream, std::uint64_t addr, std::uint32_t value) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    return stream_value(true, stream, addr, value);
}

int stream_write_value(int device, std::uint64_t stream, std::uint64_t addr, std::uint32_t value) {
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    return stream_value(false, stream, addr, value);
}

int event_synchronize(std::uint64_t event) {
    return finish(gpuEventSynchronize(reinterpret_cast<gpuEvent_t>(event)));
}

#if !defined(POINTERDOMAIN_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
namespace {
// One batch call per kMaxBatchDescriptors descriptors, in order on `s`.
gpuError_t batch_submit(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes,
                        std::size_t count, gpuStream_t s) {
    // The driver reads numAttrs entries of both arrays: one attribute, for descriptors [0, n).
    cudaMemcpyAttributes attrs[1] = {};
    attrs[0].srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attrs[0].flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t attr_idxs[1] = {0};
    constexpr std::size_t num_attrs = 1;
    for (std::size_t off = 0; off < count; off += kMaxBatchDescriptors) {
        const std::size_t n = count - off < kMaxBatchDescriptors ? count - off : kMaxBatchDescriptors;
        auto d = reinterpret_cast<void *const *>(dsts + off);
        auto src = reinterpret_cast<const void *const *>(srcs + off);
        auto sz = reinterpret_cast<const std::size_t *>(sizes + off);
#if CUDART_VERSION >= 13000
        const gpuError_t e = cudaMemcpyBatchAsync(d, src, sz, n, attrs, attr_idxs, num_attrs, s);
#else
        std::size_t fail_idx = 0;
        const gpuError_t e = cudaMemcpyBatchAsync(const_cast<void **>(d), const_cast<void **>(src),
                                                  const_cast<std::size_t *>(sz), n, attrs, attr_idxs, num_attrs,
                                                  &fail_idx, s);
#endif
        if (e != gpuSuccess) return e;
    }
    return gpuSuccess;
}

// The batch call refuses the legacy stream: the copies run on a side stream of the device
// that waits for the legacy stream's work so far (event `before`) and that the legacy
// stream waits for (event `after`), so they keep the legacy stream's order both ways
// without relying on the implicit synchronisation of blocking streams.
struct LegacySide {
    gpuStream_t stream = nullptr;
    gpuEvent_t before = nullptr;
    gpuEvent_t after = nullptr;
};

gpuError_t batch_on_legacy(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes,
                           std::size_t count, int device, gpuStream_t legacy) {
    static std::mutex mu;
    static std::map<int, LegacySide> sides;
    std::lock_guard<std::mutex> lock(mu);  // the events are re-recorded: one batch at a time per process
    LegacySide &side = sides[device];
    if (side.stream == nullptr) {
        LegacySide made;
        if (gpuError_t e = gpuStreamCreateWithFlags(&made.stream, gpuStreamNonBlocking)) return e;
        if (gpuError_t e = gpuEventCreateWithFlags(&made.before, gpuEventDisableTiming)) return e;
        if (gpuError_t e = gpuEventCreateWithFlags(&made.after, gpuEventDisableTiming)) return e;
        side = made;
    }
    if (gpuError_t e = gpuEventRecord(side.before, legacy)) return e;
    if (gpuError_t e = gpuStreamWaitEvent(side.stream, side.before, 0)) return e;
    if (gpuError_t e = batch_submit(dsts, srcs, sizes, count, side.stream)) return e;
    if (gpuError_t e = gpuEventRecord(side.after, side.stream)) return e;
    return gpuStreamWaitEvent(legacy, side.after, 0);
}
}  // namespace
#endif

int copy_runs(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes, std::size_t count,
              int device, std::uint64_t stream, bool use_batch) {
    if (count == 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    auto s = reinterpret_cast<gpuStream_t>(stream);
#if !defined(POINTERDOMAIN_HIP) && defined(CUDART_VERSION) && CUDART_VERSION >= 12080
    if (use_batch) {
        gpuError_t e = gpuSuccess;
        const int capturing = capturing_of(s, &e);  // a batch call is not captured: the loop below is
        if (e != gpuSuccess) return finish(e);
        if (!capturing) {
            if (s == nullptr || s == cudaStreamLegacy) return finish(batch_on_legacy(dsts, srcs, sizes, count, device, s));
            return finish(batch_submit(dsts, srcs, sizes, count, s));
        }
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
