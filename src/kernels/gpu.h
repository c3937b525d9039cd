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
int transfer(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes,
             bool shared_marks = false);
// Load every transfer and staged kernel into `device`'s context now (cudaFuncGetAttributes).
// Under lazy module loading (CUDA >= 12.2's default) the first launch of a kernel loads it,
// which may synchronise the context, so a first launch queued behind other work would
// wait for that work; the library calls this when a device's first kernel table is built.
int preload_kernels(int device);
int staged_preload();  // staged_gpu.cu's own kernels (the device current already)
// Launch leases (pointerdomain.registration.leases): one event per (device, stream) that every launch
// on the stream re-records, so close() of registered memory can wait for the GPU work.
// Events cross as integers (the gpuEvent_t), are made with timing disabled and live
// for the process (one per stream a launch used).
//   event_create: a new event of `device`.
//   event_record: record `event` on `stream` of `device` unless the stream is being
//     captured into a graph (a captured launch runs at replay, which the caller orders):
//     0 (recorded), kNotRecorded (capturing: nothing recorded) or a runtime error.
//   event_query: 0 once the work before the event's last record is done (also for an
//     event never recorded), gpuErrorNotReady before, or another runtime error.
//   transfer_recorded: transfer() and then event_record() of the same stream in one
//     call (one crossing from Python per launch): 0 (launched, recorded), kNotRecorded
//     (launched into a capture, or nothing to launch: n == 0) or a runtime error
//     (nothing recorded). The capture state is read before the launch.
//   stream_capturing: *capturing = 1 while `stream` of `device` is being captured.
constexpr int kNotRecorded = -3;
// transfer / transfer_recorded with `shared_marks` (the stream's own duplicate-check scratch,
// Transfer::marks, reused by its later launches) on a stream being captured: nothing is
// launched; the caller passes scratch of the graph's own instead (a graph replayed on another
// stream must not share the scratch of eager launches).
constexpr int kMarksPerCapture = -4;
int event_create(int device, std::uint64_t *event);
int event_record(std::uint64_t event, int device, std::uint64_t stream);
int event_query(std::uint64_t event);
int not_ready_status();
int transfer_recorded(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes,
                      std::uint64_t event, bool shared_marks = false);
int stream_capturing(int device, std::uint64_t stream, int *capturing);
// The layer pipeline (pointerdomain.transfer.layers): one launch that moves t's layers in
// order and, once every CTA is done with layer l, writes `gen` to the uint32 word
// flags[l - t.layer_begin] (device address; host-mapped memory, so the host reads it).
// counters: as many uint32 words of device memory, 0 before the launch (the kernel leaves
// them 0). event (nonzero): recorded after the kernel. Refused (invalid value) while the
// stream is being captured. Returns 0, kNotRecorded (event 0) or a runtime error.
int transfer_layers(const Transfer &t, int device, std::uint64_t stream, int max_ctas, int vec_bytes,
                    std::uint64_t flags, std::uint64_t counters, std::uint32_t gen, std::uint64_t event);
// Stream memory operations on a uint32 word (device address): the stream waits until
// (int32_t)(*addr - value) >= 0 (cuStreamWaitValue32 GEQ), or writes value once the
// stream's earlier work is done (cuStreamWriteValue32). The status is a CUresult
// (hipError_t on HIP); 801 (not supported) where the driver lacks them.
int stream_wait_value(int device, std::uint64_t stream, std::uint64_t addr, std::uint32_t value);
int stream_write_value(int device, std::uint64_t stream, std::uint64_t addr, std::uint32_t value);
int event_synchronize(std::uint64_t event);
// Copy-engine path: count copies dsts[i] <- srcs[i] of sizes[i] bytes (host arrays of
// device addresses / aliases) with cudaMemcpyBatchAsync (CUDA >= 12.8) or a
// cudaMemcpyAsync loop. The batched copy contract (pointerdomain/_platform/batch_copy.py):
// at most kMaxBatchDescriptors per batch call, one attribute for all of a call's
// descriptors (numAttrs 1, attrsIdxs {0}), the legacy stream (0 or cudaStreamLegacy)
// through a side stream ordered by events before and after, and the cudaMemcpyAsync
// loop while the stream is being captured (a batch call is not captured).
constexpr std::size_t kMaxBatchDescriptors = 8192;  // batch_copy.MAX_DESCRIPTORS
int copy_runs(const std::uint64_t *dsts, const std::uint64_t *srcs, const std::uint64_t *sizes, std::size_t count,
              int device, std::uint64_t stream, bool use_batch);
bool has_batch_copy();
// Staged copy-engine path (staged_gpu.cu). The host side's moved items of
// one slot and kv must be one contiguous block (page_first with s_layer == item_bytes, or a
// single layer): the copy engine then moves whole runs of consecutive host blocks between
// the host pool and a device staging ring while a kernel of at most max_ctas CTAs scatters
// (H2D) or gathers (D2H) the items between the ring and the device pool at HBM speed;
// chunk k's copies overlap chunk k-1's kernel (events on an internal copy stream).
//   t: the transfer as the kernel path would run it (device tables, device index arrays).
//   host_is_src: true for H2D (t.src is the host side), false for D2H.
//   host: the host side again, with its table in HOST memory (the same alias values).
//   host_idx: host copy of the host side's n slot indices.
//   staging, staging_bytes: a device buffer (>= 64 KiB plus one chunk per ring slot),
//   owned by the caller, used by no one else until the stream has passed this call.
//   ring: 2..8 slots.
// Ordered on `stream` like transfer(): work before it on the stream is seen, work after
// it sees the result. Returns 0, a runtime error, kStagedNotApplicable (the layout gives
// no contiguous blocks, or the staging buffer is too small) or kStagedBadIndex (a host
// index outside [0, host.num_slots); nothing was launched).
constexpr int kStagedNotApplicable = -1;
constexpr int kStagedBadIndex = -2;
int staged_transfer(const Transfer &t, bool host_is_src, const Side &host, const std::int64_t *host_idx,
                    std::uint64_t staging, std::uint64_t staging_bytes, int ring, int device, std::uint64_t stream,
                    int max_ctas, int vec_bytes);
const char *error_string(int code);

}  // namespace pointerdomain::gpu
