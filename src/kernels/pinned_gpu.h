// Rung 3 of the registration ladder: memory the runtime allocates pinned
// (cudaHostAlloc / hipHostMalloc, portable | mapped) when registering pages fails.
#pragma once
#include <cstdint>

namespace pointerdomain::gpu {

// Runtime status; *out is the host pointer. The pending error of a failed call is consumed.
int pinned_alloc(std::uint64_t nbytes, int device, void **out);
// cudaFreeHost / hipHostFree (errors ignored: called from a tensor's deleter).
void pinned_free(void *ptr) noexcept;

}  // namespace pointerdomain::gpu
