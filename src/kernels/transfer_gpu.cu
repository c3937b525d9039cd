#include "gpu.h"
#include "gpu_compat.h"

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

// Each warp moves ILP items at a time (one item = one (slot pair, kv, layer)).
// All loads of the group are issued before any store, so a warp keeps
// ILP * 32 * PER_LANE * VEC bytes in flight (4 KiB with 16-byte words): reads of host memory over PCIe
// have microseconds of latency, and with a small CTA budget (2-4 CTAs, so the
// copy overlaps model compute) only memory-level parallelism per SM brings the
// bandwidth up (field notes: ~16-19 GB/s per SM for host reads).
// Consecutive items of a group are consecutive layers of one slot: adjacent in
// a page_first host buffer.
// PER_LANE words per lane per item and pass: the launcher picks the smallest that
// covers a whole item (1 KiB: 2, 1152 B: 3, 2 KiB: 4 at 16 bytes), so an item is one
// pass with no idle lanes, and ILP * PER_LANE stays at 8-9 words (registers).
template <int VEC, int ILP, int PER_LANE>
__global__ void __launch_bounds__(1024) transfer_kernel(Transfer t) {
    using V = typename Vec<VEC>::T;
    const int lane = threadIdx.x & 31;
    const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const std::int64_t nwarps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
    const std::int64_t per_slot = t.num_kv * t.layer_count;
    const std::int64_t items = t.n * per_slot;
    const int words = static_cast<int>(t.item_bytes / VEC);
    const std::int64_t groups = (items + ILP - 1) / ILP;
    for (std::int64_t g = warp; g < groups; g += nwarps) {
        const V *src[ILP];
        V *dst[ILP];
#pragma unroll
        for (int k = 0; k < ILP; ++k) {
            src[k] = nullptr;
            dst[k] = nullptr;
            const std::int64_t w = g * ILP + k;
            if (w >= items) continue;
            const std::int64_t i = w / per_slot, r = w - i * per_slot;
            const std::int64_t kv = r / t.layer_count, l = t.layer_begin + (r - kv * t.layer_count);
            const std::int64_t s = t.src_idx[i], d = t.dst_idx[i];
            if (!slot_ok(s, t.src.num_slots) || !slot_ok(d, t.dst.num_slots)) {
                if (t.oob != nullptr) *t.oob = 1u;
                continue;
            }
            src[k] = reinterpret_cast<const V *>(item_address(t.src, kv, l, s, t.page_size));
            dst[k] = reinterpret_cast<V *>(item_address(t.dst, kv, l, d, t.page_size));
        }
        for (int base = 0; base < words; base += 32 * PER_LANE) {
            V r[ILP][PER_LANE];
#pragma unroll
            for (int k = 0; k < ILP; ++k)
#pragma unroll
                for (int p = 0; p < PER_LANE; ++p) {
                    const int j = base + lane + 32 * p;
                    if (src[k] != nullptr && j < words) r[k][p] = src[k][j];
                }
#pragma unroll
            for (int k = 0; k < ILP; ++k)
#pragma unroll
                for (int p = 0; p < PER_LANE; ++p) {
                    const int j = base + lane + 32 * p;
                    if (dst[k] != nullptr && j < words) dst[k][j] = r[k][p];
                }
        }
    }
}

template <int VEC>
void launch_vec(const Transfer &t, int ilp, int ctas, int threads, gpuStream_t s) {
    const std::int64_t per_lane = (t.item_bytes / VEC + 31) / 32;
    if (per_lane <= 1) {
        transfer_kernel<VEC, 4, 1><<<ctas, threads, 0, s>>>(t);
    } else if (per_lane == 2) {
        if (ilp >= 4) transfer_kernel<VEC, 4, 2><<<ctas, threads, 0, s>>>(t);
        else if (ilp == 2) transfer_kernel<VEC, 2, 2><<<ctas, threads, 0, s>>>(t);
        else transfer_kernel<VEC, 1, 2><<<ctas, threads, 0, s>>>(t);
    } else if (per_lane == 3) {  // 1152 B MLA items
        if (ilp >= 4) transfer_kernel<VEC, 3, 3><<<ctas, threads, 0, s>>>(t);
        else if (ilp >= 2) transfer_kernel<VEC, 2, 3><<<ctas, threads, 0, s>>>(t);
        else transfer_kernel<VEC, 1, 3><<<ctas, threads, 0, s>>>(t);
    } else {  // 2 KiB and larger items: 2 KiB per pass
        if (ilp >= 2) transfer_kernel<VEC, 2, 4><<<ctas, threads, 0, s>>>(t);
        else transfer_kernel<VEC, 1, 4><<<ctas, threads, 0, s>>>(t);
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
    int threads = 1024, ilp = 4;
    const std::int64_t items = t.n * t.num_kv * t.layer_count;
    if (items == 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    int ctas = max_ctas;
    if (ctas <= 0) {
        int sms = 0;
        if (const int e = multiprocessor_count(device, &sms)) return e;
        // Whole GPU: the CTAs that fit at once (64 registers per thread: 65536 / (64 * threads)
        // per SM), so no second wave of CTAs arrives late and leaves SMs idle at the tail.
        ctas = sms * (threads <= 512 ? 1024 / threads : 1);
    }
    const std::int64_t warps_needed = (items + ilp - 1) / ilp;
    const std::int64_t needed = (warps_needed + threads / 32 - 1) / (threads / 32);
    if (needed < ctas) ctas = static_cast<int>(needed);
    const auto s = reinterpret_cast<gpuStream_t>(stream);
    switch (vec_bytes) {
        case 16: launch_vec<16>(t, ilp, ctas, threads, s); break;
        case 8: launch_vec<8>(t, ilp, ctas, threads, s); break;
        case 4: launch_vec<4>(t, ilp, ctas, threads, s); break;
        default: launch_vec<1>(t, ilp, ctas, threads, s); break;
    }
    return finish(gpuGetLastError());
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
