#include "gpu.h"
#include "gpu_compat.h"

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

// One warp per (slot pair, kv, layer) item; lanes stride over the item in
// VEC-byte words. Items are small (1-2 KiB), so a warp finishes one in a
// couple of iterations and the grid-stride loop keeps many items in flight.
template <int VEC>
__global__ void transfer_kernel(Transfer t) {
    using V = typename Vec<VEC>::T;
    const int lane = threadIdx.x & 31;
    const std::int64_t warp = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const std::int64_t nwarps = (static_cast<std::int64_t>(gridDim.x) * blockDim.x) >> 5;
    const std::int64_t per_slot = t.num_kv * t.layer_count;
    const std::int64_t items = t.n * per_slot;
    const std::int64_t words = t.item_bytes / VEC;
    for (std::int64_t w = warp; w < items; w += nwarps) {
        const std::int64_t i = w / per_slot, r = w - i * per_slot;
        const std::int64_t kv = r / t.layer_count, l = t.layer_begin + (r - kv * t.layer_count);
        const std::int64_t s = t.src_idx[i], d = t.dst_idx[i];
        if (!slot_ok(s, t.src.num_slots) || !slot_ok(d, t.dst.num_slots)) continue;
        const V *src = reinterpret_cast<const V *>(item_address(t.src, kv, l, s, t.page_size));
        V *dst = reinterpret_cast<V *>(item_address(t.dst, kv, l, d, t.page_size));
#pragma unroll 4
        for (std::int64_t j = lane; j < words; j += 32) dst[j] = src[j];
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
    const std::int64_t items = t.n * t.num_kv * t.layer_count;
    if (items == 0) return 0;
    DeviceGuard guard(device);
    if (guard.status() != gpuSuccess) return finish(guard.status());
    constexpr int threads = 256, warps_per_cta = threads / 32;
    int ctas = max_ctas;
    if (ctas <= 0) {
        int sms = 0;
        if (const int e = multiprocessor_count(device, &sms)) return e;
        ctas = 4 * sms;
    }
    const std::int64_t needed = (items + warps_per_cta - 1) / warps_per_cta;
    if (needed < ctas) ctas = static_cast<int>(needed);
    const auto s = reinterpret_cast<gpuStream_t>(stream);
    switch (vec_bytes) {
        case 16: transfer_kernel<16><<<ctas, threads, 0, s>>>(t); break;
        case 8: transfer_kernel<8><<<ctas, threads, 0, s>>>(t); break;
        case 4: transfer_kernel<4><<<ctas, threads, 0, s>>>(t); break;
        default: transfer_kernel<1><<<ctas, threads, 0, s>>>(t); break;
    }
    return finish(gpuGetLastError());
}

const char *error_string(int code) { return gpuGetErrorString(static_cast<gpuError_t>(code)); }

}  // namespace pointerdomain::gpu
