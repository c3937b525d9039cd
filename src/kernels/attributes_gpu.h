// One generic device-attribute query (pointerdomain doctor, NUMA lookup), declared in
// plain C++ so module.cpp compiles without the CUDA (or HIP) headers.
#pragma once

namespace pointerdomain::gpu {

// Portable attribute ids: the runtime enums number them differently (cudaDeviceAttr vs
// hipDeviceAttribute_t), so callers name an attribute by this id and attributes_gpu.cu
// maps it to the runtime's value through gpu_compat.h.
enum class DeviceAttribute : int {
    CanUseHostPointerForRegisteredMem = 0,
    PageableMemoryAccess = 1,
    PageableMemoryAccessUsesHostPageTables = 2,
    HostRegisterSupported = 3,
    HostRegisterReadOnlySupported = 4,
    PciDomainId = 5,
    PciBusId = 6,
    PciDeviceId = 7,
};

// cudaDeviceGetAttribute / hipDeviceGetAttribute of `attribute` on `device`: the runtime
// status (0 = success; no sticky error left). An attribute this runtime does not define
// (HIP has no HostRegister*Supported) returns the runtime's "not supported" status.
int device_attribute(int attribute, int device, int *value);

}  // namespace pointerdomain::gpu
