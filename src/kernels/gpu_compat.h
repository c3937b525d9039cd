// The few runtime names that differ between CUDA and HIP: the kernel and runtime
// code (transfer_gpu.cu) spells gpu* and this header maps them, so one source builds
// for both. POINTERDOMAIN_HIP is set by CMake for POINTERDOMAIN_GPU=hip, which also
// force-includes this header (-include) ahead of every other one, as nvcc implicitly
// includes cuda_runtime.h: headers shared with the CPU build (transfer.h) then see
// __host__ / __device__ / __forceinline__ without including a runtime header.
#pragma once
#if defined(__HIP_PLATFORM_AMD__) || defined(POINTERDOMAIN_HIP)
#include <hip/hip_runtime.h>
#include <hip/hip_version.h>
#define PD_RUNTIME_NAME "hip"
// HIP passes kernel arguments by value in constant memory already; the CUDA 11.7+
// qualifier that says so has no HIP spelling.
#ifndef __grid_constant__
#define __grid_constant__
#endif
#define gpuError_t hipError_t
#define gpuSuccess hipSuccess
#define gpuStream_t hipStream_t
#define gpuGetDevice hipGetDevice
#define gpuSetDevice hipSetDevice
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuRuntimeGetVersion hipRuntimeGetVersion
#define gpuHostRegister hipHostRegister
#define gpuHostRegisterPortable hipHostRegisterPortable
#define gpuHostRegisterMapped hipHostRegisterMapped
#define gpuHostUnregister hipHostUnregister
#define gpuHostGetDevicePointer hipHostGetDevicePointer
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrCanUseHostPointerForRegisteredMem hipDeviceAttributeCanUseHostPointerForRegisteredMem
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuHostAlloc hipHostMalloc
#define gpuHostAllocPortable hipHostMallocPortable
#define gpuHostAllocMapped hipHostMallocMapped
#define gpuFreeHost hipHostFree
#define gpuMemoryTypeHost hipMemoryTypeHost
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor hipOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncAttributes hipFuncAttributes
#define gpuFuncGetAttributes hipFuncGetAttributes
// Device attributes for attributes_gpu.cu. HIP defines no HostRegister(ReadOnly)Supported
// attribute: the query answers hipErrorNotSupported for them.
#define gpuDeviceAttr_t hipDeviceAttribute_t
#define gpuErrorNotSupported hipErrorNotSupported
#define gpuErrorInvalidValue hipErrorInvalidValue
#define gpuDevAttrPageableMemoryAccess hipDeviceAttributePageableMemoryAccess
#define gpuDevAttrPageableMemoryAccessUsesHostPageTables hipDeviceAttributePageableMemoryAccessUsesHostPageTables
#define gpuDevAttrPciDomainId hipDeviceAttributePciDomainID
#define gpuDevAttrPciBusId hipDeviceAttributePciBusId
#define gpuDevAttrPciDeviceId hipDeviceAttributePciDeviceId
#define PD_HAS_HOST_REGISTER_ATTRS 0
#define gpuEvent_t hipEvent_t
#define gpuErrorInvalidDevice hipErrorInvalidDevice
#define gpuEventCreateWithFlags hipEventCreateWithFlags
#define gpuEventDisableTiming hipEventDisableTiming
#define gpuEventRecord hipEventRecord
#define gpuStreamWaitEvent hipStreamWaitEvent
#define gpuStreamCreateWithFlags hipStreamCreateWithFlags
#define gpuStreamNonBlocking hipStreamNonBlocking
#define gpuEventQuery hipEventQuery
#define gpuErrorNotReady hipErrorNotReady
#define gpuStreamIsCapturing hipStreamIsCapturing
#define gpuStreamCaptureStatus hipStreamCaptureStatus
#define gpuStreamCaptureStatusNone hipStreamCaptureStatusNone
#define gpuEventSynchronize hipEventSynchronize
// hipPointerAttribute_t names the memory type `memoryType` before ROCm 6 and `type`
// from ROCm 6 on (CUDA: `type`); this view gives callers `attr.type` on every version.
struct pdHipPointerAttributes {
    hipMemoryType type;
};
inline hipError_t pdHipPointerGetAttributes(pdHipPointerAttributes *out, const void *ptr) {
    hipPointerAttribute_t attr{};
    const hipError_t e = hipPointerGetAttributes(&attr, ptr);
#if HIP_VERSION_MAJOR >= 6
    out->type = attr.type;
#else
    out->type = attr.memoryType;
#endif
    return e;
}
#define gpuPointerAttributes pdHipPointerAttributes
#define gpuPointerGetAttributes pdHipPointerGetAttributes
#else
#include <cuda_runtime.h>
#define PD_RUNTIME_NAME "cuda"
#define gpuError_t cudaError_t
#define gpuSuccess cudaSuccess
#define gpuStream_t cudaStream_t
#define gpuGetDevice cudaGetDevice
#define gpuSetDevice cudaSetDevice
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuRuntimeGetVersion cudaRuntimeGetVersion
#define gpuHostRegister cudaHostRegister
#define gpuHostRegisterPortable cudaHostRegisterPortable
#define gpuHostRegisterMapped cudaHostRegisterMapped
#define gpuHostUnregister cudaHostUnregister
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrCanUseHostPointerForRegisteredMem cudaDevAttrCanUseHostPointerForRegisteredMem
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuHostAlloc cudaHostAlloc
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuFreeHost cudaFreeHost
#define gpuPointerAttributes cudaPointerAttributes
#define gpuPointerGetAttributes cudaPointerGetAttributes
#define gpuMemoryTypeHost cudaMemoryTypeHost
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define gpuFuncAttributes cudaFuncAttributes
#define gpuFuncGetAttributes cudaFuncGetAttributes
// Device attributes for attributes_gpu.cu.
#define gpuDeviceAttr_t cudaDeviceAttr
#define gpuErrorNotSupported cudaErrorNotSupported
#define gpuErrorInvalidValue cudaErrorInvalidValue
#define gpuDevAttrPageableMemoryAccess cudaDevAttrPageableMemoryAccess
#define gpuDevAttrPageableMemoryAccessUsesHostPageTables cudaDevAttrPageableMemoryAccessUsesHostPageTables
#define gpuDevAttrHostRegisterSupported cudaDevAttrHostRegisterSupported
#define gpuDevAttrHostRegisterReadOnlySupported cudaDevAttrHostRegisterReadOnlySupported
#define gpuDevAttrPciDomainId cudaDevAttrPciDomainId
#define gpuDevAttrPciBusId cudaDevAttrPciBusId
#define gpuDevAttrPciDeviceId cudaDevAttrPciDeviceId
#define PD_HAS_HOST_REGISTER_ATTRS 1
#define gpuEvent_t cudaEvent_t
#define gpuErrorInvalidDevice cudaErrorInvalidDevice
#define gpuEventCreateWithFlags cudaEventCreateWithFlags
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuEventRecord cudaEventRecord
#define gpuStreamWaitEvent cudaStreamWaitEvent
#define gpuStreamCreateWithFlags cudaStreamCreateWithFlags
#define gpuStreamNonBlocking cudaStreamNonBlocking
#define gpuEventQuery cudaEventQuery
#define gpuErrorNotReady cudaErrorNotReady
#define gpuStreamIsCapturing cudaStreamIsCapturing
#define gpuStreamCaptureStatus cudaStreamCaptureStatus
#define gpuStreamCaptureStatusNone cudaStreamCaptureStatusNone
#define gpuEventSynchronize cudaEventSynchronize
#endif
