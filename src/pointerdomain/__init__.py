"""pointerdomain: host VAs and device aliases as distinct types, pointer tables
that carry their domain and device, registered host memory, and KV-cache
transfer kernels that accept only device aliases.

See docs/design.md for the two address domains and the rules.
"""

from pointerdomain import checked, errors
from pointerdomain.domains import Address, DeviceAlias, HostVA
from pointerdomain.devices import Device, as_device
from pointerdomain.devices import DeviceGuard
from pointerdomain.kernels import DEFAULT_MAX_CTAS, WHOLE_GPU, MaxCtas, WholeGpu, transfer_kv_all_layer, transfer_kv_per_layer
from pointerdomain.layouts import KVLayout
from pointerdomain.memory import RegisteredHostMemory, register_host_tensor
from pointerdomain.allocation import alloc_registered, device_empty, memory_device
from pointerdomain.metadata import BufferInfo, buffer_infos, page_buffer_meta
from pointerdomain.pools import DeviceKVPool, HostKVPool
from pointerdomain.resolve import AliasPolicy, alias_policy, fallback_count, reset_resolver_cache, resolve_alias
from pointerdomain.tables import PointerTable, host_ptr_table, make_kernel_ptr_table

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MAX_CTAS",
    "WHOLE_GPU",
    "Address",
    "AliasPolicy",
    "BufferInfo",
    "Device",
    "DeviceAlias",
    "DeviceGuard",
    "DeviceKVPool",
    "HostKVPool",
    "HostVA",
    "KVLayout",
    "MaxCtas",
    "PointerTable",
    "RegisteredHostMemory",
    "__version__",
    "alias_policy",
    "alloc_registered",
    "as_device",
    "buffer_infos",
    "checked",
    "device_empty",
    "errors",
    "memory_device",
    "fallback_count",
    "host_ptr_table",
    "make_kernel_ptr_table",
    "page_buffer_meta",
    "register_host_tensor",
    "reset_resolver_cache",
    "resolve_alias",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer",
    "WholeGpu",
]
