#include "gpu_compat.h"
#include "pinned_gpu.h"

namespace pointerdomain::gpu {

int pinned_alloc(std::uint64_t nbytes, int device, void **out) {
    *out = nullptr;
    int previous = 0;
    gpuError_t e = gpuGetDevice(&previous);
    if (e == gpuSuccess) e = gpuSetDevice(device);
    if (e == gpuSuccess) {
        e = gpuHostAlloc(out, static_cast<size_t>(nbytes), gpuHostAllocPortable | gpuHostAllocMapped);
        (void)gpuSetDevice(previous);
    }
    if (e != gpuSuccess) {
        (void)gpuGetLastError();  // no pending error for the next, unrelated call
        *out = nullptr;
    }
    return static_cast<int>(e);
}

void pinned_free(void *ptr) noexcept {
    if (ptr != nullptr && gpuFreeHost(ptr) != gpuSuccess) (void)gpuGetLastError();
}

}  // namespace pointerdomain::gpu
