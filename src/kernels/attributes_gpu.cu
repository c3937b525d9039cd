#include "attributes_gpu.h"
#include "gpu_compat.h"

namespace pointerdomain::gpu {

int device_attribute(int attribute, int device, int *value) {
    *value = 0;
    gpuDeviceAttr_t id{};
    switch (static_cast<DeviceAttribute>(attribute)) {
    case DeviceAttribute::CanUseHostPointerForRegisteredMem: id = gpuDevAttrCanUseHostPointerForRegisteredMem; break;
    case DeviceAttribute::PageableMemoryAccess: id = gpuDevAttrPageableMemoryAccess; break;
    case DeviceAttribute::PageableMemoryAccessUsesHostPageTables:
        id = gpuDevAttrPageableMemoryAccessUsesHostPageTables;
        break;
#if PD_HAS_HOST_REGISTER_ATTRS
    case DeviceAttribute::HostRegisterSupported: id = gpuDevAttrHostRegisterSupported; break;
    case DeviceAttribute::HostRegisterReadOnlySupported: id = gpuDevAttrHostRegisterReadOnlySupported; break;
#else
    case DeviceAttribute::HostRegisterSupported:
    case DeviceAttribute::HostRegisterReadOnlySupported: return static_cast<int>(gpuErrorNotSupported);
#endif
    case DeviceAttribute::PciDomainId: id = gpuDevAttrPciDomainId; break;
    case DeviceAttribute::PciBusId: id = gpuDevAttrPciBusId; break;
    case DeviceAttribute::PciDeviceId: id = gpuDevAttrPciDeviceId; break;
    default: return static_cast<int>(gpuErrorInvalidValue);
    }
    const gpuError_t e = gpuDeviceGetAttribute(value, id, device);
    if (e != gpuSuccess) (void)gpuGetLastError();  // leave no pending error for the next call
    return static_cast<int>(e);
}

}  // namespace pointerdomain::gpu
