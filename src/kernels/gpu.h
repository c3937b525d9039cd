// GPU runtime calls and the GPU transfer launch, declared in plain C++ so the
// nanobind module compiles without the CUDA (or HIP) headers. Every function
// returns the runtime's error code (0 = success) and leaves no sticky error.
#pragma once
#include <cstddef>
#include <cstdint>

#include "transfer.h"

namespace pointerdomain::gpu {

const char *runtime_name();   // "cuda" or "hip"
int runtime_version(int *version);
int device_count(int *count);
int host_register(std::uint64_t va, std::uint64_t nbytes, int device);
int host_unregister(std::uint64_t va, int device);
// cudaHostGetDevicePointer / hipHostGetDevicePointer on `device`.
int host_get_device_pointer(std::uint64_t va, int device, std::uint64_t *alias);
// cudaDevAttrCanUseHostPointerForRegisteredMem (HIP: the same attribute).
int can_use_host_pointer_for_registered_mem(int device, int *value);
// 1 if the runtime reports ptr as registered / pinned host memory, else 0.
int pointer_is_host(std::uint64_t ptr, int *is_host);
int multiprocessor_count(int device, int *count);
// Launch on `stream` (a cudaStream_t as an integer) under a device guard.
// vec_bytes: 16, 8, 4 or 1 (Python checks alignment); max_ctas <= 0: the whole GPU
// (the CTAs resident at once). The kernel's own shape (threads, items in flight)
// is chosen here, from the item size.
int transfer(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes);
// Copy-engine path: count copies dsts[i] <- srcs[i] of sizes[i] bytes (host arrays of
// device addresses / aliases) with cudaMemcpyBatchAsync (CUDA >= 12.8) or a
// cudaMemcpyAsync loop.
int copy_runs(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes, std::size_t count,
              int device, std::uint64_t stream, bool use_batch);
bool has_batch_copy();
const char *error_string(int code);

}  // namespace pointerdomain::gpu
